"""Replaying a run from one of its checkpoints (FACES.md B-06): LangGraph's time travel, for a chat.

A replay is a new run, a sibling answer to the same question, whose first attempt starts from the
state the source run had checkpointed at or before the chosen event, as a run resumed after a
crash does: the tool calls whose results that state holds are not run again; the loop goes on from
there, on the same model or another one.

So that the new run reads whole wherever it is shown (the page, ``/api/runs/{id}/events``, the
protocol faces), its events start with a ``phase {phase: "replay", source_run_id, after}`` and the
source's steps up to that checkpoint, restated as its own: what an earlier attempt of the source
did again after a crash is left out (RUNS.md R-03), and so is anything the new run does anew (a
call that waited for a person or a client, a call cut off mid-way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson

from app.db.repositories.run_start import Opening
from app.db.repositories.runs import CheckpointRow
from app.engine.state import PendingReply, RunCheckpoint
from app.streaming.bus import StoredEvent, next_cursor, parse_cursor
from app.streaming.stamp import wall_clock_ms


@dataclass(frozen=True, slots=True)
class ReplayStart:
    """What a replay starts from: the state its first attempt carries on, and the source's steps
    that led there (channel and payload), which its first events restate."""

    source_run_id: str
    after: str
    """The event of the source the replay was asked from."""
    state: RunCheckpoint
    steps: list[tuple[str, dict[str, Any]]]
    model: str | None = None
    """The configured model the replay runs on (None: the conversation's)."""

    def opening(self, run_id: str, after: str) -> Opening:
        """The new run's first events, stamped after cursor ``after``, and its first checkpoint."""
        marker = ("phase", {"phase": "replay", "source_run_id": self.source_run_id, "after": self.after})
        events: list[StoredEvent] = []
        prev = after
        for channel, payload in (marker, *self.steps):
            event_id = next_cursor(prev, wall_clock_ms())
            data = orjson.dumps({**payload, "run_id": run_id}).decode()
            events.append(StoredEvent(event_id, channel, data, run_id, prev))
            prev = event_id
        return Opening(events, orjson.dumps(self.state.encode()).decode())


def _cursor(event_id: str | None) -> tuple[int, int]:
    return parse_cursor(event_id) if event_id else (-1, -1)


def _placed_deltas(rows: Sequence[tuple[int, CheckpointRow]]) -> list[tuple[int, str | None, dict[str, Any]]]:
    """Every delta of ``rows`` with its attempt and the last event it covers (a row of a batch
    keeps each delta's as ``"@a"``; the row's is its last delta's)."""
    out: list[tuple[int, str | None, dict[str, Any]]] = []
    for attempt, row in rows:
        value = orjson.loads(row.data)
        deltas = value if isinstance(value, list) else [value]
        for index, delta in enumerate(deltas):
            after = delta.pop("@a", None)
            out.append((attempt, after if after is not None or index < len(deltas) - 1 else row.after, delta))
    return out


def state_at(rows: Sequence[tuple[int, CheckpointRow]], after: str) -> tuple[RunCheckpoint, str | None]:
    """The source's state at its last checkpoint at or before event ``after`` (``rows``: every
    checkpoint of every attempt, in order), and the last event that checkpoint covers; an empty
    state and None when no checkpoint came that early."""
    limit = _cursor(after)
    deltas = _placed_deltas(rows)
    chosen: int | None = None
    for index, (_, covered, _) in enumerate(deltas):
        if covered is not None and _cursor(covered) <= limit:
            chosen = index
    if chosen is None:
        return RunCheckpoint(), None
    attempt, covered, _ = deltas[chosen]
    # An attempt's first checkpoint holds the whole state it started from: fold its own only.
    return RunCheckpoint.fold(d for at, _, d in deltas[: chosen + 1] if at == attempt), covered


def for_new_run(state: RunCheckpoint) -> RunCheckpoint:
    """The source's state as a new run's starting point: its usage, its follow-up position and
    what its calls waited for are its own; results it holds are reused, calls without one are
    made anew (asked again, run again)."""
    values = list(state.values) if state.values is not None else None
    if values is not None:
        values[6:10] = [0, 0, 0, 0]
        values[10] = None
    pending = state.pending
    if pending is not None:
        done = set(pending.results)
        pending = PendingReply(
            pending.iteration,
            pending.kind,
            pending.reasoning,
            pending.answer,
            pending.calls,
            pending.injected,
            results=dict(pending.results),
            awaiting={k: v for k, v in pending.awaiting.items() if k in done},
            decided={k for k in pending.decided if k in done},
        )
    return replace(state, values=values, pending=pending, checkpoints=max(state.checkpoints, 1))


def steps_until(events: Sequence[StoredEvent], last: str | None) -> list[tuple[str, dict[str, Any]]]:
    """The source's events up to ``last`` that tell its steps, as the new run restates them:
    without the work an attempt did again after a crash, without its answer, phases of queueing or
    replaying, and without calls that did not finish there (the new run makes them itself)."""
    if last is None:
        return []
    limit = _cursor(last)
    kept: list[tuple[StoredEvent, dict[str, Any]]] = []
    for event in events:
        if _cursor(event.id) > limit:
            break
        data = orjson.loads(event.data)
        if event.event == "phase" and data.get("phase") == "resumed":
            # What came after the checkpoint it resumed from was done again: drop it.
            redone_after = _cursor(data.get("after"))
            while kept and _cursor(kept[-1][0].id) > redone_after:
                kept.pop()
            continue
        if event.event in ("answer", "done") or (
            event.event == "phase" and data.get("phase") in ("queued", "replay", "resumed")
        ):
            continue
        if event.event == "step" and data.get("type") == "answer":
            continue
        kept.append((event, data))
    finished = {d.get("call_id") for _, d in kept if d.get("type") == "iteration" and d["status"] == "done"}
    # An approval belongs to its call: kept only with a call that finished there (the replay asks
    # again for the others, under approvals of its own).
    asked = {d.get("approval_id"): d["call_id"] for e, d in kept if e.event == "approval" and "call_id" in d}
    out: list[tuple[str, dict[str, Any]]] = []
    for event, data in kept:
        if data.get("type") == "iteration" and data.get("status") == "start":
            if "call_id" in data and data["call_id"] not in finished:
                continue
        if event.event == "approval" and asked.get(data.get("approval_id")) not in finished:
            continue
        data.pop("run_id", None)
        data["source_event"] = event.id  # where a replay of the replay from here starts
        out.append((event.event, data))
    return out


def restated_from(event: StoredEvent) -> str | None:
    """The source event a replay's restated step stands for (None: an event of the run's own)."""
    if event.event not in ("step", "approval", "inject", "compact", "phase"):
        return None
    source = orjson.loads(event.data).get("source_event")
    return source if isinstance(source, str) else None


def plan(
    source_run_id: str,
    after: str,
    events: Sequence[StoredEvent],
    rows: Sequence[tuple[int, CheckpointRow]],
    model: str | None,
) -> ReplayStart:
    """The replay of the source run from its event ``after`` (one of ``events``, its events)."""
    state, covered = state_at(rows, after)
    return ReplayStart(
        source_run_id,
        after,
        for_new_run(state) if not state.empty else state,
        steps_until(events, covered),
        model,
    )
