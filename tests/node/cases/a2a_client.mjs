// A2A's official JS client (@a2a-js/sdk, pinned in ../package.json) against the service's A2A face
// (FACES.md N-08), as another agent drives it. SCENARIO picks what it does; the answer is what the
// client received: task states by name, the answer artifact as the client assembles it, the error
// classes it raised.
//
// Environment: AGENTSTREAM_BASE, AGENTSTREAM_KEY, SCENARIO (stream | approval | resubscribe |
// cancel | follow-up | errors), BINDING (JSONRPC | HTTP+JSON), AGENT (JSON, metadata.agent of a
// new task), MARKER (a file the script creates once it holds what the test waits for before it
// lets the model go on).
import { writeFileSync } from "node:fs";
import { Role, TaskState } from "@a2a-js/sdk";
import {
  ClientFactory,
  ClientFactoryOptions,
  JsonRpcTransportFactory,
  RestTransportFactory,
} from "@a2a-js/sdk/client";
import { env, errorJson, main, service } from "../lib/io.mjs";

const { base, headers } = service();
const scenario = env("SCENARIO");
const binding = env("BINDING", "JSONRPC");
const agentSettings = env("AGENT", "");

/** fetch with the caller's credentials: the service's own auth (an API key, a bearer token). */
const authed = (input, init = {}) => fetch(input, { ...init, headers: { ...(init.headers ?? {}), ...headers } });

async function client() {
  const options = ClientFactoryOptions.createFrom(ClientFactoryOptions.default, {
    transports: [new JsonRpcTransportFactory({ fetchImpl: authed }), new RestTransportFactory({ fetchImpl: authed })],
    preferredTransports: [binding],
  });
  return new ClientFactory(options).createFromUrl(base);
}

let counter = 0;
const text = (value) => ({ content: { $case: "text", value } });
const data = (value) => ({ content: { $case: "data", value } });
function message(parts, extra = {}) {
  return { messageId: `m-${process.pid}-${++counter}`, role: Role.ROLE_USER, parts, ...extra };
}
function request(msg, extra = {}) {
  const req = { message: msg, ...extra };
  if (agentSettings) req.metadata = { agent: JSON.parse(agentSettings) };
  return req;
}
const stateName = (state) => TaskState[state];

/** What a stream brought: each event's kind, the states by name, the answer as assembled. */
class Received {
  constructor(start = "") {
    this.kinds = [];
    this.states = [];
    this.answer = start;
    this.lastChunks = 0;
    this.task = null;
    this.statusMessages = [];
  }
  add(event) {
    const { $case, value } = event.payload;
    this.kinds.push($case);
    if ($case === "task") {
      this.task = value;
      this.states.push(stateName(value.status.state));
    } else if ($case === "statusUpdate") {
      this.states.push(stateName(value.status.state));
      this.statusMessages.push(value.status.message ?? null);
    } else if ($case === "artifactUpdate") {
      const chunk = value.artifact.parts.map((p) => (p.content?.$case === "text" ? p.content.value : "")).join("");
      this.answer = value.append ? this.answer + chunk : chunk;
      if (value.lastChunk) this.lastChunks += 1;
    }
  }
  async drain(stream) {
    for await (const event of stream) this.add(event);
    return this;
  }
  json() {
    return { kinds: this.kinds, states: this.states, answer: this.answer, lastChunks: this.lastChunks };
  }
}

const answerOf = (task) =>
  (task.artifacts ?? [])
    .filter((a) => a.artifactId === "answer")
    .flatMap((a) => a.parts.map((p) => (p.content?.$case === "text" ? p.content.value : "")))
    .join("");
const dataParts = (msg) => (msg?.parts ?? []).filter((p) => p.content?.$case === "data").map((p) => p.content.value);
const marker = () => writeFileSync(env("MARKER"), "ready");

async function caught(fn) {
  try {
    await fn();
    return null;
  } catch (error) {
    return errorJson(error).class ?? error.constructor.name;
  }
}
const drainAll = async (stream) => {
  for await (const _ of stream);
};

