"""``RunCheckpointer``: the engine's checkpoints of one attempt, on their way to the database."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from app.engine.events import Usage
from app.observability import Metrics
from app.runs.follow_ups import DurableInterruptQueue
from app.streaming.publisher import RunPublisher
from app.streaming.store import CheckpointRecord


class RunCheckpointer:
    """The engine's ``Checkpointer`` for one attempt: checkpoints ride with the run's events to the
    database (one group commit for both), numbered within the attempt."""

    def __init__(
        self,
        publisher: RunPublisher,
        queue: DurableInterruptQueue,
        run_id: str,
        attempt: int,
        metrics: Metrics,
        *,
        first_seq: int,
    ) -> None:
        self._publisher = publisher
        self._queue = queue
        self._run_id = run_id
        self._attempt = attempt
        self._metrics = metrics
        self._seq = first_seq
        self._taken = queue.position
        self._values: list[Any] | None = None
        """The scalars of the last checkpoint (``"v"``), to store the usage alone at a hand-over."""

    def wants_full(self) -> bool:
        return self._publisher.checkpoints_lost

    def record(self, delta: dict[str, Any]) -> None:
        self._values = delta.get("v", self._values)
        data = orjson.dumps(delta, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
        full = bool(delta.get("full"))
        record = CheckpointRecord(self._run_id, self._attempt, self._seq, data, full=full)
        if self._queue.position != self._taken or (full and self._taken is not None):
            # The follow-ups the checkpoint records as taken leave the queue with it (again, with a
            # whole-state checkpoint: the one that took them may be the one the store lost).
            self._taken = self._queue.position
            record = replace(record, follow_ups_through=self._taken)
        self._publisher.checkpoint(record)
        self._seq += 1
        self._metrics.checkpoints.inc()

    async def durable(self) -> None:
        await self._publisher.stored()

    def record_usage(self, usage: Usage, values: list[Any] | None) -> None:
        """A last checkpoint with the usage of every call made so far (R-06): calls whose replies
        no checkpoint holds yet (the attempt stops mid-iteration) are made again, and counted."""
        last = self._values if self._values is not None else values
        if last is None:
            return
        now = [
            *last[:6],
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens,
            usage.llm_calls,
            *last[10:],
        ]
        if now != last:
            self.record({"v": now})
