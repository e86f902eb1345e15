// The harness without the service (tests/unit/test_node_harness.py): the pinned clients are the
// ones installed, the AI SDK folds a fixed UI message chunk stream (alone, through a transport,
// and in a Chat), and HttpAgent reads fixed AG-UI SSE bodies through a fake fetch.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { Chat, DefaultChatTransport, fold, readOne, waitIdle } from "../lib/aisdk.mjs";
import { recordingAgent } from "../lib/agui.mjs";
import { main } from "../lib/io.mjs";

const require = createRequire(import.meta.url);
const pins = require("../package.json").dependencies;

function installedVersions() {
  const out = {};
  // Read from node_modules directly: a package's `exports` may not list its package.json.
  for (const name of Object.keys(pins)) {
    const file = new URL(`../node_modules/${name}/package.json`, import.meta.url);
    out[name] = JSON.parse(readFileSync(file, "utf8")).version;
  }
  return out;
}

async function aisdkFold() {
  const chunks = [
    { type: "start", messageId: "msg-1" },
    { type: "text-start", id: "t1" },
    { type: "text-delta", id: "t1", delta: "Hello, " },
    { type: "text-delta", id: "t1", delta: "world" },
    { type: "text-end", id: "t1" },
    { type: "finish", finishReason: "stop" },
  ];
  const stream = new ReadableStream({
    start(controller) {
      for (const chunk of chunks) controller.enqueue(chunk);
      controller.close();
    },
  });
  const { message, chunks: seen } = await fold(stream);
  return { message, chunkTypes: seen.map((chunk) => chunk.type) };
}

// The same chunks as a UI message stream response (SSE, ending with [DONE]) from a fake fetch,
// read by DefaultChatTransport: once with readOne, once by a Chat.
async function aisdkTransport() {
  const chunks = [
    { type: "start", messageId: "msg-2" },
    { type: "text-start", id: "t1" },
    { type: "text-delta", id: "t1", delta: "ok" },
    { type: "text-end", id: "t1" },
    { type: "finish", finishReason: "stop" },
  ];
  const body = `${chunks.map((chunk) => `data: ${JSON.stringify(chunk)}\n\n`).join("")}data: [DONE]\n\n`;
  const requests = [];
  const transport = new DefaultChatTransport({
    api: "http://agentstream.invalid/chat",
    headers: { Authorization: "Bearer test" },
    fetch: async (url, init) => {
      requests.push({ url, body: JSON.parse(init.body) });
      return new Response(body, { headers: { "content-type": "text/event-stream" } });
    },
  });
  const one = await readOne(transport, { chatId: "chat-1" });
  let n = 0;
  const chat = new Chat({ id: "chat-2", transport, generateId: () => `id-${++n}` });
  await chat.sendMessage({ text: "Hi" });
  const status = await waitIdle(chat, 5_000);
  return {
    readOne: { message: one.message, chunkCount: one.chunks.length },
    chat: { status, error: chat.error?.message ?? null, messages: chat.messages },
    requests,
  };
}

async function aguiRun() {
  const events = [
    { type: "RUN_STARTED", threadId: "thread-1", runId: "run-1" },
    { type: "TEXT_MESSAGE_START", messageId: "m1", role: "assistant" },
    { type: "TEXT_MESSAGE_CONTENT", messageId: "m1", delta: "Hi there" },
    { type: "TEXT_MESSAGE_END", messageId: "m1" },
    { type: "RUN_FINISHED", threadId: "thread-1", runId: "run-1" },
  ];
  const body = events.map((event) => `data: ${JSON.stringify(event)}\n\n`).join("");
  const requests = [];
  const fakeFetch = async (url, init) => {
    requests.push({ url, method: init.method, body: JSON.parse(init.body) });
    return new Response(body, { status: 200, headers: { "content-type": "text/event-stream" } });
  };
  const recorder = recordingAgent({
    url: "http://agentstream.invalid/agui",
    headers: { Authorization: "Bearer test" },
    threadId: "thread-1",
    initialMessages: [{ id: "u1", role: "user", content: "Hello" }],
    fetch: fakeFetch,
  });
  try {
    const run = await recorder.run({ runId: "run-1" });
    return {
      run,
      messages: recorder.agent.messages,
      warnings: recorder.warnings,
      request: {
        url: requests[0].url,
        method: requests[0].method,
        threadId: requests[0].body.threadId,
        runId: requests[0].body.runId,
        messages: requests[0].body.messages,
      },
    };
  } finally {
    recorder.restore();
  }
}

// Two runs that go wrong in the ways the recorder reports: a first event that is not RUN_STARTED
// (the verifier fails the run) and a field the protocol does not know (stripped, with a warning).
async function aguiDeviations() {
  const out = {};
  const bodies = {
    verifier: [{ type: "TEXT_MESSAGE_START", messageId: "m1", role: "assistant" }],
    stripped: [
      { type: "RUN_STARTED", threadId: "thread-1", runId: "run-1", extra: 1 },
      { type: "RUN_FINISHED", threadId: "thread-1", runId: "run-1" },
    ],
  };
  for (const [name, events] of Object.entries(bodies)) {
    const body = events.map((event) => `data: ${JSON.stringify(event)}\n\n`).join("");
    const recorder = recordingAgent({
      url: "http://agentstream.invalid/agui",
      threadId: "thread-1",
      fetch: async () => new Response(body, { headers: { "content-type": "text/event-stream" } }),
    });
    try {
      const run = await recorder.run({ runId: "run-1" });
      out[name] = {
        eventTypes: run.events.map((event) => event.type),
        outcome: run.outcome,
        failures: run.failures,
        failureLogged: run.consoleErrors.some((line) => line.startsWith("Agent execution failed:")),
        warnings: recorder.warnings,
      };
    } finally {
      recorder.restore();
    }
  }
  return out;
}

main(async () => ({
  pins,
  installed: installedVersions(),
  aisdk: { fold: await aisdkFold(), transport: await aisdkTransport() },
  agui: { ok: await aguiRun(), ...(await aguiDeviations()) },
}));
