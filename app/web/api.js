/**
 * The HTTP side of the page: one client for the service's JSON routes and its event stream, which
 * sends `Authorization: Bearer <key>` with every call and, when a call answers 401, asks the user
 * for a key (kept in localStorage) and retries.
 */

const KEY_STORAGE = "agentstream.apiKey";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }
}

export class ApiClient {
  /** askForKey(reason) resolves to a key string, or null when the user gives up. */
  constructor({ askForKey }) {
    this.askForKey = askForKey;
    this.pendingKey = null;
  }

  get key() {
    return localStorage.getItem(KEY_STORAGE) || "";
  }

  set key(value) {
    if (value) localStorage.setItem(KEY_STORAGE, value);
    else localStorage.removeItem(KEY_STORAGE);
  }

  headers(extra = {}) {
    const headers = { ...extra };
    if (this.key) headers.Authorization = `Bearer ${this.key}`;
    return headers;
  }

  /** Ask once for a key even when several calls hit 401 at the same time. */
  async renewKey(rejected) {
    if (!this.pendingKey) {
      const reason = rejected ? "That key was not accepted." : "This service needs an API key.";
      this.pendingKey = Promise.resolve(this.askForKey(reason)).finally(() => {
        this.pendingKey = null;
      });
    }
    const key = await this.pendingKey;
    if (!key) throw new ApiError(401, "unauthorized", "An API key is needed.");
    this.key = key;
  }

  async fetchAuthorized(path, init = {}) {
    for (;;) {
      const sentKey = this.key;
      const response = await fetch(path, { ...init, headers: this.headers(init.headers) });
      if (response.status !== 401) return response;
      await this.renewKey(Boolean(sentKey));
    }
  }

  async request(method, path, body) {
    const init = { method };
    if (body !== undefined) {
      init.body = JSON.stringify(body);
      init.headers = { "Content-Type": "application/json" };
    }
    const response = await this.fetchAuthorized(path, init);
    if (response.status === 204) return null;
    const payload = await response.json().catch(() => null);
    if (!response.ok) {
      const error = payload?.error ?? {};
      throw new ApiError(response.status, error.code ?? "http_error", error.message ?? `HTTP ${response.status}`);
    }
    return payload;
  }

  listConversations(cursor) {
    const query = cursor ? `&cursor=${encodeURIComponent(cursor)}` : "";
    return this.request("GET", `/api/conversations?limit=50${query}`);
  }

  createConversation(title, model) {
    const body = title ? { title } : {};
    if (model) body.agent = { model };
    return this.request("POST", "/api/conversations", body);
  }

  listModels() {
    return this.request("GET", "/api/models");
  }

  getConversation(id) {
    return this.request("GET", `/api/conversations/${encodeURIComponent(id)}`);
  }

  deleteConversation(id) {
    return this.request("DELETE", `/api/conversations/${encodeURIComponent(id)}`);
  }

  startRun(id, message) {
    return this.request("POST", `/api/conversations/${encodeURIComponent(id)}/runs`, { message });
  }

  /** A question below `parentId` (null: as the first message): editing a question (FACES.md B-02). */
  askUnder(id, message, parentId) {
    const body = { message, parent_id: parentId };
    return this.request("POST", `/api/conversations/${encodeURIComponent(id)}/runs`, body);
  }

  /** A question answered again, or an answer replaced by a new sibling (B-03). */
  regenerate(id, messageId) {
    return this.request("POST", `/api/conversations/${encodeURIComponent(id)}/runs`, { regenerate: messageId });
  }

  /** The newest leaf below `messageId` becomes the current one (B-04); answers the conversation. */
  switchHead(id, messageId) {
    return this.request("PUT", `/api/conversations/${encodeURIComponent(id)}/head`, { message_id: messageId });
  }

  /** A new conversation with the path to `messageId` (B-05). */
  fork(id, messageId) {
    return this.request("POST", `/api/conversations/${encodeURIComponent(id)}/fork`, { message_id: messageId });
  }

  /** A new run answering the same question from the run's checkpoint at or before event `after` (B-06). */
  replay(runId, after) {
    return this.request("POST", `/api/runs/${encodeURIComponent(runId)}/replay`, { after });
  }

  interrupt(id, content) {
    return this.request("POST", `/api/conversations/${encodeURIComponent(id)}/interrupt`, { content });
  }

  cancel(id) {
    return this.request("POST", `/api/conversations/${encodeURIComponent(id)}/cancel`);
  }

  /** A person's decision on an approval: {decision: "approve"|"deny", reason?, tool_args?}. */
  decide(conversationId, approvalId, body) {
    const path = `/api/conversations/${encodeURIComponent(conversationId)}/approvals/${encodeURIComponent(approvalId)}`;
    return this.request("POST", path, body);
  }

  pendingApprovals() {
    return this.request("GET", "/api/approvals?status=pending");
  }

  runEvents(runId) {
    return this.request("GET", `/api/runs/${encodeURIComponent(runId)}/events`);
  }

  /** The stream response resuming after `cursor` (null: from the first event of the active run). */
  openStream(id, cursor, signal) {
    const query = cursor ? `?after=${encodeURIComponent(cursor)}` : "";
    return this.fetchAuthorized(`/api/conversations/${encodeURIComponent(id)}/stream${query}`, {
      headers: { Accept: "text/event-stream" },
      cache: "no-store",
      signal,
    });
  }
}
