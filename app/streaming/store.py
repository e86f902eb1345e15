"""What a run's publisher stores and where: the checkpoint record, the store's protocol, its errors.

The database implements ``EventStore`` (``app.db.repositories.EventRepo``); ``RunPublisher``
(``app.streaming.publisher``) feeds it a run's events and checkpoints, in order, in batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
