// What every script under tests/node shares with the Python side (tests/support/node.py):
// parameters come from the environment, and the script's answer is ONE line of JSON, the last
// line it prints on stdout. Anything else may go to stderr (the Python side shows its tail when
// the script fails).

/** The value of an environment variable; a missing one is an error unless a fallback is given. */
export function env(name, fallback) {
  const value = process.env[name];
  if (value !== undefined && value !== "") return value;
  if (fallback !== undefined) return fallback;
  throw new Error(`environment variable ${name} is not set`);
}

/**
 * The service the script talks to: AGENTSTREAM_BASE (e.g. http://127.0.0.1:8123, no trailing
 * slash needed) and AGENTSTREAM_KEY (sent as `Authorization: Bearer <key>`).
 */
export function service() {
  const base = env("AGENTSTREAM_BASE").replace(/\/+$/, "");
  const key = env("AGENTSTREAM_KEY");
  return { base, key, headers: { Authorization: `Bearer ${key}` } };
}

/** Prints `obj` as one line of JSON on stdout: the script's answer. */
export function emit(obj) {
  return new Promise((resolve, reject) => {
    process.stdout.write(`${JSON.stringify(obj)}\n`, (error) => (error ? reject(error) : resolve()));
  });
}

/**
 * Runs a script's body: emits what `fn` returns and exits 0, or prints the error (with its
 * stack and cause) on stderr and exits 1. It exits explicitly, so a keep-alive socket or a
 * timer a client left behind cannot keep the process (and the test waiting on it) alive.
 */
export async function main(fn) {
  let code = 0;
  try {
    await emit(await fn());
  } catch (error) {
    code = 1;
    process.stderr.write(`${describeError(error)}\n`);
  }
  process.exit(code);
}

/** An error as text: its stack, then its cause's, and so on. */
export function describeError(error) {
  const parts = [];
  for (let e = error, depth = 0; e != null && depth < 5; e = e.cause, depth++) {
    parts.push(e instanceof Error ? (e.stack ?? `${e.name}: ${e.message}`) : String(e));
  }
  return parts.join("\ncaused by: ");
}

/**
 * A plain, JSON-safe view of an error: its class (AG-UI's AGUIError has name 'Error', so the
 * class is what tells it apart), name, message, and the fields a client attached.
 */
export function errorJson(error) {
  if (!(error instanceof Error)) return { class: typeof error, name: typeof error, message: String(error) };
  const out = { class: error.constructor?.name ?? "Error", name: error.name, message: error.message };
  for (const key of ["code", "status", "statusCode", "url", "responseBody", "payload"]) {
    if (error[key] !== undefined) out[key] = error[key];
  }
  if (error.cause !== undefined) out.cause = errorJson(error.cause);
  return out;
}
