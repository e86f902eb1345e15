/**
 * Server-Sent Events over fetch(): an incremental parser of the text/event-stream format and a
 * follower that keeps one conversation's stream open across dropped connections, resuming with
 * `?after=<last id>` so that no event is lost or repeated. fetch() rather than EventSource so the
 * Authorization header can be sent.
 */

/** Incremental text/event-stream parser; calls onEvent({id, event, data}) per dispatched event. */
export class SseParser {
  constructor(onEvent) {
    this.onEvent = onEvent;
    this.buffer = "";
    this.dataLines = [];
    this.eventName = "";
    this.lastId = null;
  }

  push(chunk) {
    this.buffer += chunk;
    let start = 0;
    for (;;) {
      const lf = this.buffer.indexOf("\n", start);
      const cr = this.buffer.indexOf("\r", start);
      let end = lf === -1 ? cr : cr === -1 ? lf : Math.min(lf, cr);
      if (end === -1) break;
      let next = end + 1;
      if (this.buffer[end] === "\r") {
        // A CR at the very end may be the first half of a CRLF still in flight.
        if (end === this.buffer.length - 1) break;
        if (this.buffer[end + 1] === "\n") next = end + 2;
      }
      this.line(this.buffer.slice(start, end));
      start = next;
    }
    this.buffer = this.buffer.slice(start);
  }

  line(text) {
    if (text === "") {
      this.dispatch();
      return;
    }
    if (text.startsWith(":")) return;
    const colon = text.indexOf(":");
    const field = colon === -1 ? text : text.slice(0, colon);
    let value = colon === -1 ? "" : text.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.dataLines.push(value);
    else if (field === "event") this.eventName = value;
    else if (field === "id" && !value.includes("\u0000")) this.lastId = value;
  }

  dispatch() {
    if (this.dataLines.length) {
      this.onEvent({ id: this.lastId, event: this.eventName || "message", data: this.dataLines.join("\n") });
    }
    this.dataLines = [];
    this.eventName = "";
  }
}

export class StreamHttpError extends Error {
  constructor(status, message) {
    super(message);
    this.name = "StreamHttpError";
    this.status = status;
  }
}

const RETRY_DELAYS_MS = [250, 500, 1000, 2000, 4000];

function wait(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve();
    });
  });
}

/**
 * Follow a conversation's stream until its `done` event, a 204, or abort.
 *
 * openStream(cursor, signal) must return a fetch Response for the stream resuming after `cursor`
 * (null: from the start of the active run). onEvent gets {id, event, data: parsed JSON};
 * onState gets "live" | "reconnecting". Resolves to "done", "no-content" or "aborted".
 */
export async function followStream({ openStream, cursor = null, onEvent, onState = () => {}, signal }) {
  let attempt = 0;
  while (!signal?.aborted) {
    let finished = false;
    try {
      const response = await openStream(cursor, signal);
      if (response.status === 204) return "no-content";
      if (!response.ok) {
        // 4xx other than a transient one will not get better by retrying.
        if (response.status >= 400 && response.status < 500 && response.status !== 408 && response.status !== 429) {
          throw new StreamHttpError(response.status, `stream answered ${response.status}`);
        }
        throw new Error(`stream answered ${response.status}`);
      }
      onState("live");
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      const parser = new SseParser((raw) => {
        if (raw.id !== null) cursor = raw.id;
        let data;
        try {
          data = JSON.parse(raw.data);
        } catch {
          data = { raw: raw.data };
        }
        attempt = 0;
        onEvent({ id: raw.id, event: raw.event, data });
        if (raw.event === "done") finished = true;
      });
      while (!finished) {
        const { value, done } = await reader.read();
        if (done) break;
        parser.push(value);
      }
      if (finished) {
        reader.cancel().catch(() => {});
        return "done";
      }
    } catch (err) {
      if (signal?.aborted) break;
      // HTTP answers that retrying cannot fix (404, a refused key) end the follow.
      if (err instanceof StreamHttpError || typeof err?.status === "number") throw err;
      if (finished) return "done";
    }
    // The connection ended before `done`: the run goes on server-side, so pick up where we were.
    onState("reconnecting");
    await wait(RETRY_DELAYS_MS[Math.min(attempt, RETRY_DELAYS_MS.length - 1)], signal);
    attempt += 1;
  }
  return "aborted";
}
