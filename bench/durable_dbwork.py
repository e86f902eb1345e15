"""The database work of one run's life with what the run writes, for either tree's ``app``.

A child of ``bench/durable_bench.py checkpoints`` (``bench/durable_cost.py``), run as a script by
path (never ``-m``) with ``PYTHONPATH`` naming the tree to measure: the baseline's worktree or this
one. So it imports nothing from ``bench`` (that package would come from the same tree) and finds
out what the ``app`` it got can do (checkpoints, the durable follow-up queue) by looking.

It records one real run first: ``ReActAgent`` against the fake LLM (``bench/fakellm.py --tool add``),
collecting the engine's events, and, where the engine checkpoints, the deltas it hands its
checkpointer and the drains of its follow-up queue, each with its time from the run's start. Then
it replays that run ``--runs`` times, one after the other, through the service's own pieces:

* the run's life as ``bench/db_bench.py`` has it (create the conversation, read it, start the run,
  the stream's reads: conversation, active run, last stored event);
* the events published, at the recorded pace, through a real ``RunPublisher`` into a real
  ``EventRepo`` (its group commit), with a bus that keeps nothing (the database's work only);
* new code: every checkpoint through the service's ``RunCheckpointer.record`` (``orjson.dumps``,
  a ``CheckpointRecord`` to the publisher, stored in the events' transactions; the writes fenced
  by the run's attempt where the publisher takes a ``fence``) and the ``DurableInterruptQueue``
  with in-process hints: its drains at the recorded safe points and its last look before the close
  (a query whenever it cannot tell from the hint that nothing came; how often that is depends on
  the version: the queue may be given the hint read before the run's start, ``seen``);
* the close as ``Executor._finish`` does it: ``flush_store``, then ``RunRepo.finish`` with the done
  stamped by the publisher, then ``publish_stored`` and ``close``.

The new code's pieces are used as this tree has them when it runs (their signatures are looked at):
the app changes, and what is measured is the tree as it stands; the parent notes its commit and a
hash of its uncommitted ``app/`` changes per round.

Prints one JSON object: CPU (user + system of the process, the SQLite driver's thread included)
and wall per run, and per run the write transactions (commits), the sessions (pool checkouts:
reads and writes), the statements and the rows inserted, by table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import os
import tempfile
import time
from collections import Counter
from typing import Any

import orjson
from sqlalchemy import event as sa_event

import app
from app.db.errors import ConversationNotFoundError
from app.db.migrate import upgrade_database
from app.db.repositories import ConversationRepo, EventRepo, RunRepo
from app.db.session import Database
from app.engine.agent import AgentConfig, ReActAgent
from app.engine.events import EngineEvent, RunDone
from app.llm.openai_client import OpenAICompatibleLLM
from app.streaming.publisher import RunPublisher
from app.tools.registry import Tool, ToolRegistry

QUESTION = "Add one to each number from 0 to 4, one tool call at a time, then tell me about it."
ABILITIES = {"tool_call": True, "json_mode": True, "streaming": True}
ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


async def add(a: int, b: int) -> str:
    return str(a + b)


def add_registry() -> ToolRegistry:
    # Idempotent where the tree knows the word, as the service's calculator is: no durable wait.
    extra = {"idempotent": True} if "idempotent" in {f.name for f in dataclasses.fields(Tool)} else {}
    return ToolRegistry.of([Tool("add", "Add two integers.", ADD_PARAMETERS, add, **extra)])


def durable_runs() -> bool:
    """This tree's engine checkpoints runs (the new code)."""
    return "checkpointer" in inspect.signature(ReActAgent.run).parameters


class NullBus:
    """A bus that takes everything and keeps nothing: only the database's work is measured."""

    async def append(self, conversation_id: str, events: Any) -> None:
        return None

    async def last_id(self, conversation_id: str) -> str | None:
        return None

    async def expire(self, conversation_id: str, seconds: int) -> None:
        return None

    async def read_after(self, conversation_id: str, after: str, limit: int = 1000) -> list[Any]:
        return []


class _Count:
    def __init__(self) -> None:
        self.n = 0

    def inc(self, amount: int = 1) -> None:
        self.n += amount


class Metrics:
    """What ``RunCheckpointer`` touches of the service's metrics."""

    def __init__(self) -> None:
        self.checkpoints = _Count()


# ---- recording one real run ------------------------------------------------------------------


