// The AI SDK's own chat client (AbstractChat + DefaultChatTransport, package `ai`) against
// /api/ai-sdk/chat, as a useChat app drives it. SCENARIO picks what it does; the answer is what
// the chat ends with (its messages, status and error) and what the service's /messages says.
//
// Environment: AGENTSTREAM_BASE, AGENTSTREAM_KEY, SCENARIO, CHAT_ID, TEXT, AGENT (JSON, the
// chat's `agent` body field), APPROVE ("true"/"false"), CUT_AFTER (chunks before the POST's body
// is cut), RESUME_BASE (the worker to resume against after a cut).
import {
  lastAssistantMessageIsCompleteWithApprovalResponses as approvalsDone,
  lastAssistantMessageIsCompleteWithToolCalls as toolsDone,
} from "ai";
import { Chat, DefaultChatTransport, waitIdle } from "../lib/aisdk.mjs";
import { env, errorJson, main, service } from "../lib/io.mjs";

const { base, headers } = service();
const scenario = env("SCENARIO");
const chatId = env("CHAT_ID");
const text = env("TEXT", "what is 6*7?");
const agent = JSON.parse(env("AGENT", "{}"));
const json = (value) => JSON.parse(JSON.stringify(value));

/**
 * A fetch that cuts the body of its `cutPost`-th POST (1: the first) after `cutAfter` frames, and
 * that can move to another worker.
 */
function cuttingFetch(cutAfter, cutPost = 1) {
  let target = base;
  let posts = 0;
  const fetcher = async (url, init) => {
    const moved = String(url).replace(base, target);
    const response = await fetch(moved, init);
    if (init?.method === "POST") posts += 1;
    if (posts !== cutPost || init?.method !== "POST" || cutAfter === undefined || !response.body) return response;
    const reader = response.body.getReader();
    let frames = 0;
    const body = new ReadableStream({
      async pull(controller) {
        const { done, value } = await reader.read();
        if (done) return controller.close();
        controller.enqueue(value);
        frames += new TextDecoder().decode(value).split("\n\n").length - 1;
        if (frames >= cutAfter) {
          await reader.cancel();
          controller.error(new TypeError("terminated"));
        }
      },
    });
    return new Response(body, { status: response.status, headers: response.headers });
  };
  fetcher.moveTo = (other) => {
    target = other;
  };
  return fetcher;
}

async function serverMessages(from = base) {
  const response = await fetch(`${from}/api/ai-sdk/chat/${encodeURIComponent(chatId)}/messages`, { headers });
  if (!response.ok) throw new Error(`/messages answered ${response.status}: ${await response.text()}`);
  return response.json();
}

function newChat(extra = {}) {
  const fetcher = extra.fetch;
  const transport = new DefaultChatTransport({
    api: `${base}/api/ai-sdk/chat`,
    headers,
    body: { agent },
    ...(fetcher ? { fetch: fetcher } : {}),
  });
  const errors = [];
  const calls = [];
  let chat;
  chat = new Chat({
    id: chatId,
    transport,
    sendAutomaticallyWhen: (options) => approvalsDone(options) || toolsDone(options),
    onToolCall: ({ toolCall }) => {
      if (toolCall.dynamic) return; // as the AI SDK's docs have it: server tools are not ours
      calls.push(json(toolCall));
      // Never awaited inside onToolCall (it runs inside the stream's processing).
      void chat.addToolOutput({
        tool: toolCall.toolName,
        toolCallId: toolCall.toolCallId,
        output: { city: "Paris", asked: toolCall.input },
      });
    },
    onError: (error) => errors.push(error.message),
    ...extra.init,
  });
  return { chat, errors, calls };
}

async function outcome(chat, errors, extra = {}) {
  await waitIdle(chat);
  return {
    status: chat.status,
    error: chat.error ? errorJson(chat.error) : null,
    errors,
    messages: json(chat.messages),
    server: await serverMessages(extra.from),
    ...extra,
  };
}

