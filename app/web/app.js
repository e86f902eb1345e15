/**
 * The page's wiring: the conversation list, opening a conversation (its current branch, drawn by
 * ./branches.js, and, when a run is active, its live stream), the composer that starts runs, the
 * follow-up box and Cancel button of an active run, and the API-key dialog.
 *
 * Resuming after a reload: while a run streams, the events shown so far and the last event id are
 * kept in sessionStorage per conversation. A reloaded page replays those events and continues the
 * stream after that id; without a usable snapshot it streams the active run from its first event.
 * Either way the run view drops any event id it has already shown, so nothing appears twice.
 */

import { ApiClient, ApiError } from "./api.js";
import { keyDialog } from "./key_dialog.js";
import { Branches, questionBubble } from "./branches.js";
import { renderInbox } from "./approvals.js";
import { fillModelPicker, pickedModel } from "./models.js";
import { describeTime } from "./time.js";
import { RunView, el } from "./run_view.js";
import { clearSnapshot, flushSnapshot, loadSnapshot, scheduleSnapshot } from "./snapshots.js";
import { StreamHttpError, followStream } from "./sse.js";

const $ = (id) => document.getElementById(id);

const dom = {
  sidebar: $("sidebar"),
  list: $("conversation-list"),
  listEmpty: $("list-empty"),
  loadMore: $("load-more"),
  inbox: $("inbox-section"),
  inboxList: $("inbox-list"),
  newConversation: $("new-conversation"),
  model: $("model-picker"),
  modelLabel: $("model-picker-label"),
  title: $("chat-title"),
  runPill: $("run-pill"),
  deleteConversation: $("delete-conversation"),
  messages: $("messages"),
  welcome: $("welcome"),
  composer: $("composer"),
  messageInput: $("message-input"),
  sendButton: $("send-button"),
  interruptForm: $("interrupt-form"),
  interruptInput: $("interrupt-input"),
  interruptButton: $("interrupt-button"),
  cancelButton: $("cancel-button"),
  hint: $("composer-hint"),
  keyDialog: $("api-key-dialog"),
  keyForm: $("api-key-form"),
  keyInput: $("api-key-input"),
  keyReason: $("api-key-reason"),
  toast: $("toast"),
};

const state = {
  conversations: [],
  nextCursor: null,
  /** {id, conversation, run: {id, view, abort} | null} for the conversation on screen. */
  current: null,
  stickToBottom: true,
};

const askForKey = keyDialog(
  {
    dialog: dom.keyDialog,
    form: dom.keyForm,
    input: dom.keyInput,
    reason: dom.keyReason,
    cancel: $("api-key-cancel"),
  },
  () => api.key,
);
const api = new ApiClient({ askForKey });
const branches = new Branches({
  api,
  host: {
    current: () => state.current,
    show: (current, conversation, { follow }) => showBranch(current, conversation, { follow }),
    openConversation: (conversation) => {
      state.conversations.unshift(conversation);
      renderList();
      navigateTo(conversation.id);
    },
    toast: (text, kind) => showToast(text, kind),
    reportError: (err) => reportError(err),
    grew: () => scrollIfFollowing(),
  },
});

// ---------------------------------------------------------------------------------------------
// API key dialog

$("api-key-clear").addEventListener("click", () => {
  api.key = "";
  dom.keyInput.value = "";
  showToast("Key forgotten.");
});

$("api-key-button").addEventListener("click", async () => {
  const key = await askForKey("Enter the API key to use with this service.");
  if (key) {
    api.key = key;
    await refreshList();
  }
});

// ---------------------------------------------------------------------------------------------
// Small UI pieces

let toastTimer = null;
function showToast(text, kind = "info") {
  dom.toast.textContent = text;
  dom.toast.dataset.kind = kind;
  dom.toast.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => {
    dom.toast.hidden = true;
  }, 4000);
}

function reportError(err) {
  if (err instanceof ApiError && err.status === 401) {
    showToast("An API key is needed — use “API key…” in the sidebar.", "error");
    return;
  }
  console.error(err);
  showToast(err?.message ?? String(err), "error");
}

function setTitle(text) {
  dom.title.textContent = text;
  document.title = `${text} · AgentStream`;
}

function autoGrow(textarea) {
  textarea.style.height = "auto";
  textarea.style.height = `${Math.min(textarea.scrollHeight, 220)}px`;
}

function scrollIfFollowing() {
  if (state.stickToBottom) dom.messages.scrollTop = dom.messages.scrollHeight;
}

