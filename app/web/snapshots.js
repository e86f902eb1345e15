/**
 * The page's copy of the run it follows, kept in sessionStorage so that a reload draws what it had
 * at once and resumes the stream after it (the stream replays nothing twice: event ids).
 */

const SNAPSHOT_PREFIX = "agentstream.stream.";
const SNAPSHOT_DELAY_MS = 150;

export function snapshotKey(conversationId) {
  return SNAPSHOT_PREFIX + conversationId;
}

export function loadSnapshot(conversationId) {
  try {
    return JSON.parse(sessionStorage.getItem(snapshotKey(conversationId)) ?? "null");
  } catch {
    return null;
  }
}

export function clearSnapshot(conversationId) {
  sessionStorage.removeItem(snapshotKey(conversationId));
}

export function flushSnapshot(conversationId, run) {
  clearTimeout(run.snapshotTimer);
  run.snapshotTimer = null;
  if (run.view.finished) {
    clearSnapshot(conversationId);
    return;
  }
  const snapshot = { runId: run.id, lastId: run.view.lastId, events: run.view.events };
  try {
    sessionStorage.setItem(snapshotKey(conversationId), JSON.stringify(snapshot));
  } catch {
    // Storage full: without a snapshot a reload streams the run from its start, which is also correct.
    clearSnapshot(conversationId);
  }
}

export function scheduleSnapshot(conversationId, run) {
  if (run.snapshotTimer) return;
  run.snapshotTimer = setTimeout(() => flushSnapshot(conversationId, run), SNAPSHOT_DELAY_MS);
}
