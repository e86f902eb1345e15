/**
 * A conversation's current branch on the page (FACES.md B-09), and what can be done with it: edit
 * a question in place, regenerate an answer, switch between siblings ("‹ n/m ›"), fork from a
 * message, and replay a finished run from one of its step cards (B-06).
 *
 * GET /api/conversations/{id} gives the path from the first message to the current leaf. The page
 * cuts it into turns: a question (a user message) and its answer, the messages below it up to the
 * next question — a run's tool calls, results and final answer (all carrying that run's id), or, in
 * a forked conversation, their copies without a run. The answer's first message stands for it:
 * its siblings are the other answers to the same question, so "‹ n/m ›" on a run switches between
 * runs. A run is drawn from its stored events, the same view a live run gets; a finished run's
 * view is kept, so switching back and forth fetches nothing twice.
 *
 * The actions ask the host page to show the conversation the server answers with and to follow a
 * run that one of them started; while a run is active every control here is disabled (the service
 * would answer 409 `run_active`).
 */

import { ApiError } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { RunView, el } from "./run_view.js";

/** Finished run views kept per page; the oldest are dropped beyond this. */
const KEPT_VIEWS = 100;

/**
 * The path cut into turns: {question (a user message, or null before the first), answer: the
 * messages below it, runId: the run that wrote them (null for copies)}. A pinned user message is
 * a follow-up the run read, part of its answer; so is any other message of that run.
 */
export function turnsOf(messages) {
  const turns = [];
  let turn = null;
  for (const message of messages) {
    const ofRun = turn?.runId && message.run_id === turn.runId;
    if (message.role === "user" && !message.pinned && !ofRun) {
      turn = { question: message, answer: [], runId: null };
      turns.push(turn);
      continue;
    }
    if (!turn) {
      turn = { question: null, answer: [], runId: null };
      turns.push(turn);
    }
    turn.answer.push(message);
    if (!turn.runId && message.run_id) turn.runId = message.run_id;
  }
  return turns;
}

/** A question's bubble (also the one the composer shows before the run has stored it). */
export function questionBubble(text) {
  return el(
    "div",
    { className: "bubble user", "data-testid": "user-message" },
    el("div", { className: "bubble-text" }, text),
  );
}

/** A source run's events, fetched once per page for the notes of its replays. */
const sourceEvents = new Map();

export class Branches {
  /**
   * host: {current() (the page's open conversation, {id, ...}), show(current, conversation,
   * {follow}) (draws it and follows the run `follow` or its active one), openConversation(record)
   * (lists and opens a conversation), toast(text, kind), reportError(err), grew() (content was
   * added: scroll if the user follows the bottom)}.
   */
  constructor({ api, host }) {
    this.api = api;
    this.host = host;
    this.views = new Map();
    this.locked = false;
    this.describeReplay = (data) => this.replayNote(data);
  }

  // ---- drawing ----------------------------------------------------------------------------

  /** The nodes of the branch `messages`; `liveRunId`: the run the page follows (drawn elsewhere). */
  render(messages, liveRunId) {
    const nodes = [];
    const turns = turnsOf(messages);
    turns.forEach((turn, index) => {
      const last = index === turns.length - 1;
      if (turn.question) nodes.push(this.questionNode(turn.question));
      // A question with nothing below it: its run is the live one, or ended before writing.
      const runId = turn.runId ?? (turn.answer.length ? null : turn.question?.run_id ?? null);
      if (last && liveRunId && (runId === liveRunId || !turn.answer.length)) return;
      if (runId) nodes.push(this.runNode(runId));
      else nodes.push(...turn.answer.map(storedMessage).filter(Boolean));
      if (turn.question || turn.answer.length) nodes.push(this.answerBar(turn, runId));
    });
    return nodes;
  }

  questionNode(question) {
    const text = typeof question.content === "string" ? question.content : "";
    const node = el("div", {
      className: "turn-question",
      "data-testid": "question",
      "data-message-id": question.id,
    });
    const bar = el(
      "div",
      { className: "branch-bar", "data-testid": "question-controls" },
      this.switcher(question),
      this.button("edit-button", "Edit", "Edit this question; the answer to the new text is a new branch", () =>
        this.startEditing(node, question),
      ),
      this.button("fork-button", "Fork", "A new conversation with the messages up to this one", () =>
        this.fork(question.id),
      ),
    );
    node.append(questionBubble(text), bar);
    return node;
  }

