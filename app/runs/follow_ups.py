"""The InterruptQueue the service gives its runs: follow-ups kept in the database (RUNS.md R-11).

``put()`` stores a follow-up and bumps the conversation's hint; ``drain()`` asks the database only
when the hint moved since it last looked, so a run that gets no follow-ups costs one hint read per
drain (an in-process counter, or one Redis GET), never a query. A drain takes what lies after the
queue's ``position`` without deleting it: the run's checkpoints record the position, and the rows
go with the checkpoint that records them taken (or the run's close). A new attempt starts from the
position its checkpoint holds, so no follow-up is lost with a worker or taken twice.
"""

from __future__ import annotations

import itertools
import logging
from typing import Protocol

from app.db.errors import FollowUpLimitError, database_unreachable
from app.db.repositories.follow_ups import FollowUpRepo
from app.engine.interrupts import MAX_QUEUED, InterruptQueueFullError

log = logging.getLogger("app.runs")


class FollowUpHints(Protocol):
    """Tells a run cheaply whether its conversation got follow-ups since it last looked."""

    async def version(self, conversation_id: str) -> object:
        """A value that changes whenever a follow-up is stored (a fresh token each time, never one
        seen before); raises when it cannot be read."""
        ...

    async def bump(self, conversation_id: str) -> None: ...


class MemoryFollowUpHints:
    """Hints for one process (the in-process bus serves only one)."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)
        self._versions: dict[str, int] = {}

    async def version(self, conversation_id: str) -> object:
        return self._versions.get(conversation_id, 0)

    async def bump(self, conversation_id: str) -> None:
        self._versions[conversation_id] = next(self._counter)


class DurableInterruptQueue:
    """One conversation's follow-ups, as one attempt of its run takes them."""

    def __init__(
        self,
        repo: FollowUpRepo,
        hints: FollowUpHints,
        conversation_id: str,
        *,
        position: int | None = None,
        seen: object | None = None,
        limit: int = MAX_QUEUED,
    ) -> None:
        """``seen``: the hint as it was before the run started (whose start took what waited
        then, RunRepo.start): until it moves, the run asks the database nothing."""
        self._repo = repo
        self._hints = hints
        self._conversation_id = conversation_id
        self._limit = limit
        self.position: int | None = position
        """The id of the last follow-up taken; None: none yet (the run takes every one there is)."""
        self._seen: object | None = seen
        self._looked = seen is not None

    async def put(self, content: str) -> int:
        try:
            queued = await self._repo.add(self._conversation_id, content, limit=self._limit)
        except FollowUpLimitError as exc:
            raise InterruptQueueFullError(str(exc)) from exc
        try:
            await self._hints.bump(self._conversation_id)
        except Exception as exc:
            # Stored: the run takes it when the hint moves again or cannot be read; else the next
            # run of the conversation has it in its history (RunRepo.start).
            log.warning("could not announce a follow-up", extra={"error": repr(exc)})
        return queued

    async def drain(self) -> list[str]:
        version = await self.version()  # None: cannot tell, so ask the database
        if self._looked and version is not None and version == self._seen:
            return []
        try:
            return await self._take(version)
        except Exception as exc:
            if not database_unreachable(exc):
                raise
            # The run goes on through a database outage; what waits is taken at a later drain.
            log.warning("follow-ups unreachable; taken later", extra={"error": repr(exc)})
            return []

    async def version(self) -> object | None:
        """The conversation's hint now; None when it cannot be read."""
        try:
            return await self._hints.version(self._conversation_id)
        except Exception:
            return None

    async def _take(self, version: object | None) -> list[str]:
        rows = await self._repo.after(self._conversation_id, self.position or 0)
        self._seen, self._looked = version, True
        if rows:
            self.position = rows[-1].id
        return [row.content for row in rows]