class Recorder:
    """Sink, checkpointer and follow-up queue of the recorded run: notes what came when."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.timeline: list[tuple[float, str, Any]] = []
        self.done: list[RunDone] = []
        self.position: int | None = None  # read by the loop at each checkpoint

    def _note(self, kind: str, item: Any) -> None:
        self.timeline.append((time.perf_counter() - self.t0, kind, item))

    async def __call__(self, event: EngineEvent) -> None:
        if isinstance(event, RunDone):
            self.done.append(event)
        else:
            self._note("event", event)

    def record(self, delta: dict[str, Any]) -> None:
        # A JSON round trip: the replay hands the checkpointer the same values, owned by nobody.
        self._note(
            "checkpoint", orjson.loads(orjson.dumps(delta, default=str, option=orjson.OPT_NON_STR_KEYS))
        )

    async def durable(self) -> None:
        self._note("durable", None)

    async def drain(self) -> list[str]:
        self._note("drain", None)
        return []

    async def put(self, content: str) -> int:
        raise NotImplementedError


async def record_run(llm_url: str, warmup: int) -> tuple[Recorder, list[Any]]:
    llm = OpenAICompatibleLLM(llm_url, "bench", "fake-model", ABILITIES)
    agent = ReActAgent(llm, add_registry(), AgentConfig(completion_check=False))
    try:
        for n in range(warmup + 1):
            recorder = Recorder()
            kwargs: dict[str, Any] = {"sink": recorder, "interrupts": recorder, "run_id": f"rec{n}"}
            if durable_runs():
                kwargs["checkpointer"] = recorder
            result = await agent.run(QUESTION, **kwargs)
    finally:
        await llm.aclose()
    if result.status != "completed" or not recorder.done:
        raise SystemExit(f"the recorded run ended {result.status}: {result.error}")
    messages = list(result.messages)
    if messages and messages[0].role == "user":
        messages = messages[1:]  # the question is stored when the run starts (Executor._finish)
    return recorder, messages


# ---- replaying it through the service's pieces -------------------------------------------------


class Counters:
    def __init__(self, db: Database) -> None:
        self.commits = 0
        self.checkouts = 0
        self.statements = 0
        self.rows: Counter[str] = Counter()
        engine = db.engine.sync_engine
        sa_event.listen(engine, "commit", self._commit)
        sa_event.listen(engine.pool, "checkout", self._checkout)
        sa_event.listen(engine, "before_cursor_execute", self._execute)

    def _commit(self, conn: Any) -> None:
        self.commits += 1

    def _checkout(self, *args: Any) -> None:
        self.checkouts += 1

    def _execute(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
    ) -> None:
        self.statements += 1
        words = statement.lstrip().split(None, 3)
        if len(words) >= 3 and words[0].upper() == "INSERT":
            table = words[2].strip('"')
            self.rows[table] += len(parameters) if many else 1

    def reset(self) -> None:
        self.commits = self.checkouts = self.statements = 0
        self.rows.clear()


def _accepted(func: Any, **kwargs: Any) -> dict[str, Any]:
    """Those of ``kwargs`` that ``func`` takes (the trees' signatures differ)."""
    params = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if k in params}


