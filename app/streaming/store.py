"""What a run's publisher stores and where: the checkpoint record, the store's protocol, its errors.

The database implements ``EventStore`` (``app.db.repositories.EventRepo``); ``RunPublisher``
(``app.streaming.publisher``) feeds it a run's events and checkpoints, in order, in batches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from app.streaming.bus import StoredEvent


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """One checkpoint of a run as it is stored (RUNS.md R-01), with ``after``, the id of the last
    event published before it: the events it covers."""

    run_id: str
    attempt: int
    seq: int
    data: str
    after: str | None = None
    follow_ups_through: int | None = None
    """The run took the conversation's follow-ups up to this id: stored with the checkpoint, they
    are deleted from its queue."""
    full: bool = False
    """The whole state, not what changed: what follows a checkpoint the store lost."""


@dataclass(frozen=True, slots=True)
class Fence:
    """Who writes: an attempt of a run, on a worker. Where it matters (taking follow-ups off the
    queue; a checkpoint that a tool call must not start without) the store keeps a write only
    while that attempt still holds the run, and renews its lease with it: an attempt that lost the
    run to another worker (it stalled past its lease) cannot act for it any more."""

    run_id: str
    attempt: int
    worker_id: str
    lease_s: float
    hold: HoldClock | None = field(default=None, compare=False)
    """When this worker last confirmed that it holds its runs: once that is older than half a
    lease, every write of the attempt is fenced (a worker that stalled may have lost the run)."""

    def stale(self) -> bool:
        return self.hold is not None and self.hold.stale(self.lease_s)


class HoldClock:
    """When a worker's heartbeat last renewed its leases (on the monotonic clock)."""

    def __init__(self) -> None:
        self.confirmed_at = time.monotonic()

    def confirm(self, at: float) -> None:
        self.confirmed_at = max(self.confirmed_at, at)

    def stale(self, lease_s: float) -> bool:
        return time.monotonic() - self.confirmed_at > lease_s / 2


class EventStore(Protocol):
    async def save(
        self,
        conversation_id: str,
        events: Sequence[StoredEvent],
        checkpoints: Sequence[CheckpointRecord] = (),
        fence: Fence | None = None,
    ) -> None:
        """Store events and checkpoints in one transaction; what is already stored is skipped, so
        a retried batch is harmless. With ``fence``, raises ``AttemptLostError`` (storing
        nothing) if that attempt no longer holds the run."""
        ...

    async def holds_run(self, fence: Fence) -> bool:
        """Whether that attempt still holds its run; renews its lease if so."""
        ...


class PublisherClosedError(Exception):
    """``publish()`` after ``close()``."""


class EventPersistError(Exception):
    """The database kept refusing the run's events for longer than ``store_retry_s``."""


class AttemptLostError(EventPersistError):
    """The attempt that writes no longer holds its run: another worker carries it on."""
