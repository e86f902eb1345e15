/**
 * How one run looks: its stream of events turned into a timeline of thinking and tool cards,
 * separators (phase, compaction), follow-up bubbles, the streamed answer and the closing footer.
 * Every event id is remembered so an event delivered twice (a replay overlapping a live stream)
 * is never shown twice. Text reaches the DOM through textContent or the escaping Markdown renderer.
 * A run carried on by another worker (`phase: resumed`) is handled with ./attempts.js: what the lost
 * attempt drew after the checkpoint is greyed out and the answer starts again.
 */

import { approvalCard } from "./approvals.js";
import { attemptBadgeText, markLostAfter, resumedSeparator, trackEvent } from "./attempts.js";
import { renderMarkdown } from "./markdown.js";

/** Build an element; string children become text nodes, never markup. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "className") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2).toLowerCase(), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function pretty(value) {
  if (value === undefined) return "";
  try {
    return JSON.stringify(value, null, 2);
  } catch {
    return String(value);
  }
}

function formatSeconds(seconds) {
  if (typeof seconds !== "number" || !Number.isFinite(seconds)) return "";
  return seconds < 10 ? `${seconds.toFixed(2)} s` : `${seconds.toFixed(1)} s`;
}

function plural(n, word) {
  return `${Number(n ?? 0).toLocaleString()} ${word}${n === 1 ? "" : "s"}`;
}

const ANSWER_RENDER_DELAY_MS = 40;

export class RunView {
  /**
   * runId: the run these events belong to (others are ignored), or null to take it from the first
   * event. onDecide(approvalId, body): posts a person's decision on an approval (none: the cards
   * of a finished run show the outcome only). describeReplay(data): resolves to the text of a
   * replay's note (`phase: replay`, FACES.md B-06), or null to keep the plain one.
   */
  constructor({ runId = null, onDecide = null, describeReplay = null } = {}) {
    this.runId = runId;
    this.onDecide = onDecide;
    this.describeReplay = describeReplay;
    this.approvalCards = new Map();
    /** Calls of the run that wait for a decision the run has not announced yet. */
    this.pendingApprovals = new Set();
    this.seen = new Set();
    this.events = [];
    this.lastId = null;
    this.toolCards = [];
    this.thinkingCards = new Map();
    this.answerText = "";
    this.answerBubble = null;
    this.answerBody = null;
    this.renderTimer = null;
    this.finished = false;
    this.doneData = null;
    /** The id of the event being shown, for the elements it draws (null when it has none). */
    this.currentId = null;
    /** The run's attempt (1 until a `resumed` phase says otherwise). */
    this.attempt = 1;
    this.timeline = el("div", { className: "run-timeline" });
    this.attemptBadge = el("div", { className: "run-attempt", "data-testid": "run-attempt", hidden: true });
    this.status = el("div", { className: "run-status", role: "status", "data-testid": "run-status" });
    this.root = el(
      "section",
      { className: "run", "data-testid": "run" },
      this.timeline,
      this.attemptBadge,
      this.status,
    );
    if (runId) this.root.dataset.runId = runId;
    this.setStatus("Starting…");
  }

  /** Show one event {id, event, data}; returns false when it was already shown or is not ours. */
  handle(ev) {
    if (ev.id !== null && ev.id !== undefined) {
      if (this.seen.has(ev.id)) return false;
    }
    let data = ev.data;
    if (typeof data === "string") {
      try {
        data = JSON.parse(data);
      } catch {
        data = {};
      }
    }
    data = data ?? {};
    if (this.runId && data.run_id && data.run_id !== this.runId) return false;
    if (!this.runId && data.run_id) {
      this.runId = data.run_id;
      this.root.dataset.runId = data.run_id;
    }
    if (ev.id !== null && ev.id !== undefined) {
      this.seen.add(ev.id);
      this.lastId = ev.id;
    }
    this.events.push({ id: ev.id, event: ev.event, data });
    this.currentId = ev.id ?? null;
    switch (ev.event) {
      case "step":
        this.onStep(data);
        break;
      case "answer":
        this.onAnswer(data);
        break;
      case "phase":
        if (data.phase === "resumed") this.onResumed(data);
        else if (data.phase === "replay") this.onReplay(data);
        else this.addSeparator("phase", this.describePhase(data));
        break;
      case "compact":
        this.addSeparator(
          "compact",
          `Context compacted: ${plural(data.original_messages, "message")} → ${data.kept_messages ?? "?"} kept`,
        );
        break;
      case "inject":
        // A drain takes everything queued so far.
        this.clearQueuedFollowUps();
        this.append(
          el(
            "div",
            { className: "bubble user followup", "data-testid": "inject-bubble" },
            el("span", { className: "bubble-label" }, "Follow-up"),
            el("div", { className: "bubble-text" }, data.content ?? ""),
          ),
        );
        this.setStatus("Taking your follow-up into account…");
        break;
      case "approval":
        this.onApproval(data);
        break;
      case "done":
        this.onDone(data);
        break;
      default:
        break;
    }
    return true;
  }

  /** A call waits for a person (RUNS.md A-02), or their decision is in. */
  onApproval(data) {
    let card = this.approvalCards.get(data.approval_id);
    if (data.status === "requested") {
      if (card) {
        // Asked again by a later attempt of the run: the card there already stands for it.
        trackEvent(card.root, this.currentId);
        return;
      }
      const decide = (body) =>
        this.onDecide ? this.onDecide(data.approval_id, body) : Promise.reject(new Error("This run is over."));
      card = approvalCard(data, decide);
      this.approvalCards.set(data.approval_id, card);
      this.pendingApprovals.add(data.approval_id);
      this.append(card.root);
      this.setStatus(`Waiting for your approval of ${data.tool_name ?? "a tool call"}…`);
      return;
    }
    this.pendingApprovals.delete(data.approval_id);
    if (!card) return;
    card.settle(data.status, data.reason, data.status === "approved" ? data.tool_args : undefined);
    this.setStatus(data.status === "approved" ? `Running ${data.tool_name ?? "the approved call"}…` : "Thinking…");
  }

  /** The run waits for a person (some approval it asked for is not decided yet). */
  get waiting() {
    return this.pendingApprovals.size > 0 && !this.finished;
  }

  describePhase(data) {
    if (data.phase === "selecting_tools") {
      return `Selecting tools (${plural(data.total_tools, "tool")} available)`;
    }
    if (data.phase === "fallback") {
      return `Model ${data.from_model ?? "?"} unavailable: falling back to ${data.to_model ?? "?"}`;
    }
    if (data.phase === "queued") {
      return `Queued (position ${data.position ?? "?"}): starts when a worker has room`;
    }
    if (data.phase === "waiting") {
      const asked = (data.approval_ids ?? []).length;
      const calls = (data.call_ids ?? []).length;
      const what = [asked ? plural(asked, "approval") : "", calls ? plural(calls, "tool result") : ""];
      return `Waiting for ${what.filter(Boolean).join(" and ") || "you"}`;
    }
    const name = String(data.phase ?? "phase").replace(/_/g, " ");
    return name.charAt(0).toUpperCase() + name.slice(1);
  }

  /** Add an element drawn from the current event to the timeline. */
  append(node) {
    trackEvent(node, this.currentId);
    this.timeline.append(node);
  }

  addSeparator(kind, text) {
    this.append(
      el(
        "div",
        { className: `separator ${kind}`, role: "separator", "data-testid": `separator-${kind}` },
        el("span", {}, text),
      ),
    );
  }

  onStep(data) {
    if (data.type === "thinking") this.onThinking(data);
    else if (data.type === "iteration") this.onIteration(data);
    else if (data.type === "answer") this.setStatus("Writing the answer…");
  }

  onThinking(data) {
    const key = String(data.iteration ?? this.thinkingCards.size);
    let card = this.thinkingCards.get(key);
    if (!card) {
      card = this.makeCard("thinking", `Thinking · step ${data.iteration ?? "?"}`);
      this.thinkingCards.set(key, card);
      this.append(card.root);
    } else {
      trackEvent(card.root, this.currentId);
    }
    if (data.status === "start") {
      this.setStatus("Thinking…");
      return;
    }
    const reasoning = (data.reasoning ?? "").trim();
    if (!reasoning) {
      // Nothing to read: a card would only be noise. (A later attempt's thinking gets a new one.)
      card.root.remove();
      this.thinkingCards.delete(key);
      return;
    }
    card.title.textContent = `Reasoning · step ${data.iteration ?? "?"}`;
    card.setState("ok");
    card.body.replaceChildren(el("div", { className: "reasoning" }, reasoning));
    card.preview.textContent = reasoning.split("\n")[0].slice(0, 120);
  }

  onIteration(data) {
    if (data.status === "start") {
      const card = this.makeCard("tool", data.tool_name ?? "tool");
      card.iteration = data.iteration;
      card.toolName = data.tool_name;
      card.root.dataset.tool = data.tool_name ?? "";
      card.preview.textContent = compactArgs(data.tool_args);
      card.body.append(
        el("h4", {}, "Arguments"),
        el("pre", { className: "args", "data-testid": "tool-args" }, pretty(data.tool_args ?? {})),
      );
      this.toolCards.push(card);
      this.append(card.root);
      this.setStatus(`Running ${data.tool_name ?? "a tool"}…`);
      return;
    }
    let card = this.toolCards.find(
      (c) => c.pending && c.iteration === data.iteration && c.toolName === data.tool_name,
    );
    if (!card) {
      card = this.makeCard("tool", data.tool_name ?? "tool");
      card.root.dataset.tool = data.tool_name ?? "";
      this.toolCards.push(card);
      this.append(card.root);
    } else {
      trackEvent(card.root, this.currentId);
    }
    card.pending = false;
    const failed = Boolean(data.error);
    card.setState(failed ? "error" : "ok");
    card.meta.textContent = formatSeconds(data.iter_elapsed);
    if (failed) {
      card.body.append(
        el("h4", {}, "Error"),
        el("pre", { className: "error-text", "data-testid": "tool-error" }, String(data.error)),
      );
      card.root.open = true;
    }
    card.body.append(
      el("h4", {}, "Observation"),
      el("pre", { className: "observation", "data-testid": "tool-observation" }, data.observation ?? ""),
    );
    if (data.artifact) card.body.append(renderArtifact(data.artifact));
    this.setStatus("Thinking…");
  }

  makeCard(kind, titleText) {
    const title = el("span", { className: "card-title" }, titleText);
    const preview = el("span", { className: "card-preview" });
    const meta = el("span", { className: "card-meta" });
    const badge = el("span", { className: "card-badge", "aria-hidden": "true" });
    const body = el("div", { className: "card-body" });
    const root = el(
      "details",
      { className: `card ${kind}`, "data-testid": `${kind}-card`, "data-state": "running" },
      el("summary", {}, badge, el("span", { className: "card-icon", "aria-hidden": "true" }), title, preview, meta),
      body,
    );
    return {
      root,
      title,
      preview,
      meta,
      body,
      pending: true,
      setState(state) {
        root.dataset.state = state;
      },
    };
  }

  ensureAnswerBubble() {
    if (this.answerBubble && !this.answerBubble.hidden) return;
    if (this.answerBubble) {
      // Emptied by a resume: the answer starts afresh after the new attempt's steps.
      this.answerBubble.hidden = false;
      this.answerBubble.classList.add("streaming");
    } else {
      this.answerBody = el("div", { className: "markdown" });
      this.answerBubble = el(
        "div",
        { className: "bubble assistant streaming", "data-testid": "answer" },
        this.answerBody,
      );
    }
    this.timeline.append(this.answerBubble);
  }

  /**
   * Another worker carries the run on from its checkpoint (RUNS.md R-03): what was drawn from
   * events after `after` is redone, so it is greyed out, and the answer starts again.
   */
  onResumed(data) {
    const attempt = Number(data.attempt);
    if (Number.isFinite(attempt)) this.attempt = attempt;
    const lost = new Set(markLostAfter(this.timeline, data.after));
    for (const card of this.toolCards) {
      if (lost.has(card.root)) this.retireCard(card);
    }
    for (const [key, card] of this.thinkingCards) {
      if (!lost.has(card.root)) continue;
      this.retireCard(card);
      // The new attempt's thinking for this step gets a card of its own.
      this.thinkingCards.delete(key);
    }
    this.dropAnswer();
    const separator = resumedSeparator(data);
    trackEvent(separator, this.currentId);
    this.timeline.append(separator);
    this.root.dataset.attempt = String(this.attempt);
    this.attemptBadge.textContent = attemptBadgeText(attempt);
    this.attemptBadge.hidden = false;
    this.setStatus("Resumed on another worker — carrying on from its last checkpoint…");
  }

  /** This run replays an earlier one from a checkpoint: the steps that follow are restated. */
  onReplay(data) {
    this.addSeparator("replay", "Replayed from an earlier answer");
    const note = this.timeline.lastElementChild.firstElementChild;
    this.describeReplay?.(data)
      .then((text) => {
        if (text) note.textContent = text;
      })
      .catch(() => {
        // The plain note stays: the source run's events are a nicety here.
      });
  }

  /** A card of a lost attempt: no later event completes it, and it no longer looks running. */
  retireCard(card) {
    card.pending = false;
    if (card.root.dataset.state === "running") card.setState("stopped");
  }

  /** Forget the answer text streamed so far; the bubble empties and waits for the next delta. */
  dropAnswer() {
    if (this.renderTimer !== null) {
      clearTimeout(this.renderTimer);
      this.renderTimer = null;
    }
    this.answerText = "";
    if (!this.answerBubble) return;
    this.answerBody.replaceChildren();
    this.answerBubble.classList.remove("streaming");
    this.answerBubble.hidden = true;
  }

  onAnswer(data) {
    if (data.status === "start") {
      this.ensureAnswerBubble();
      this.setStatus("Writing the answer…");
    } else if (data.status === "delta") {
      this.ensureAnswerBubble();
      this.answerText += data.content ?? "";
      this.scheduleAnswerRender();
    } else if (data.status === "done") {
      this.renderAnswerNow();
      this.answerBubble?.classList.remove("streaming");
    }
  }

  scheduleAnswerRender() {
    if (this.renderTimer !== null) return;
    this.renderTimer = setTimeout(() => this.renderAnswerNow(), ANSWER_RENDER_DELAY_MS);
  }

  renderAnswerNow() {
    if (this.renderTimer !== null) {
      clearTimeout(this.renderTimer);
      this.renderTimer = null;
    }
    if (!this.answerBody) return;
    this.answerBody.innerHTML = renderMarkdown(this.answerText);
    this.root.dispatchEvent(new CustomEvent("run-grew", { bubbles: true }));
  }

  /** The user's follow-up, shown at once; the `inject` event (or the footer) takes its place. */
  addQueuedFollowUp(text) {
    this.timeline.append(
      el(
        "div",
        { className: "bubble user followup queued", "data-testid": "queued-followup" },
        el("span", { className: "bubble-label" }, "Follow-up · waiting for the agent"),
        el("div", { className: "bubble-text" }, text),
      ),
    );
  }

  clearQueuedFollowUps() {
    for (const bubble of this.timeline.querySelectorAll("[data-testid=queued-followup]")) bubble.remove();
  }

  onDone(data) {
    this.finished = true;
    this.doneData = data;
    this.clearQueuedFollowUps();
    this.setStatus("");
    this.attemptBadge.hidden = true;
    for (const card of [...this.toolCards, ...this.thinkingCards.values()]) {
      if (card.root.dataset.state === "running") card.setState("stopped");
    }
    const final = data.answer ?? "";
    if (final && final !== this.answerText) {
      // Synthesis failed part-way (or never streamed): the service's fallback answer replaces it.
      const partial = Boolean(this.answerText);
      this.ensureAnswerBubble();
      this.answerText = final;
      if (partial) {
        this.answerBubble.append(
          el("p", { className: "answer-note" }, "The streamed answer was cut short; this is the fallback answer."),
        );
      }
    }
    this.renderAnswerNow();
    this.answerBubble?.classList.remove("streaming");
    const usage = data.usage ?? {};
    const status = data.status ?? "completed";
    const parts = [
      el("span", { className: `status-badge status-${status}`, "data-testid": "done-status" }, status),
      el("span", {}, plural(data.iterations, "iteration")),
      el(
        "span",
        { title: `prompt ${usage.prompt_tokens ?? 0} · completion ${usage.completion_tokens ?? 0}` },
        plural(usage.total_tokens, "token"),
      ),
      el("span", {}, plural(usage.llm_calls, "LLM call")),
      el("span", {}, formatSeconds(data.elapsed)),
      this.attempt > 1
        ? el("span", { "data-testid": "done-attempt" }, `finished on attempt ${this.attempt}`)
        : null,
    ];
    const footer = el(
      "footer",
      { className: "done-footer", "data-testid": "done-footer", "data-status": status },
      el("div", { className: "done-stats" }, parts),
    );
    if (data.error) footer.append(el("p", { className: "done-error", "data-testid": "done-error" }, data.error));
    const pending = data.pending_injections ?? [];
    if (pending.length) {
      footer.append(
        el(
          "p",
          { className: "done-pending", "data-testid": "done-pending" },
          `Arrived too late for this run: ${pending.join(" · ")}`,
        ),
      );
    }
    this.timeline.append(footer);
    this.root.dispatchEvent(new CustomEvent("run-grew", { bubbles: true }));
  }

  setStatus(text) {
    this.status.textContent = text;
    this.status.hidden = !text;
  }

  /** Shown while the stream is down; the next event puts the normal status back. */
  setConnection(state) {
    this.root.classList.toggle("reconnecting", state === "reconnecting");
    if (state === "reconnecting" && !this.finished) this.setStatus("Connection lost — reconnecting…");
  }
}