const scenarios = {
  /** One question: the tool, reasoning and text parts of the answer. */
  async send() {
    const { chat, errors } = newChat();
    await chat.sendMessage({ text });
    return outcome(chat, errors);
  },

  /** An approval asked in the stream, decided with addToolApprovalResponse; sent on by the chat. */
  async approval() {
    const { chat, errors } = newChat();
    await chat.sendMessage({ text });
    await waitIdle(chat);
    const asked = json(chat.messages);
    const part = chat.lastMessage.parts.find((p) => p.state === "approval-requested");
    if (!part) return { asked, status: chat.status, errors, messages: asked, server: await serverMessages() };
    await chat.addToolApprovalResponse({
      id: part.approval.id,
      approved: env("APPROVE", "true") === "true",
      reason: env("REASON", "") || undefined,
    });
    // The automatic send starts after the decision's job: wait for it to start, then to end.
    const deadline = Date.now() + 10_000;
    while (chat.status === "ready" && chat.lastMessage.metadata?.status === "waiting" && Date.now() < deadline) {
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
    return outcome(chat, errors, { asked });
  },

  /** A tool the client runs: onToolCall + addToolOutput; the chat sends the output on. */
  async clientTool() {
    const { chat, errors, calls } = newChat();
    await chat.sendMessage({ text });
    const deadline = Date.now() + 10_000;
    while (chat.lastMessage?.metadata?.status === "waiting" && Date.now() < deadline) {
      await new Promise((resolve) => setTimeout(resolve, 10));
      await waitIdle(chat);
    }
    return outcome(chat, errors, { calls });
  },

  /** Two answers to one question: regenerate() sends no messageId. */
  async regenerate() {
    const { chat, errors } = newChat();
    await chat.sendMessage({ text });
    await waitIdle(chat);
    const first = json(chat.messages);
    await chat.regenerate();
    return outcome(chat, errors, { first });
  },

  /** The POST's body is cut mid-answer; resumeStream() (GET .../stream) rebuilds the message. */
  async resumeCut() {
    // CUT_AFTER 0: the body is not cut here (the worker serving it dies instead).
    const fetcher = cuttingFetch(Number(env("CUT_AFTER", "0")) || undefined);
    const { chat, errors } = newChat({ fetch: fetcher });
    await chat.sendMessage({ text });
    await waitIdle(chat);
    const cut = { status: chat.status, messages: json(chat.messages) };
    const resumeBase = env("RESUME_BASE", base);
    fetcher.moveTo(resumeBase);
    let resumes = 0;
    const deadline = Date.now() + 40_000;
    // A reload's `resume: true`: until the message is whole (a worker taking over may take a lease).
    while (chat.lastMessage?.metadata?.status !== "completed" && Date.now() < deadline) {
      resumes += 1;
      await chat.resumeStream();
      await waitIdle(chat, 40_000);
      if (chat.lastMessage?.metadata?.status !== "completed") await new Promise((r) => setTimeout(r, 200));
    }
    return outcome(chat, errors, { cut, resumes, from: resumeBase });
  },

  /** An approval decided; the continuation's body is cut; resumeStream() must rebuild the whole message. */
  async approvalCut() {
    const fetcher = cuttingFetch(Number(env("CUT_AFTER")), 2);
    const { chat, errors } = newChat({ fetch: fetcher });
    await chat.sendMessage({ text });
    await waitIdle(chat);
    const part = chat.lastMessage.parts.find((p) => p.state === "approval-requested");
    await chat.addToolApprovalResponse({ id: part.approval.id, approved: true });
    const started = Date.now();
    while (chat.status === "ready" && chat.lastMessage.metadata?.status === "waiting" && Date.now() - started < 10_000) {
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
    await waitIdle(chat);
    const cut = { status: chat.status, messages: json(chat.messages) };
    let resumes = 0;
    while (chat.lastMessage?.metadata?.status !== "completed" && Date.now() - started < 40_000) {
      resumes += 1;
      await chat.resumeStream();
      await waitIdle(chat, 40_000);
    }
    return outcome(chat, errors, { cut, resumes });
  },

  /** A chat loaded from /messages, then asked again: the history the client sends is the server's. */
  async reload() {
    const loaded = await serverMessages();
    const { chat, errors } = newChat({ init: { messages: loaded } });
    await chat.sendMessage({ text });
    return outcome(chat, errors, { loaded });
  },
};

main(async () => {
  const run = scenarios[scenario];
  if (!run) throw new Error(`unknown SCENARIO ${scenario}`);
  return run();
});