  /** Under an answer: "‹ n/m ›" between the answers to its question, Regenerate and Fork. */
  answerBar(turn, runId) {
    const head = turn.answer[0] ?? null;
    const last = turn.answer.at(-1) ?? turn.question;
    const target = turn.question ?? head;
    return el(
      "div",
      {
        className: "branch-bar answer-bar",
        "data-testid": "answer-controls",
        "data-run-id": runId,
        "data-message-id": head?.id,
      },
      head ? this.switcher(head) : null,
      target?.role === "user" || target?.role === "assistant"
        ? this.button(
            "regenerate-button",
            head || runId ? "Regenerate" : "Answer",
            head || runId ? "Answer this question again, as a new branch" : "Answer this question",
            () => this.start(() => this.api.regenerate(this.host.current().id, target.id)),
          )
        : null,
      this.button("fork-button", "Fork", "A new conversation with the messages up to this answer", () =>
        this.fork(last.id),
      ),
    );
  }

  /** "‹ n/m ›" for a message with siblings (none otherwise). */
  switcher(message) {
    const ids = message.sibling_ids ?? [];
    const at = ids.indexOf(message.id);
    if (ids.length < 2 || at < 0) return null;
    const go = (id) => () => this.switchTo(id);
    const prev = this.button("sibling-prev", "‹", "Previous version", go(ids[at - 1]), {
      edge: at === 0,
      ariaLabel: "Previous version",
    });
    const next = this.button("sibling-next", "›", "Next version", go(ids[at + 1]), {
      edge: at === ids.length - 1,
      ariaLabel: "Next version",
    });
    return el(
      "span",
      { className: "sibling-switcher", "data-testid": "sibling-switcher" },
      prev,
      el("span", { className: "sibling-position", "data-testid": "sibling-position" }, `${at + 1}/${ids.length}`),
      next,
    );
  }

  /** A control of this module; `edge`: disabled for good (the first or the last version). */
  button(testid, label, title, onClick, { edge = false, ariaLabel = null } = {}) {
    const attrs = { type: "button", className: "link-button branch-control", "data-testid": testid, title };
    const button = el("button", { ...attrs, "aria-label": ariaLabel }, label);
    button.dataset.branchControl = edge ? "edge" : "yes";
    button.disabled = edge || this.locked;
    button.addEventListener("click", (event) => {
      event.preventDefault();
      if (!this.locked) onClick();
    });
    return button;
  }

  /** Disable (while a run is active or an action is on its way) or enable every control. */
  setLocked(locked) {
    this.locked = locked;
    this.syncLock(document);
    for (const form of document.querySelectorAll("[data-testid=edit-form]")) {
      form.querySelector("[data-testid=edit-save]").disabled = locked;
    }
  }

  /** The controls under `root` as the lock says (a kept view's were made under another). */
  syncLock(root) {
    for (const button of root.querySelectorAll("[data-branch-control]")) {
      button.disabled = this.locked || button.dataset.branchControl === "edge";
    }
  }

  // ---- runs -------------------------------------------------------------------------------

  /** A finished run's view: kept from before, or drawn from its stored events once they arrive. */
  runNode(runId) {
    const kept = this.views.get(runId);
    if (kept) {
      this.views.delete(runId);
      this.views.set(runId, kept);
      if (kept.finished) this.addReplayControls(kept);
      this.syncLock(kept.root);
      return kept.root;
    }
    const view = new RunView({ runId, describeReplay: this.describeReplay });
    this.keep(view);
    view.setStatus("Loading…");
    this.api
      .runEvents(runId)
      .then((events) => {
        for (const ev of events ?? []) view.handle(ev);
        view.setStatus("");
        this.addReplayControls(view);
        this.host.grew();
      })
      .catch((err) => {
        this.views.delete(runId);
        view.setStatus("");
        view.timeline.append(el("p", { className: "loading" }, "Could not load this run."));
        this.host.reportError(err);
      });
    return view.root;
  }

  /** Keep a run's view for the next time its branch is drawn (a live run's, once it is done). */
  keep(view) {
    if (!view.runId) return;
    this.views.set(view.runId, view);
    while (this.views.size > KEPT_VIEWS) this.views.delete(this.views.keys().next().value);
  }

  /** "Replay from here" on each step card of a finished run (not on a lost attempt's). */
  addReplayControls(view) {
    if (!view.runId) return;
    for (const card of view.timeline.querySelectorAll(":scope > .card.tool, :scope > .card.thinking")) {
      const after = card.dataset.lastEventId;
      if (!after || card.dataset.lost === "true" || card.querySelector("[data-testid=replay-button]")) continue;
      const button = this.button(
        "replay-button",
        "Replay from here",
        "A new answer that keeps the steps up to here and carries on from them",
        () => this.start(() => this.api.replay(view.runId, after)),
      );
      card.querySelector(".card-body").append(el("div", { className: "card-actions" }, button));
    }
  }

