"""One response's share of a run's message (FACES.md V-03, V-04).

A new run's response and a resume send the message from its ``start``. A continuation (the request
that settles what a waiting run waits for) goes on with the same message: it sends ``start`` (same
id) and only what comes after the point where the earlier response ended, the ``waiting`` that
named what it settled. The run's events before that point still go through the translator, so its
state is the client's. If no such ``waiting`` comes (the attempt that asked died before it said it
waits, and the next one went on with what was settled), the response takes over at the next
attempt's ``resumed``, or at the ``done``.
"""

from __future__ import annotations

from typing import Any

from app.api.faces.aisdk.chunks import Chunk, MessageChunks
from app.api.faces.follow import is_waiting, payload
from app.streaming.bus import StoredEvent


class ResponseChunks:
    """The chunks of one response: ``opening()``, ``event()`` for each of the run's events from its
    first, then ``closing()``."""

    def __init__(self, chunks: MessageChunks, settled: frozenset[str] = frozenset()) -> None:
        self.chunks = chunks
        self.settled = settled
        self._quiet = bool(settled)
        self._asked = False
        self._waiting = False

    def opening(self) -> list[Chunk]:
        return [] if self._quiet else self.chunks.start()

    async def event(self, event: StoredEvent) -> list[Chunk]:
        out = await self.chunks.event(event)
        self._waiting = is_waiting(event)
        if not self._quiet:
            return out
        self._asked = self._asked or _asks(event, self.settled)
        if self._waiting and self.settled & _named(payload(event)):
            self._quiet = False
            self.chunks.park()  # where the earlier response ended
            return self.chunks.start()
        if event.is_done or (self._asked and _is_resumed(event)):
            self._quiet = False
            return [*self.chunks.start(), *out]
        return []

    def closing(self) -> list[Chunk]:
        """After the run's last event of this response: its end, or where it waits."""
        out = self.chunks.start() if self._quiet else []  # it waits again before that point
        if self._waiting:
            out += self.chunks.park()
        return out


def _asks(event: StoredEvent, settled: frozenset[str]) -> bool:
    """Whether ``event`` asks for one of ``settled`` (an approval, a client call)."""
    if event.event not in ("approval", "step") or not any(key in event.data for key in settled):
        return False
    data = payload(event)
    return data.get("approval_id") in settled or (bool(data.get("client")) and data.get("call_id") in settled)


def _is_resumed(event: StoredEvent) -> bool:
    return event.event == "phase" and '"resumed"' in event.data and payload(event).get("phase") == "resumed"


def _named(waiting: dict[str, Any]) -> set[str]:
    return {*waiting.get("approval_ids", ()), *waiting.get("call_ids", ())}