async def replay(
    url: str,
    recorder: Recorder,
    messages: list[Any],
    runs: int,
    warmup: int,
    paced: bool,
    without: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    durable = durable_runs()
    with_checkpoints = durable and "checkpoints" not in without
    with_follow_ups = durable and "follow-ups" not in without
    if durable:
        from app.db.repositories.follow_ups import FollowUpRepo
        from app.runs.execution import RunCheckpointer
        from app.runs.follow_ups import DurableInterruptQueue, MemoryFollowUpHints
    db = Database(url)
    conversations, run_repo, events = (
        ConversationRepo(db.sessionmaker),
        RunRepo(db.sessionmaker),
        EventRepo(db.sessionmaker),
    )
    bus = NullBus()
    counters = Counters(db)
    done_template = dataclasses.replace(recorder.done[-1], pending_injections=())
    worker_id, lease_s = "bench:1:x", 30.0
    publisher_extra = _accepted(RunPublisher.__init__, store_before_bus=False)
    fence_type: Any = None
    if "fence" in inspect.signature(RunPublisher.__init__).parameters and "fence" not in without:
        # Writes fenced by the run's attempt, as Executor.publisher makes them (renewing its lease).
        from app.streaming.store import Fence as fence_type
    hints = MemoryFollowUpHints() if with_follow_ups else None

    async def one() -> None:
        conv = await conversations.create("bench", "a question", {"tools": ["add"]})
        await conversations.get("bench", conv.id)  # POST .../runs checks the owner
        queue = checkpointer = None
        if hints is not None:
            # As RunManager.start_run: the hint read before the start, when the queue takes it.
            seen = await hints.version(conv.id)
            queue = DurableInterruptQueue(
                FollowUpRepo(db.sessionmaker),
                hints,
                conv.id,
                **_accepted(DurableInterruptQueue.__init__, seen=seen),
            )
        run, _ = await run_repo.start(
            conv.id, "bench", QUESTION, worker_id=worker_id, lease_s=lease_s, start_cursor="0-0"
        )
        # Opening the stream: the conversation, its active run, the last stored event.
        await conversations.get("bench", conv.id)
        await run_repo.active(conv.id)
        await events.last_id(conv.id)
        publisher = RunPublisher(
            bus,
            events,
            conv.id,
            run.id,
            last_id=run.start_cursor,
            retention_s=600,
            permanent_store_errors=(ConversationNotFoundError,),
            **publisher_extra,
            **({"fence": fence_type(run.id, 1, worker_id, lease_s)} if fence_type is not None else {}),
        )
        if with_checkpoints:
            # Without the durable queue (``--without follow-ups``), one that never moves.
            position = queue if queue is not None else Recorder()
            checkpointer = RunCheckpointer(publisher, position, run.id, 1, Metrics(), first_seq=0)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        for offset, kind, item in recorder.timeline:
            if paced:
                wait = t0 + offset - time.perf_counter()
                if wait > 0.0005:
                    await asyncio.sleep(wait)
            if kind == "event":
                await publisher.publish(item)
            elif checkpointer is not None and kind == "checkpoint":
                checkpointer.record(item)
            elif checkpointer is not None and kind == "durable":
                await checkpointer.durable()
            elif queue is not None and kind == "drain":
                await queue.drain()
        # The close, as Executor._finish (and the baseline's RunManager._finish) does it.
        await publisher.flush_store()
        if queue is not None:
            # The run's last look at its follow-ups (take_rest, or drain in later versions).
            await getattr(queue, "take_rest", queue.drain)()
        stamped = publisher.stamp(done_template)
        closed = await run_repo.finish(
            run.id,
            status=done_template.status,
            answer=done_template.answer,
            iterations=done_template.iterations,
            usage=dict(done_template.usage),
            elapsed=done_template.elapsed,
            error=done_template.error,
            pending_injections=[],
            messages=messages,
            conversation_id=conv.id,
            done=stamped,
            **_accepted(
                run_repo.finish,
                attempt=1,
                follow_ups_through=queue.position if queue is not None else None,
            ),
        )
        if not closed:
            raise SystemExit("the replayed run could not be closed")
        await publisher.publish_stored(stamped)
        await publisher.close()

    try:
        for _ in range(warmup):
            await one()
        counters.reset()
        before, wall = os.times(), time.perf_counter()
        for _ in range(runs):
            await one()
        after, wall = os.times(), time.perf_counter() - wall
    finally:
        await db.dispose()
    checkpoints = (
        [item for _, kind, item in recorder.timeline if kind == "checkpoint"] if with_checkpoints else []
    )
    kinds = Counter(kind for _, kind, _ in recorder.timeline)
    return {
        "runs": runs,
        "paced": paced,
        "recorded_run_ms": 1000 * recorder.timeline[-1][0] if recorder.timeline else 0.0,
        "events_published": kinds["event"] + 1,  # and the done
        "checkpoints": len(checkpoints),
        "checkpoint_bytes": sum(
            len(orjson.dumps(c, default=str, option=orjson.OPT_NON_STR_KEYS)) for c in checkpoints
        ),
        "drains": kinds["drain"] if with_follow_ups else 0,
        "durable_waits": kinds["durable"] if with_checkpoints else 0,
        "without": sorted(without),
        "cpu_ms_per_run": 1e3 * (after.user + after.system - before.user - before.system) / runs,
        "user_ms_per_run": 1e3 * (after.user - before.user) / runs,
        "system_ms_per_run": 1e3 * (after.system - before.system) / runs,
        "wall_ms_per_run": 1e3 * wall / runs,
        "write_transactions_per_run": counters.commits / runs,
        "sessions_per_run": counters.checkouts / runs,
        "statements_per_run": counters.statements / runs,
        "rows_inserted_per_run": {t: n / runs for t, n in sorted(counters.rows.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llm-url", required=True, help="bench/fakellm.py --k 5 --tokens 200 --tool add")
    parser.add_argument(
        "--db-url", default="", help="a migrated-here database (default: SQLite in a temp dir)"
    )
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--record-warmup", type=int, default=3)
    parser.add_argument("--burst", action="store_true", help="replay without the recorded pauses")
    parser.add_argument(
        "--without",
        nargs="*",
        choices=["checkpoints", "follow-ups", "fence"],
        default=[],
        help="new code: leave these out of the replay (what the durable additions cost, apart)",
    )
    args = parser.parse_args()

    async def go(url: str) -> dict[str, Any]:
        recorder, messages = await record_run(args.llm_url, args.record_warmup)
        return await replay(
            url, recorder, messages, args.runs, args.warmup, not args.burst, frozenset(args.without)
        )

    with tempfile.TemporaryDirectory(prefix="agentstream-dbwork-") as tmp:
        url = args.db_url or f"sqlite+aiosqlite:///{tmp}/bench.db"
        upgrade_database(url)
        result = asyncio.run(go(url))
    result.update(
        {
            "app_file": app.__file__,
            "durable_runs": durable_runs(),
            "database": url.split(":", 1)[0].split("+", 1)[0],
        }
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