  /** The text of a replay's note: which step of which earlier answer it carries on from. */
  async replayNote(data) {
    const source = data.source_run_id;
    if (!source || !data.after) return null;
    if (!sourceEvents.has(source)) {
      sourceEvents.set(
        source,
        this.api.runEvents(source).catch((err) => {
          sourceEvents.delete(source);
          throw err;
        }),
      );
    }
    const events = (await sourceEvents.get(source)) ?? [];
    let step = null;
    for (const ev of events) {
      const iteration = ev.data?.iteration;
      if (iteration !== undefined && iteration !== null) step = iteration;
      if (ev.id !== data.after) continue;
      if (step === null) return "Replayed from the start of an earlier answer";
      return `Replayed from step ${step} of an earlier answer`;
    }
    return null;
  }

  // ---- actions ----------------------------------------------------------------------------

  /** Start a run with `request()` (an edit, a regenerate, a replay), show its branch, follow it. */
  async start(request) {
    const current = this.host.current();
    if (!current || this.locked) return false;
    this.setLocked(true);
    try {
      const started = await request();
      let conversation = current.conversation;
      try {
        conversation = await this.api.getConversation(current.id);
      } catch (err) {
        // Follow the run on the branch shown so far; the page draws it again once the run ends.
        this.host.reportError(err);
      }
      if (this.host.current() !== current) return true;
      this.host.show(current, conversation, { follow: started.run_id });
      return true;
    } catch (err) {
      this.fail(err);
      return false;
    } finally {
      // show() locks again while the run it follows is active.
      if (this.host.current() === current && !current.run) this.setLocked(false);
    }
  }

  async switchTo(messageId) {
    const current = this.host.current();
    if (!current || this.locked) return;
    this.setLocked(true);
    try {
      const conversation = await this.api.switchHead(current.id, messageId);
      if (this.host.current() === current) this.host.show(current, conversation, {});
    } catch (err) {
      this.fail(err);
    } finally {
      if (this.host.current() === current && !current.run) this.setLocked(false);
    }
  }

  async fork(messageId) {
    const current = this.host.current();
    if (!current || this.locked) return;
    this.setLocked(true);
    try {
      const conversation = await this.api.fork(current.id, messageId);
      this.host.toast("Forked into a new conversation.");
      this.host.openConversation(conversation);
    } catch (err) {
      this.fail(err);
    } finally {
      if (!this.host.current()?.run) this.setLocked(false);
    }
  }

  fail(err) {
    if (err instanceof ApiError && err.code === "run_active") {
      this.host.toast("A run is working in this conversation; try again once it has finished.", "error");
    } else {
      this.host.reportError(err);
    }
  }

  /** The question's bubble becomes a textarea; Save asks the new text in its place (B-02). */
  startEditing(node, question) {
    const shown = [...node.childNodes];
    const input = el("textarea", {
      className: "edit-input",
      "data-testid": "edit-input",
      rows: "3",
      maxlength: "32000",
      "aria-label": "Edited question",
    });
    input.value = typeof question.content === "string" ? question.content : "";
    const save = el("button", { type: "submit", className: "primary", "data-testid": "edit-save" }, "Save");
    const cancel = el("button", { type: "button", className: "secondary", "data-testid": "edit-cancel" }, "Cancel");
    const form = el(
      "form",
      { className: "bubble user edit-form", "data-testid": "edit-form" },
      input,
      el("div", { className: "edit-actions" }, cancel, save),
    );
    save.disabled = this.locked;
    const stop = () => node.replaceChildren(...shown);
    cancel.addEventListener("click", stop);
    form.addEventListener("keydown", (event) => {
      if (event.key === "Escape") stop();
      else if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        form.requestSubmit();
      }
    });
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const text = input.value.trim();
      if (!text || this.locked) return;
      save.disabled = true;
      const done = await this.start(() =>
        this.api.askUnder(this.host.current().id, text, question.parent_id ?? null),
      );
      if (!done) save.disabled = this.locked;
    });
    node.replaceChildren(form);
    input.focus();
    input.setSelectionRange(input.value.length, input.value.length);
  }
}

/** A stored message of an answer that no run's events draw (a forked conversation's copies). */
function storedMessage(message) {
  const content = typeof message.content === "string" ? message.content : "";
  if (!content) return null;
  if (message.role === "user") {
    return el(
      "div",
      { className: "bubble user followup", "data-testid": "inject-bubble" },
      el("span", { className: "bubble-label" }, "Follow-up"),
      el("div", { className: "bubble-text" }, content),
    );
  }
  if (message.role !== "assistant" || message.tool_calls) return null;
  const body = el("div", { className: "markdown" });
  body.innerHTML = renderMarkdown(content);
  return el("div", { className: "bubble assistant", "data-testid": "assistant-message" }, body);
}