dom.messages.addEventListener("scroll", () => {
  const gap = dom.messages.scrollHeight - dom.messages.scrollTop - dom.messages.clientHeight;
  state.stickToBottom = gap < 80;
});
dom.messages.addEventListener("run-grew", scrollIfFollowing);

// ---------------------------------------------------------------------------------------------
// Conversation list

function conversationTitle(conversation) {
  return conversation?.title?.trim() || "New conversation";
}

async function refreshList() {
  try {
    const page = await api.listConversations();
    state.conversations = page?.items ?? [];
    state.nextCursor = page?.next_cursor ?? null;
    renderList();
  } catch (err) {
    reportError(err);
  }
  refreshInbox();
  fillModelPicker(api, dom.model, dom.modelLabel);
}

/** The pending approvals of every conversation (RUNS.md A-05), above the conversation list. */
async function refreshInbox() {
  try {
    const items = (await api.pendingApprovals())?.items ?? [];
    renderInbox(dom.inboxList, items);
    dom.inbox.hidden = items.length === 0;
  } catch {
    // The inbox is a convenience: the conversations and their cards still show every approval.
  }
}

async function loadMore() {
  if (!state.nextCursor) return;
  try {
    const page = await api.listConversations(state.nextCursor);
    const known = new Set(state.conversations.map((c) => c.id));
    state.conversations.push(...(page?.items ?? []).filter((c) => !known.has(c.id)));
    state.nextCursor = page?.next_cursor ?? null;
    renderList();
  } catch (err) {
    reportError(err);
  }
}

function renderList() {
  const currentId = state.current?.id;
  dom.list.replaceChildren(
    ...state.conversations.map((conversation) => {
      const when = conversation.updated_at ?? conversation.created_at;
      const button = el(
        "button",
        {
          type: "button",
          className: "conversation-item",
          "data-testid": "conversation-item",
          "data-id": conversation.id,
          "aria-current": conversation.id === currentId ? "page" : null,
        },
        el("span", { className: "conversation-name" }, conversationTitle(conversation)),
        when ? el("time", { className: "conversation-time", datetime: when }, describeTime(when)) : null,
      );
      button.addEventListener("click", () => {
        navigateTo(conversation.id);
        document.body.classList.remove("sidebar-open");
      });
      return el("li", {}, button);
    }),
  );
  const shown = state.conversations.find((c) => c.id === currentId);
  if (shown) setTitle(conversationTitle(shown));
  dom.listEmpty.hidden = state.conversations.length > 0;
  dom.loadMore.hidden = !state.nextCursor;
}

function markActiveInList() {
  for (const button of dom.list.querySelectorAll(".conversation-item")) {
    if (button.dataset.id === state.current?.id) button.setAttribute("aria-current", "page");
    else button.removeAttribute("aria-current");
  }
}

// ---------------------------------------------------------------------------------------------
// Routing: #/c/<id> names the open conversation, so a reload comes back to it.

function conversationIdFromHash() {
  const match = /^#\/c\/(.+)$/.exec(location.hash);
  return match ? decodeURIComponent(match[1]) : null;
}

function navigateTo(id) {
  const hash = id ? `#/c/${encodeURIComponent(id)}` : "#/";
  if (location.hash === hash) return;
  history.pushState(null, "", hash);
  openFromHash();
}

window.addEventListener("popstate", openFromHash);
window.addEventListener("hashchange", openFromHash);

function openFromHash() {
  const id = conversationIdFromHash();
  if (id === (state.current?.id ?? null)) return;
  if (id) openConversation(id);
  else showEmptyConversation();
}

// ---------------------------------------------------------------------------------------------
// Opening a conversation

function leaveCurrent() {
  const run = state.current?.run;
  if (run) {
    flushSnapshot(state.current.id, run);
    // Closing the stream never cancels the run; we just stop listening.
    run.abort.abort();
  }
  state.current = null;
}

function showEmptyConversation() {
  leaveCurrent();
  setTitle("New conversation");
  dom.deleteConversation.hidden = true;
  dom.messages.replaceChildren(dom.welcome);
  markActiveInList();
  updateComposer();
  dom.messageInput.focus();
}

async function openConversation(id) {
  leaveCurrent();
  const current = { id, conversation: null, run: null };
  state.current = current;
  markActiveInList();
  setTitle(conversationTitle(state.conversations.find((c) => c.id === id)));
  dom.messages.replaceChildren(el("p", { className: "loading" }, "Loading…"));
  updateComposer();
  let conversation;
  try {
    conversation = await api.getConversation(id);
  } catch (err) {
    if (state.current !== current) return;
    if (err instanceof ApiError && err.status === 404) {
      showToast("That conversation does not exist (any more).", "error");
      clearSnapshot(id);
      navigateTo(null);
    } else {
      dom.messages.replaceChildren(el("p", { className: "loading" }, "Could not load this conversation."));
      reportError(err);
    }
    return;
  }
  if (state.current !== current) return;
  state.stickToBottom = true;
  showBranch(current, conversation, { resume: true });
}

