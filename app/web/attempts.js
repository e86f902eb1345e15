/**
 * Attempts of a run (RUNS.md ): when the worker executing a run dies or hands it over,
 * another worker carries the run on from its last checkpoint and announces it with
 * `phase: resumed` {attempt, after}. What the page drew from events after the cursor `after` (and
 * before that `resumed`) is work the new attempt does again: it stays on screen, greyed out and
 * labelled, so the user can still read what happened. The answer starts again from its start.
 *
 * Elements drawn from events carry `data-event-id` (the first event that drew them) and
 * `data-last-event-id` (the last one that changed them); an element is lost when any of its
 * events is after `after`. Cursors are "<ms>-<seq>" and are compared as numbers, never as strings.
 */

export const LOST_CLASS = "lost-attempt";
export const LOST_LABEL = "redone after resume";

const CURSOR = /^(\d{1,20})(?:-(\d{1,20}))?$/;

/** "<ms>-<seq>" (or a bare "<ms>") as [ms, seq] BigInts; null when it is not a cursor. */
export function parseCursor(id) {
  const match = CURSOR.exec(String(id ?? ""));
  if (!match) return null;
  return [BigInt(match[1]), BigInt(match[2] ?? "0")];
}

/** Whether cursor `id` comes after cursor `after`; false when either is not a cursor. */
export function isAfter(id, after) {
  const a = parseCursor(id);
  const b = parseCursor(after);
  if (!a || !b) return false;
  return a[0] > b[0] || (a[0] === b[0] && a[1] > b[1]);
}

/** Remember that `node` was drawn (or changed) by the event `id`. */
export function trackEvent(node, id) {
  if (id === null || id === undefined) return;
  if (!node.dataset.eventId) node.dataset.eventId = String(id);
  node.dataset.lastEventId = String(id);
}

function markLost(node) {
  node.classList.add(LOST_CLASS);
  node.dataset.lost = "true";
  const label = document.createElement("span");
  label.className = "lost-label";
  label.dataset.testid = "lost-label";
  label.textContent = LOST_LABEL;
  // In a card the label sits in the always-visible summary, before the timing.
  const summary = node.querySelector(":scope > summary");
  if (summary) summary.insertBefore(label, summary.querySelector(".card-meta"));
  else node.append(label);
}

/**
 * Mark every element of `timeline` drawn from an event after `after` as lost; returns the elements
 * marked now. The separators announcing earlier resumes are history, not work, and stay as they are.
 */
export function markLostAfter(timeline, after) {
  if (!parseCursor(after)) return [];
  const marked = [];
  for (const node of timeline.querySelectorAll("[data-last-event-id]")) {
    if (node.dataset.lost === "true" || node.dataset.testid === "resumed") continue;
    if (isAfter(node.dataset.lastEventId, after)) {
      markLost(node);
      marked.push(node);
    }
  }
  return marked;
}

/** The separator a `resumed` phase leaves in the timeline. */
export function resumedSeparator(data) {
  const attempt = Number(data.attempt);
  const node = document.createElement("div");
  node.className = "separator phase resumed";
  node.setAttribute("role", "separator");
  node.dataset.testid = "resumed";
  if (Number.isFinite(attempt)) node.dataset.attempt = String(attempt);
  if (data.after) node.dataset.after = String(data.after);
  const text = document.createElement("span");
  text.textContent = Number.isFinite(attempt)
    ? `Resumed on another worker (attempt ${attempt})`
    : "Resumed on another worker";
  node.append(text);
  return node;
}

/** What the run's badge says after a resume, until its `done`. */
export function attemptBadgeText(attempt) {
  return Number.isFinite(attempt) ? `Resumed · attempt ${attempt}` : "Resumed";
}
