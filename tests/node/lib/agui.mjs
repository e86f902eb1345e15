// AG-UI's HttpAgent (package @ag-ui/client, pinned in ../package.json), recording what a run
// shows its subscribers. Read against the package's own sources (the sourcesContent of
// node_modules/@ag-ui/client/dist/index.mjs.map): src/agent/agent.ts (runAgent, onError),
// src/agent/subscriber.ts (the AgentSubscriber callbacks), src/agent/http.ts (HttpAgent),
// src/transform/sse.ts (the SSE parser) and src/enforce/enforce.ts (the '[ag-ui]' warnings).
//
// What the client does, in short:
// - The SSE parser splits the body on "\n\n" only (LF framing; a CRLF-framed body is not
//   parsed) and reads only `data:` lines (`id:`, `event:` and comments are ignored).
// - Each event then passes enforcement (unknown fields are stripped, unknown event types dropped,
//   each with a console.warn starting '[ag-ui]'; a malformed known field fails the run), chunk
//   expansion and the verifier (ordering rules: first event RUN_STARTED, nothing after
//   RUN_FINISHED, ...). A verifier or enforcement error fails the run: every subscriber's
//   onRunFailed gets it, the client console.error's "Agent execution failed:", and runAgent
//   rejects with that same error. A RUN_ERROR event does NOT fail the run: runAgent resolves.
// - Subscribers see events (onEvent) after enforcement, so not byte for byte what was sent.
// - Setting SUPPRESS_TRANSFORMATION_WARNINGS in the environment silences the '[ag-ui]'
//   warnings (tests/support/node.py drops it from the environment it passes on).
import { format } from "node:util";
import { HttpAgent } from "@ag-ui/client";
import { errorJson } from "./io.mjs";

export { HttpAgent };

const plain = (value) => (value === undefined ? null : JSON.parse(JSON.stringify(value)));

/**
 * Builds an HttpAgent ({url, headers, threadId, initialMessages, and any other HttpAgentConfig
 * such as `fetch` or `initialState`}) and starts capturing console.warn: every line containing
 * '[ag-ui]' lands in the returned `warnings` (the lines still reach stderr). `restore()` ends
 * the capture.
 *
 * `run(params)` runs the agent once (params are runAgent's: runId, tools, context,
 * forwardedProps, resume) and resolves, never rejects, with JSON-safe
 *   {events, outcome, interrupts, pendingToolCallIds, result, newMessages, runErrors, failures,
 *    consoleErrors}
 * - events: every event a subscriber's onEvent saw, in order;
 * - outcome: RUN_FINISHED's ('success' | 'interrupt' | 'cancelled'), null when none arrived;
 * - interrupts: an interrupt outcome's interrupts, else [];
 * - pendingToolCallIds: a success outcome's tool calls left to answer, else [];
 * - result: a success outcome's result (null when none);
 * - newMessages: runAgent's newMessages ([] when the run failed);
 * - runErrors: the RUN_ERROR events;
 * - failures: the errors the run failed with (onRunFailed, or runAgent's rejection; the same
 *   error is listed once), as {name, message, ...};
 * - consoleErrors: console.error lines during the run (the client logs a failed run, and a
 *   subscriber that throws, there).
 * `agent.messages` and `agent.pendingInterrupts` hold the agent's state after it.
 */
export function recordingAgent({ url, headers, threadId, initialMessages, ...config }) {
  const agent = new HttpAgent({ url, headers, threadId, initialMessages, ...config });
  const warnings = [];
  const originalWarn = console.warn;
  console.warn = (...args) => {
    const line = format(...args);
    if (line.includes("[ag-ui]")) warnings.push(line);
    originalWarn.apply(console, args);
  };
  const restore = () => {
    console.warn = originalWarn;
  };

  async function run(params = {}) {
    const events = [];
    const runErrors = [];
    const failures = [];
    const consoleErrors = [];
    let outcome = null;
    let interrupts = [];
    let pendingToolCallIds = [];
    let result = null;
    let newMessages = [];

    const subscriber = {
      onEvent: ({ event }) => {
        events.push(plain(event));
      },
      onRunErrorEvent: ({ event }) => {
        runErrors.push(plain(event));
      },
      onRunFinishedEvent: (finished) => {
        outcome = finished.outcome;
        if (finished.outcome === "interrupt") interrupts = plain(finished.interrupts) ?? [];
        if (finished.outcome === "success") {
          pendingToolCallIds = [...(finished.pendingToolCallIds ?? [])];
          result = plain(finished.result);
        }
      },
      onRunFailed: ({ error }) => {
        if (!failures.includes(error)) failures.push(error);
      },
    };

    const originalError = console.error;
    console.error = (...args) => {
      consoleErrors.push(format(...args));
      originalError.apply(console, args);
    };
    try {
      ({ newMessages } = await agent.runAgent(params, subscriber));
      newMessages = plain(newMessages);
    } catch (error) {
      if (!failures.includes(error)) failures.push(error);
    } finally {
      console.error = originalError;
    }
    return {
      events,
      outcome,
      interrupts,
      pendingToolCallIds,
      result,
      newMessages,
      runErrors,
      failures: failures.map(errorJson),
      consoleErrors,
    };
  }

  return { agent, run, warnings, restore };
}