/**
 * Draw the conversation's current branch and follow its active run, or `follow`, a run just
 * started there (streamed from its first event even when it ended meanwhile).
 */
function showBranch(current, conversation, { resume = false, follow = null } = {}) {
  current.conversation = conversation;
  setTitle(conversationTitle(conversation));
  dom.deleteConversation.hidden = false;
  const liveRunId = follow ?? conversation.active_run_id;
  const nodes = branches.render(conversation.messages ?? [], liveRunId);
  if (!nodes.length && !liveRunId) nodes.push(dom.welcome);
  dom.messages.replaceChildren(...nodes);
  if (liveRunId && current.run?.id === liveRunId) dom.messages.append(current.run.view.root);
  else if (liveRunId) attachRun(current, liveRunId, { resume });
  else clearSnapshot(current.id);
  updateComposer();
  scrollIfFollowing();
}

/** Draw the branch again from the server (after a run ends: its messages now have ids). */
async function refreshBranch(current) {
  try {
    const conversation = await api.getConversation(current.id);
    if (state.current === current && !current.run) showBranch(current, conversation);
  } catch (err) {
    reportError(err);
  }
}

// ---------------------------------------------------------------------------------------------
// Following a run's stream

window.addEventListener("pagehide", () => {
  const run = state.current?.run;
  if (run) flushSnapshot(state.current.id, run);
});

async function attachRun(current, runId, { resume }) {
  const view = new RunView({
    runId,
    describeReplay: branches.describeReplay,
    onDecide: async (approvalId, body) => {
      const answer = await api.decide(current.id, approvalId, body);
      refreshInbox();
      return answer;
    },
  });
  const run = { id: runId, view, abort: new AbortController(), snapshotTimer: null };
  current.run = run;
  dom.welcome.remove();
  dom.messages.append(view.root);
  updateComposer();

  let cursor = null;
  const snapshot = resume ? loadSnapshot(current.id) : null;
  if (snapshot && snapshot.runId === runId && snapshot.lastId && Array.isArray(snapshot.events)) {
    for (const ev of snapshot.events) view.handle(ev);
    cursor = snapshot.lastId;
  } else {
    clearSnapshot(current.id);
  }
  scrollIfFollowing();

  let outcome;
  try {
    outcome = await followStream({
      openStream: (after, signal) => api.openStream(current.id, after, signal),
      cursor,
      signal: run.abort.signal,
      onState: (connection) => view.setConnection(connection),
      onEvent: (ev) => {
        if (view.handle(ev)) {
          if (ev.event === "inject") dom.hint.textContent = "";
          if (ev.event === "approval") {
            refreshInbox();
            updateComposer();
          }
          view.setConnection("live");
          scheduleSnapshot(current.id, run);
          scrollIfFollowing();
        }
      },
    });
  } catch (err) {
    if (state.current !== current) return;
    outcome = "failed";
    view.setStatus("");
    if (err instanceof StreamHttpError && err.status === 404) showToast("This conversation is gone.", "error");
    else reportError(err);
  }
  if (outcome === "aborted" || state.current !== current || current.run !== run) return;
  clearTimeout(run.snapshotTimer);
  clearSnapshot(current.id);
  current.run = null;
  updateComposer();
  refreshList();
  if (outcome === "no-content" && !view.finished) {
    // The run ended while we were away and its events are gone from our cursor: show the stored result.
    openConversation(current.id);
  } else if (view.finished) {
    branches.keep(view);
    refreshBranch(current);
  }
}

// ---------------------------------------------------------------------------------------------
// Composer, follow-ups, cancel

function updateComposer() {
  const active = Boolean(state.current?.run);
  dom.composer.hidden = active;
  dom.interruptForm.hidden = !active;
  dom.runPill.hidden = !active;
  dom.runPill.textContent = state.current?.run?.view.waiting ? "Waiting for approval" : "Running";
  dom.cancelButton.disabled = false;
  dom.cancelButton.textContent = "Cancel run";
  if (!active) dom.hint.textContent = "";
  branches.setLocked(active);
}

