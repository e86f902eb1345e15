"""Durable runs, ``resume``: how soon a run lives on after its worker.

Uvicorn workers on a PostgreSQL database of their own and Redis; a run in flight (answer tokens
streamed slowly by the fake LLM) followed through another worker's stream. Three ways a run's worker
goes, each timed to the ``resumed`` phase event arriving at the client: SIGKILL (from the kill; a
worker of this host whose process is gone), a lease that runs out (a run row held by a worker of
"another host", from the lease's expiry) and SIGTERM (from the release seen in the run's row, polled
every few ms, to the event).

The workers and the fake LLM are stopped by pid when the script ends, also on errors; the database
and the Redis keys are dropped. Run from the repository root (the command line is
``bench/durable_bench.py``'s)::

    .venv/bin/python -m bench.durable_bench resume [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from redis.asyncio import Redis

from bench.durable_common import PY, ROOT, log, tree_state
from bench.measure import QUESTION, percentile
from bench.scratch_pg import POSTGRES_URL, ScratchDatabase
from bench.service_stack import HOST, REDIS_URL, free_port, new_conversation, start_run
from bench.wire import Connection, SseStream

TARGET_RESUME = (
    "Resume time after SIGKILL (lease expiry to the resumed run's first event) and after SIGTERM "
    "(release to first event), p50/p99 over at least 20 kills; the SIGTERM hand-over under 1 s p99."
)


def summary(values: Sequence[float]) -> dict[str, float]:
    ms = list(values)
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 0.5),
        "p90_ms": percentile(ms, 0.9),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms) if ms else float("nan"),
        "min_ms": min(ms) if ms else float("nan"),
    }


class Worker:
    """One uvicorn worker of the app (this tree's), restartable; stopped by its pid."""

    def __init__(self, name: str, env: dict[str, str], tmp: str) -> None:
        self.name = name
        self.env = env
        self.tmp = tmp
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1
        self.port = free_port()
        log_file = open(Path(self.tmp) / f"{self.name}-{self.starts}.log", "wb")  # noqa: ASYNC230
        self.proc = subprocess.Popen(  # noqa: ASYNC220
            [
                PY,
                "-m",
                "uvicorn",
                "app.main:create_app",
                "--factory",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                "--no-access-log",
                "--timeout-keep-alive",
                "300",
            ],
            cwd=self.tmp,
            env=self.env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        log_file.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"worker {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            conn = Connection(HOST, self.port)
            try:
                status, _ = await conn.request("GET", "/readyz")
                if status == 200:
                    return
            except OSError:
                pass
            finally:
                await conn.close()
            await asyncio.sleep(0.05)
        raise RuntimeError(f"worker {self.name} not ready in 60 s")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def wait_exit(self, timeout_s: float) -> bool:
        assert self.proc is not None
        try:
            await asyncio.to_thread(self.proc.wait, timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    async def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        if not await self.wait_exit(20):
            self.proc.kill()
            await self.wait_exit(10)

    def log_tail(self) -> str:
        path = Path(self.tmp) / f"{self.name}-{self.starts}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


class Follower:
    """A client following a conversation through a worker's SSE stream, to its ``done``."""

    def __init__(self, port: int, conversation_id: str) -> None:
        self.stream = SseStream(HOST, port, f"/api/conversations/{conversation_id}/stream")
        self.first_delta = asyncio.Event()
        self.resumed = asyncio.Event()
        self.resumed_at: float | None = None
        """When the ``resumed`` phase event's bytes arrived (unix time, s)."""
        self.resumed_data: dict[str, Any] | None = None
        self.parts: list[str] = []
        """Answer deltas since the last ``resumed`` (what done.answer must be)."""
        self.done: dict[str, Any] | None = None
        self.events = 0

    async def follow(self) -> None:
        async for received, event, data in self.stream.events():
            self.events += 1
            if event == "answer":
                payload = orjson.loads(data)
                if payload.get("status") == "delta":
                    self.parts.append(payload["content"])
                    self.first_delta.set()
            elif event == "phase":
                payload = orjson.loads(data)
                if payload.get("phase") == "resumed" and self.resumed_at is None:
                    self.resumed_at = received / 1e6
                    self.resumed_data = payload
                    self.parts.clear()
                    self.resumed.set()
            elif event == "done":
                self.done = orjson.loads(data)
        self.first_delta.set()  # never leave a waiter behind
        self.resumed.set()

    @property
    def answer_ok(self) -> bool:
        return (
            self.done is not None
            and self.done.get("status") == "completed"
            and self.done.get("answer") == "".join(self.parts)
        )


@dataclasses.dataclass
class Sample:
    kind: str
    ms: float | None = None
    error: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class ResumeBench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = tempfile.TemporaryDirectory(prefix="agentstream-durable-")
        self.prefix = f"agentstream-bench:{uuid.uuid4().hex[:12]}"
        self.scratch = ScratchDatabase()
        self.fake: subprocess.Popen[str] | None = None
        self.llm_url = ""
        self.s: Worker | None = None
        self.v: Worker | None = None
        self.db: Any = None
        self.pg: Any = None
        self.restarts = 0

    # -- set-up and tear-down

    async def __aenter__(self) -> ResumeBench:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _start(self) -> None:
        import asyncpg

        from app.db.session import Database

        a = self.args
        self.fake = subprocess.Popen(  # noqa: ASYNC220
            [
                PY,
                "-m",
                "bench.fakellm",
                "--k",
                "1",
                "--tool",
                "calculator",
                "--tokens",
                str(a.tokens),
                "--timed",
                "--delay-s",
                str(a.delay_s),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            # A killed worker's connection makes it print tracebacks: kept out of the way.
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.fake.stdout is not None
        self.llm_url = (await asyncio.to_thread(self.fake.stdout.readline)).strip()
        if not self.llm_url.startswith(f"http://{HOST}:"):
            raise RuntimeError(f"fake LLM did not start: {self.llm_url!r}")
        await self.scratch.create()
        env = {
            **os.environ,
            "LLM_BASE_URL": self.llm_url,
            "LLM_API_KEY": "bench",
            "LLM_MODEL": "fake-model",
            "REDIS_URL": REDIS_URL,
            "REDIS_KEY_PREFIX": self.prefix,
            "DATABASE_URL": self.scratch.url,
            "LOG_LEVEL": "WARNING",
            "RUN_LEASE_S": str(a.run_lease_s),
            "SHUTDOWN_GRACE_S": str(a.grace_s),
            "TOOL_RATE_LIMIT_PER_MINUTE": "1000000",
        }
        self.s = Worker("S", env, self.tmp.name)
        self.v = Worker("V", env, self.tmp.name)
        await self.s.start()  # one at a time: each migrates the database as it starts
        await self.v.start()
        self.db = Database(self.scratch.url)
        self.pg = await asyncpg.connect(f"{POSTGRES_URL}/{self.scratch.name}", timeout=5)

    async def __aexit__(self, *exc: object) -> None:
        if exc and exc[0] is not None:
            for w in (self.s, self.v):
                if w is not None:
                    print(f"--- worker {w.name} log (tail) ---\n{w.log_tail()}", file=sys.stderr)
        for w in (self.s, self.v):
            if w is not None:
                with contextlib.suppress(Exception):
                    await w.stop()
        if self.fake is not None and self.fake.poll() is None:
            self.fake.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.fake.wait, 10)
            except subprocess.TimeoutExpired:
                self.fake.kill()
        if self.pg is not None:
            with contextlib.suppress(Exception):
                await self.pg.close()
        if self.db is not None:
            with contextlib.suppress(Exception):
                await self.db.dispose()
        redis = Redis.from_url(REDIS_URL)
        try:
            keys = [k async for k in redis.scan_iter(match=f"{self.prefix}:*", count=1000)]
            for i in range(0, len(keys), 500):
                await redis.delete(*keys[i : i + 500])
        finally:
            await redis.aclose()
        with contextlib.suppress(Exception):
            await self.scratch.drop()
        self.tmp.cleanup()

    async def ensure_victim(self) -> None:
        """V up again (bounded: a restart per round, and a few more)."""
        assert self.v is not None
        if self.v.alive:
            return
        self.restarts += 1
        if self.restarts > self.args.max_restarts:
            raise RuntimeError(f"more than {self.args.max_restarts} worker restarts")
        await self.v.start()

    # -- the pieces of a round

    async def _follow(self, conv: str, port: int) -> tuple[Follower, asyncio.Task[None]]:
        follower = Follower(port, conv)
        return follower, asyncio.create_task(follower.follow())

    async def _run_on_victim(self) -> tuple[str, str, Follower, asyncio.Task[None]]:
        """A run started on V, followed through S; returns once its answer streams."""
        assert self.s is not None and self.v is not None
        conn = Connection(HOST, self.v.port)
        try:
            conv = await new_conversation(conn)
            run = await start_run(conn, conv)
        finally:
            await conn.close()
        follower, task = await self._follow(conv, self.s.port)
        await asyncio.wait_for(follower.first_delta.wait(), 30)
        if follower.done is not None:
            raise RuntimeError("the run finished before it could be stopped")
        await asyncio.sleep(random.uniform(0, self.args.jitter_s))
        return conv, str(run["run_id"]), follower, task

    async def _finish(self, sample: Sample, follower: Follower, task: asyncio.Task[None]) -> None:
        try:
            await asyncio.wait_for(task, 60)
        except TimeoutError:
            follower.stream.abort()
            sample.error = "no done within 60 s of the resume"
            return
        sample.extra["attempt"] = (follower.resumed_data or {}).get("attempt")
        if not follower.answer_ok:
            sample.error = (
                f"done {(follower.done or {}).get('status')}, or its answer differs from the deltas"
            )

    async def _resumed(self, follower: Follower, timeout_s: float) -> float:
        await asyncio.wait_for(follower.resumed.wait(), timeout_s)
        if follower.resumed_at is None:
            raise RuntimeError(f"the stream ended without a resumed event (done: {follower.done})")
        return follower.resumed_at

    async def _dephase(self) -> None:
        """A random pause of up to one claim interval. The workers look for runs to take over every
        claim interval; without it the rounds, which start right after the previous resume, fall
        into step with those looks and every sample shows about the same delay."""
        await asyncio.sleep(random.uniform(0, self.claim_interval))

    # -- the three ways a worker goes

    async def sigkill_round(self) -> Sample:
        assert self.v is not None and self.v.proc is not None
        await self.ensure_victim()
        sample = Sample("sigkill")
        await self._dephase()
        _, _, follower, task = await self._run_on_victim()
        t_kill = time.time()
        self.v.proc.send_signal(signal.SIGKILL)
        # Reaped at once, as a process manager would (a zombie is detected as gone too).
        await self.v.wait_exit(10)
        try:
            arrived = await self._resumed(follower, 3 * self.claim_interval + 10)
            sample.ms = 1000 * (arrived - t_kill)
        except (TimeoutError, RuntimeError) as exc:
            sample.error = f"no resumed event: {exc!r}"
            follower.stream.abort()
        restart = asyncio.create_task(self.ensure_victim())
        if sample.error is None:
            await self._finish(sample, follower, task)
        else:
            task.cancel()
        await restart
        return sample

    async def lease_round(self) -> Sample:
        from app.db.repositories import RunRepo

        assert self.s is not None
        sample = Sample("lease")
        await self._dephase()
        conn = Connection(HOST, self.s.port)
        try:
            conv = await new_conversation(conn)
        finally:
            await conn.close()
        owner = await self.pg.fetchval("SELECT owner FROM conversations WHERE id = $1", conv)
        run, _ = await RunRepo(self.db.sessionmaker).start(
            conv,
            owner,
            QUESTION,
            worker_id=f"otherhost-{uuid.uuid4().hex[:6]}:1:gone",
            lease_s=self.args.other_lease_s,
            start_cursor="0-0",
        )
        expires_at = run.lease_expires_at
        assert expires_at is not None
        if expires_at.tzinfo is None:
            expires_at = expires_at.replace(tzinfo=UTC)
        expiry = expires_at.timestamp()
        follower, task = await self._follow(conv, self.s.port)
        try:
            arrived = await self._resumed(follower, self.args.other_lease_s + 3 * self.claim_interval + 10)
            sample.ms = 1000 * (arrived - expiry)
            if sample.ms < 0:
                sample.error = "resumed before the lease ran out"
        except (TimeoutError, RuntimeError) as exc:
            sample.error = f"no resumed event: {exc!r}"
            follower.stream.abort()
            task.cancel()
            return sample
        await self._finish(sample, follower, task)
        return sample

    async def _poll_release(self, run_id: str, stop_at: float) -> tuple[float, float, float, int, bool]:
        """Poll the run's row until its first attempt's worker no longer holds it: (start of the
        last poll that still saw it held, start and end of the poll that saw it let go, polls, and
        whether that poll saw it already claimed by another worker: the release and the claim can
        both fall between two polls when the machine is busy)."""
        held_since = time.time()
        polls = 0
        holder: str | None = None
        while time.monotonic() < stop_at:
            start = time.time()
            row = await self.pg.fetchrow("SELECT worker_id, attempt FROM runs WHERE id = $1", run_id)
            end = time.time()
            polls += 1
            assert row is not None
            if holder is None and row["attempt"] == 1:
                holder = row["worker_id"]
            if row["worker_id"] is None or row["attempt"] != 1 or row["worker_id"] != holder:
                return held_since, start, end, polls, row["worker_id"] is not None
            held_since = start
            await asyncio.sleep(self.args.poll_s)
        raise TimeoutError("the run was not released")

    async def sigterm_round(self) -> Sample:
        assert self.v is not None and self.v.proc is not None
        await self.ensure_victim()
        sample = Sample("sigterm")
        _, run_id, follower, task = await self._run_on_victim()
        poll = asyncio.create_task(self._poll_release(run_id, time.monotonic() + self.args.grace_s + 20))
        await asyncio.sleep(0)  # the first poll is on its way before the signal
        t_term = time.time()
        self.v.proc.send_signal(signal.SIGTERM)
        stage = "resumed event"
        try:
            arrived = await self._resumed(follower, self.args.grace_s + 20)
            stage = "release seen in the row"
            held, _seen_start, seen_end, polls, claimed = await asyncio.wait_for(poll, 5)
        except (TimeoutError, RuntimeError) as exc:
            sample.error = f"no {stage} within the time allowed: {exc!r}"
            poll.cancel()
            await self._diagnose(sample, run_id, follower, t_term)
            follower.stream.abort()
            task.cancel()
            await self.v.wait_exit(30)
            return sample
        # The release committed after ``held`` (that poll still saw the row held) and before
        # ``seen_end``: the figure counts from ``held``, so it may overstate by one poll.
        sample.ms = 1000 * (arrived - held)
        sample.extra = {
            "release_to_resumed_low_ms": 1000 * (arrived - seen_end),
            "term_to_release_ms": 1000 * ((held + seen_end) / 2 - t_term),
            "term_to_resumed_ms": 1000 * (arrived - t_term),
            "poll_window_ms": 1000 * (seen_end - held),
            "polls": polls,
            "release_seen_claimed_already": claimed,
        }
        if not await self.v.wait_exit(30):
            sample.error = "the worker did not exit within 30 s of SIGTERM"
        restart = asyncio.create_task(self.ensure_victim())
        await self._finish(sample, follower, task)
        await restart
        return sample

    async def _diagnose(self, sample: Sample, run_id: str, follower: Follower, t_start: float) -> None:
        """What a failed round left behind, for the report: the run's row, whether a resumed event
        or the done came later (waiting up to 30 s more), and the workers' logs."""
        assert self.s is not None and self.v is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(follower.resumed.wait(), 30)
        row = await self.pg.fetchrow(
            "SELECT status, worker_id, attempt, lost_attempts, lease_expires_at FROM runs WHERE id = $1",
            run_id,
        )
        sample.extra = {
            "run_row": {k: str(v) for k, v in dict(row or {}).items()},
            "resumed_after_s": None if follower.resumed_at is None else follower.resumed_at - t_start,
            "resumed": follower.resumed_data,
            "done": (follower.done or {}).get("status"),
            "events_seen": follower.events,
            "victim_exit_code": self.v.proc.poll() if self.v.proc is not None else None,
            "log_v": self.v.log_tail()[-1500:],
            "log_s": self.s.log_tail()[-1500:],
        }
        log(f"failed round: {json.dumps({k: v for k, v in sample.extra.items() if not k.startswith('log')})}")

    @property
    def claim_interval(self) -> float:
        # app.runs.takeover.Takeover.claim_loop
        return min(2.0, max(self.args.run_lease_s / 3, 0.05))


async def resume(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    deadline = started + args.max_seconds
    samples: dict[str, list[Sample]] = {"sigkill": [], "lease": [], "sigterm": []}
    async with ResumeBench(args) as bench:
        plan = [("sigkill", args.kills, bench.sigkill_round), ("lease", args.leases, bench.lease_round)]
        plan.append(("sigterm", args.terms, bench.sigterm_round))
        for kind, count, one in plan:
            for i in range(count):
                if time.monotonic() > deadline:
                    log(f"{kind}: stopped after {i} rounds (--max-seconds {args.max_seconds})")
                    break
                sample = await one()
                samples[kind].append(sample)
                shown = f"{sample.ms:.0f} ms" if sample.ms is not None else "-"
                log(f"{kind} {i + 1}/{count}: {shown}{' ERROR ' + sample.error if sample.error else ''}")
        worker_restarts = bench.restarts
        claim_interval = bench.claim_interval

    def block(kind: str) -> dict[str, Any]:
        good = [s for s in samples[kind] if s.ms is not None and s.error is None]
        out: dict[str, Any] = {
            **summary([s.ms for s in good if s.ms is not None]),
            "rounds": len(samples[kind]),
            "errors": [s.error for s in samples[kind] if s.error],
            "failed_rounds": [s.extra for s in samples[kind] if s.error and s.extra],
            "samples_ms": [round(s.ms, 1) if s.ms is not None else None for s in samples[kind]],
        }
        if kind == "sigterm" and good:
            for key in (
                "release_to_resumed_low_ms",
                "term_to_release_ms",
                "term_to_resumed_ms",
                "poll_window_ms",
            ):
                values = [s.extra[key] for s in good]
                out[key] = {
                    "p50": percentile(values, 0.5),
                    "p99": percentile(values, 0.99),
                    "max": max(values),
                }
            out["release_seen_claimed_already"] = sum(
                bool(s.extra.get("release_seen_claimed_already")) for s in good
            )
        return out

    result = {
        "scenario": "durable resume",
        "target": TARGET_RESUME,
        "new": tree_state(),
        "database": "PostgreSQL (asyncpg) on 127.0.0.1, a database made for the run and dropped after",
        "workers": "2 uvicorn workers (S streams, V runs and is stopped; V restarted after each kill)",
        "run_lease_s": args.run_lease_s,
        "claim_interval_s": claim_interval,
        "shutdown_grace_s": args.grace_s,
        "other_host_lease_s": args.other_lease_s,
        "poll_s": args.poll_s,
        "answer": f"{args.tokens} tokens, {1000 * args.delay_s:g} ms apart; stopped "
        f"0-{1000 * args.jitter_s:g} ms after the client's first answer delta",
        "worker_restarts": worker_restarts,
        "sigkill": block("sigkill"),
        "lease": block("lease"),
        "sigterm": block("sigterm"),
        "seconds": time.monotonic() - started,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    term = result["sigterm"]
    result["sigterm_p99_under_1s"] = bool(term["n"]) and term["p99_ms"] < 1000 and not term["errors"]
    return result