async function run() {
  const a2a = await client();
  if (scenario === "stream") {
    const got = await new Received().drain(a2a.sendMessageStream(request(message([text("what is 6*7?")]))));
    const task = await a2a.getTask({ id: got.task.id });
    const listed = await a2a.listTasks({ contextId: got.task.contextId, includeArtifacts: true });
    return {
      ...got.json(),
      taskId: got.task.id,
      get: { state: stateName(task.status.state), answer: answerOf(task) },
      listed: listed.tasks.map((t) => ({ id: t.id, answer: answerOf(t) })),
    };
  }
  if (scenario === "approval") {
    const first = await new Received().drain(a2a.sendMessageStream(request(message([text("what is 6*7?")]))));
    const asked = dataParts(first.statusMessages.at(-1));
    const decision = message([data({ approval_id: asked[0]?.approval_id, decision: "approve" })], {
      taskId: first.task.id,
      contextId: first.task.contextId,
    });
    const rest = await new Received().drain(a2a.sendMessageStream({ message: decision }));
    return { first: first.json(), asked, rest: rest.json(), sameTask: rest.task?.id === first.task.id };
  }
  if (scenario === "resubscribe") {
    const stream = a2a.sendMessageStream(request(message([text("what is 6*7?")])));
    const opening = await stream.next();
    await stream.return(); // the connection is cut
    const task = opening.value.payload.value;
    const again = a2a.resubscribeTask({ id: task.id });
    const snapshot = await again.next();
    const got = new Received();
    got.add(snapshot.value);
    const start = answerOf(got.task);
    got.answer = start;
    marker();
    for await (const event of again) got.add(event);
    return { ...got.json(), taskId: task.id, snapshotState: got.states[0] };
  }
  if (scenario === "cancel") {
    const sent = await a2a.sendMessage(request(message([text("count to ten")]), { configuration: { returnImmediately: true } }));
    const task = sent.payload?.value ?? sent;
    const cancelled = await a2a.cancelTask({ id: task.id });
    const again = await caught(() => a2a.cancelTask({ id: task.id }));
    return { sent: stateName(task.status.state), cancelled: stateName(cancelled.status.state), again };
  }
  if (scenario === "follow-up") {
    const stream = a2a.sendMessageStream(request(message([text("what is 6*7?")])));
    const task = (await stream.next()).value.payload.value;
    await stream.return();
    const followUp = a2a.sendMessageStream({ message: message([text("and in hex, please")], { taskId: task.id }) });
    const got = new Received();
    got.add((await followUp.next()).value);
    marker();
    for await (const event of followUp) got.add(event);
    const lines = got.statusMessages.map((m) => (m?.parts?.[0]?.content?.value ?? ""));
    return { ...got.json(), followUpTakenIn: lines.includes("follow-up taken in"), snapshotTask: got.task?.id === task.id };
  }
  if (scenario === "errors") {
    const done = await new Received().drain(a2a.sendMessageStream(request(message([text("what is 6*7?")]))));
    const id = done.task.id;
    const badVersion = await fetch(`${base}/a2a`, {
      method: "POST",
      headers: { ...headers, "Content-Type": "application/json", "A2A-Version": "9.0" },
      body: JSON.stringify({ jsonrpc: "2.0", id: 1, method: "GetTask", params: { id } }),
    }).then((r) => r.json());
    return {
      unknownTask: await caught(() => a2a.getTask({ id: "run_nothing" })),
      terminalMessage: await caught(() => drainAll(a2a.sendMessageStream({ message: message([text("more")], { taskId: id }) }))),
      terminalSubscribe: await caught(() => drainAll(a2a.resubscribeTask({ id }))),
      terminalCancel: await caught(() => a2a.cancelTask({ id })),
      badVersion: badVersion.error?.code,
    };
  }
  throw new Error(`unknown scenario ${scenario}`);
}

main(run);
