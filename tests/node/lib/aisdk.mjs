// The AI SDK's chat client (package `ai`, pinned in ../package.json), as a test drives it outside
// a browser framework. Read against the installed source: node_modules/ai/src/ui/chat.ts
// (AbstractChat, ChatState), default-chat-transport.ts / http-chat-transport.ts (the HTTP
// transport) and ui-message-stream/read-ui-message-stream.ts (folding chunks into a message).
import { AbstractChat, DefaultChatTransport, readUIMessageStream } from "ai";

export { DefaultChatTransport };

/**
 * The `ChatState` that AbstractChat keeps its messages, status and error in: plain properties,
 * no change notifications. Like the SDK's React state it replaces the array on every change (so a
 * reference taken earlier is a stable view) and stores copies (snapshot = structuredClone), never
 * the live message the stream processor keeps mutating. It has no `experimental_queuedMessages`,
 * so the chat keeps its queue itself (chat.ts checks `'experimental_queuedMessages' in state`).
 */
export class PlainState {
  constructor(messages = []) {
    this.messages = structuredClone(messages);
    this.status = "ready";
    this.error = undefined;
  }

  pushMessage = (message) => {
    this.messages = this.messages.concat(this.snapshot(message));
  };

  popMessage = () => {
    this.messages = this.messages.slice(0, -1);
  };

  replaceMessage = (index, message) => {
    this.messages = [
      ...this.messages.slice(0, index),
      this.snapshot(message),
      ...this.messages.slice(index + 1),
    ];
  };

  snapshot = (thing) => structuredClone(thing);
}

/**
 * A concrete chat: `new Chat({messages, transport, id, onToolCall, onFinish, onError,
 * sendAutomaticallyWhen, ...})`, every ChatInit option but `messages` going to AbstractChat.
 * `chat.sendMessage(...)` resolves when the response (and any automatic follow-up) has finished;
 * then `chat.status` is 'ready' or 'error' and `chat.error` says why.
 */
export class Chat extends AbstractChat {
  constructor({ messages, ...init } = {}) {
    super({ ...init, state: new PlainState(messages ?? []) });
  }
}

/**
 * Waits until the chat is neither 'submitted' nor 'streaming' (polling every 10 ms), and returns
 * its status. Throws when that takes longer than `timeoutMs`. Note that a request only becomes
 * 'submitted' after a few awaits inside sendMessage: call this after awaiting what started it, or
 * when something else (an automatic resend, addToolOutput) may still be running.
 */
export async function waitIdle(chat, timeoutMs = 30_000) {
  const deadline = Date.now() + timeoutMs;
  while (chat.status === "submitted" || chat.status === "streaming") {
    if (Date.now() > deadline) {
      throw new Error(`chat still '${chat.status}' after ${timeoutMs} ms`);
    }
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  return chat.status;
}

/**
 * Folds a stream of UI message chunks into the message it builds, as the SDK does
 * (readUIMessageStream with terminateOnError), keeping every chunk that went by.
 * Returns {message, chunks}: `message` is the last state the fold produced (undefined when no
 * chunk changed it), `chunks` the parsed chunks in order. On an error (an 'error' chunk, a chunk
 * the fold rejects, a broken stream) it throws that error, with `error.chunks` and
 * `error.partialMessage` attached.
 */
export async function fold(stream, { message: startFrom } = {}) {
  const chunks = [];
  const recorded = stream.pipeThrough(
    new TransformStream({
      transform(chunk, controller) {
        chunks.push(chunk);
        controller.enqueue(chunk);
      },
    }),
  );
  let message;
  try {
    for await (const state of readUIMessageStream({
      stream: recorded,
      message: startFrom,
      terminateOnError: true,
    })) {
      message = state;
    }
  } catch (error) {
    if (error !== null && typeof error === "object") {
      error.chunks = chunks;
      error.partialMessage = message;
    }
    throw error;
  }
  return { message, chunks };
}

/**
 * One request through a transport (a DefaultChatTransport, say), without a Chat: calls
 * `transport.sendMessages(options)` and folds its stream (see `fold`). `options` are
 * sendMessages' own ({chatId, messages, trigger, messageId, headers, body, metadata, abortSignal});
 * trigger defaults to 'submit-message' and messages to [].
 */
export async function readOne(transport, options = {}, { message } = {}) {
  const stream = await transport.sendMessages({
    trigger: "submit-message",
    chatId: "chat",
    messageId: undefined,
    messages: [],
    abortSignal: undefined,
    ...options,
  });
  return fold(stream, { message });
}