function compactArgs(args) {
  if (args === undefined || args === null) return "";
  const text = typeof args === "string" ? args : JSON.stringify(args);
  return text.length > 90 ? `${text.slice(0, 89)}…` : text;
}

function looksBase64(text) {
  return /^[A-Za-z0-9+/=\s]+$/.test(text) && text.length % 4 === 0;
}

/** A tool's file, previewed: Markdown rendered safely, HTML and SVG in a sandbox with no rights. */
export function renderArtifact(artifact) {
  const filename = artifact.filename ?? "artifact";
  const mime = (artifact.mime_type ?? "text/plain").toLowerCase();
  const content = artifact.content ?? "";
  let preview;
  if (mime === "text/markdown" || /\.(md|markdown)$/i.test(filename)) {
    preview = el("div", { className: "markdown artifact-markdown" });
    preview.innerHTML = renderMarkdown(content);
  } else if (mime === "text/html" || mime === "image/svg+xml" || /\.(html?|svg)$/i.test(filename)) {
    // sandbox="" with no tokens: no scripts, no forms, no same-origin access, no navigation.
    preview = el("iframe", { className: "artifact-frame", sandbox: "", title: `Preview of ${filename}` });
    preview.srcdoc = content;
  } else if (mime.startsWith("image/") && looksBase64(content)) {
    preview = el("img", { className: "artifact-image", alt: filename, src: `data:${mime};base64,${content.replace(/\s/g, "")}` });
  } else {
    preview = el("pre", { className: "artifact-text" }, content);
  }
  const download = el("a", { className: "artifact-download", download: filename, href: "#" }, "Download");
  download.addEventListener("click", () => {
    const blob = new Blob([content], { type: mime });
    download.href = URL.createObjectURL(blob);
    setTimeout(() => URL.revokeObjectURL(download.href), 10_000);
  });
  return el(
    "figure",
    { className: "artifact", "data-testid": "artifact", "data-mime": mime },
    el("figcaption", {}, el("span", { className: "artifact-name" }, filename), el("span", { className: "artifact-mime" }, mime), download),
    preview,
  );
}