async function ensureConversation(firstMessage) {
  if (state.current) return state.current;
  const firstLine = firstMessage.split("\n")[0].trim();
  const title = firstLine.length > 80 ? `${firstLine.slice(0, 79)}…` : firstLine;
  const conversation = await api.createConversation(title, pickedModel(dom.model, dom.modelLabel));
  history.pushState(null, "", `#/c/${encodeURIComponent(conversation.id)}`);
  state.conversations.unshift(conversation);
  renderList();
  await openConversation(conversation.id);
  return state.current;
}

async function sendMessage(text) {
  dom.sendButton.disabled = true;
  let bubble = null;
  try {
    const current = await ensureConversation(text);
    if (!current || current.run) return;
    dom.welcome.remove();
    bubble = questionBubble(text);
    dom.messages.append(bubble);
    state.stickToBottom = true;
    scrollIfFollowing();
    dom.messageInput.value = "";
    autoGrow(dom.messageInput);
    let started;
    try {
      started = await api.startRun(current.id, text);
    } catch (err) {
      bubble.remove();
      if (err instanceof ApiError && err.code === "run_active") {
        showToast("A run is already working in this conversation; showing it.");
        openConversation(current.id);
        return;
      }
      dom.messageInput.value = text;
      autoGrow(dom.messageInput);
      throw err;
    }
    if (state.current !== current) return;
    attachRun(current, started.run_id, { resume: false });
    refreshList();
    dom.interruptInput.focus();
  } catch (err) {
    reportError(err);
  } finally {
    dom.sendButton.disabled = false;
  }
}

dom.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = dom.messageInput.value.trim();
  if (text) sendMessage(text);
});

dom.interruptForm.addEventListener("submit", async (event) => {
  event.preventDefault();
  const current = state.current;
  const text = dom.interruptInput.value.trim();
  if (!current?.run || !text) return;
  dom.interruptButton.disabled = true;
  try {
    const answer = await api.interrupt(current.id, text);
    dom.interruptInput.value = "";
    autoGrow(dom.interruptInput);
    current.run?.view.addQueuedFollowUp(text);
    scrollIfFollowing();
    const queued = answer?.queued ?? 1;
    dom.hint.textContent = `Follow-up queued (${queued} waiting) — the agent reads it at its next step.`;
  } catch (err) {
    if (err instanceof ApiError && err.code === "no_active_run") showToast("The run has already finished.");
    else if (err instanceof ApiError && err.code === "too_many_follow_ups") {
      showToast("Many follow-ups are waiting already; send this one once the agent has read them.");
    } else reportError(err);
  } finally {
    dom.interruptButton.disabled = false;
  }
});

dom.cancelButton.addEventListener("click", async () => {
  const current = state.current;
  if (!current?.run) return;
  dom.cancelButton.disabled = true;
  dom.cancelButton.textContent = "Cancelling…";
  try {
    await api.cancel(current.id);
    dom.hint.textContent = "Cancelling — the run stops at its next step.";
  } catch (err) {
    dom.cancelButton.disabled = false;
    dom.cancelButton.textContent = "Cancel run";
    if (err instanceof ApiError && err.code === "no_active_run") showToast("The run has already finished.");
    else reportError(err);
  }
});

for (const [textarea, form] of [
  [dom.messageInput, dom.composer],
  [dom.interruptInput, dom.interruptForm],
]) {
  textarea.addEventListener("input", () => autoGrow(textarea));
  textarea.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
}

dom.newConversation.addEventListener("click", async () => {
  dom.newConversation.disabled = true;
  try {
    const conversation = await api.createConversation(null, pickedModel(dom.model, dom.modelLabel));
    state.conversations.unshift(conversation);
    renderList();
    navigateTo(conversation.id);
    document.body.classList.remove("sidebar-open");
    dom.messageInput.focus();
  } catch (err) {
    reportError(err);
  } finally {
    dom.newConversation.disabled = false;
  }
});

dom.loadMore.addEventListener("click", loadMore);

dom.deleteConversation.addEventListener("click", async () => {
  const current = state.current;
  if (!current || !window.confirm("Delete this conversation? An active run is cancelled first.")) return;
  try {
    await api.deleteConversation(current.id);
    clearSnapshot(current.id);
    state.conversations = state.conversations.filter((c) => c.id !== current.id);
    renderList();
    navigateTo(null);
  } catch (err) {
    reportError(err);
  }
});

$("open-sidebar").addEventListener("click", () => document.body.classList.add("sidebar-open"));
$("close-sidebar").addEventListener("click", () => document.body.classList.remove("sidebar-open"));

// ---------------------------------------------------------------------------------------------

async function start() {
  await refreshList();
  const id = conversationIdFromHash();
  if (id) await openConversation(id);
  else showEmptyConversation();
  document.body.dataset.ready = "yes";
}

start();
