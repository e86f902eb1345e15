"""The service under test for ``bench/service_bench.py``, and the client calls its scenarios share.

* ``Stack``: the fake LLM and N uvicorn workers of the app (``app.main:create_app --factory``) as
  child processes on 127.0.0.1, sharing Redis (keys under a unique prefix, deleted at the end) and
  a database (SQLite in a temporary directory, or a PostgreSQL database made for the run and
  dropped after); optionally worker 0 under ``py-spy record``, or importing another tree's ``app``;
  stopped by pid and cleaned up on exit, also on errors;
* readings of a worker process from /proc (CPU, RSS) and of the machine (busy, stolen), and the
  probe inside a worker (``bench/probe``: event-loop lag, collection passes);
* the API calls of a run: a new conversation, a run started in it, its SSE stream read to ``done``
  (``read_stream``: the answer, the events, bytes, and per timed token its delivery latency).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from redis.asyncio import Redis

from bench.fakellm import parse_stamps
from bench.measure import QUESTION, percentile
from bench.scratch_pg import ScratchDatabase
from bench.wire import Connection, SseStream

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
HOST = "127.0.0.1"
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
AGENT = {"tools": ["calculator"], "completion_check": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _only_child(pid: int) -> int:
    """The one child process of ``pid`` (the worker py-spy started)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    if len(children) != 1:
        raise RuntimeError(f"expected one child of {pid}, found {children}")
    return int(children[0])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[int, int, int]:
    """The machine's CPU time since boot from /proc/stat: (total, idle + iowait, steal), in ticks."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields), fields[3] + fields[4], fields[7]


def machine_share(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict[str, float]:
    """Busy and stolen percent of all the machine's cores between two ``machine_cpu()`` readings.

    Steal is time the hypervisor gave to other guests while this one wanted to run: on a shared
    host it slows every process here, the worker included, and moves latency from run to run.
    """
    total = max(1, after[0] - before[0])
    return {
        "machine_busy_pct": 100 * (total - (after[1] - before[1]) - (after[2] - before[2])) / total,
        "machine_steal_pct": 100 * (after[2] - before[2]) / total,
    }


def loop_thread_sched(pid: int) -> tuple[int, int] | None:
    """The main thread's (the event loop's) time on a CPU and time runnable but waiting for one,
    in ns, from the scheduler (``/proc/<pid>/task/<pid>/schedstat``); None where the kernel keeps
    no such counts."""
    try:
        on_cpu, waiting, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu), int(waiting)


def postgres_cpu() -> dict[int, int]:
    """CPU time (ns) of each PostgreSQL server process on the machine (its backends included)."""
    times: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() == "postgres":
                times[int(entry.name)] = int((entry / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return times


Sched = tuple[tuple[int, int] | None, dict[int, int]]
"""A (``loop_thread_sched``, ``postgres_cpu``) reading."""


def sched_shares(before: Sched, after: Sched, wall_s: float) -> dict[str, float]:
    """Percent of the wall time between two readings that the event loop's thread ran, that it
    waited for a CPU, and that PostgreSQL's processes ran: whether a loop that lags is busy with
    its own work, kept off the CPU by others (PostgreSQL's among them), or neither (bench/NOTES.md,
    eighth session). PostgreSQL's share counts the processes alive at the end (one started
    meanwhile from zero, a process id reused by a new one too), so one that ended during the level
    is left out: a lower bound. NaN for the loop's thread where the kernel keeps no counts."""
    ns = max(1.0, wall_s * 1e9)
    (loop0, pg0), (loop1, pg1) = before, after
    shares = {"loop_thread_cpu_pct": math.nan, "loop_thread_runqueue_pct": math.nan}
    if loop0 is not None and loop1 is not None:
        shares["loop_thread_cpu_pct"] = 100 * (loop1[0] - loop0[0]) / ns
        shares["loop_thread_runqueue_pct"] = 100 * (loop1[1] - loop0[1]) / ns
    # From zero for a process started meanwhile, or one whose id was reused (its count went down).
    ran = sum(t - pg0.get(p, 0) if t >= pg0.get(p, 0) else t for p, t in pg1.items())
    shares["postgres_cpu_pct"] = 100 * ran / ns
    return shares


def probe_env(path: Path) -> dict[str, str]:
    """Environment that turns on bench/probe in a worker, its records going to ``path``."""
    search = [str(ROOT / "bench" / "probe"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(search), "BENCH_PROBE_OUT": str(path)}


def probe_summary(path: Path, start: float, end: float) -> dict[str, Any]:
    """The probe's records between ``start`` and ``end`` (unix time): the event loop's lag and the
    collector's passes (bench/probe/sitecustomize.py)."""
    lags: list[float] = []
    passes: dict[int, list[tuple[float, int]]] = {0: [], 1: [], 2: []}
    for line in path.read_text().splitlines() if path.exists() else ():
        fields = line.split()
        if len(fields) < 3 or not start <= float(fields[0]) <= end:
            continue
        if fields[1] == "lag":
            lags.append(float(fields[2]))
        elif fields[1] == "gc" and len(fields) == 5:
            passes[int(fields[2])].append((float(fields[3]), int(fields[4])))
    summary: dict[str, Any] = {
        "loop_lag_ms": {
            "p50": percentile(lags, 0.5),
            "p90": percentile(lags, 0.9),
            "max": max(lags, default=float("nan")),
        }
    }
    for generation, rows in passes.items():
        times = [ms for ms, _ in rows]
        objects = [n for _, n in rows if n >= 0]
        summary[f"gc{generation}"] = {
            "passes": len(rows),
            "ms_total": sum(times),
            "ms_max": max(times, default=0.0),
            "passes_over_3ms": sum(ms > 3 for ms in times),
            "objects_p50": round(percentile(objects, 0.5)) if objects else None,
            "objects_max": max(objects, default=None),
        }
    return summary


class Stack:
    """The fake LLM and N workers as child processes; stopped (by pid) and cleaned up on exit."""

    def __init__(
        self,
        fake_args: Sequence[str],
        workers: int = 1,
        env: dict[str, str] | None = None,
        db: str = "sqlite",
        profile: tuple[str, str] | None = None,
        app_path: str | None = None,
        redis_url: str | None = None,
        factory: str = "app.main:create_app",
        wrapper: Sequence[str] = (),
        ready_timeout_s: float = 60.0,
    ) -> None:
        self.db = db
        # A command worker 0 runs under, in the same process (bench/instructions.py: valgrind), and
        # how long a worker may take to become ready (much longer under it).
        if wrapper and profile:
            raise ValueError("worker 0 runs under py-spy or under a wrapper, not both")
        self.wrapper = list(wrapper)
        self.ready_timeout_s = ready_timeout_s
        # What the workers serve: the app, or (bench/capacity_bench.py's floor) another ASGI app
        # factory of this tree, importable from the repository root.
        self.factory = factory
        # The Redis the workers share (default REDIS_URL: 127.0.0.1:6379); bench/capacity_bench.py
        # gives one it started itself (a node of its own, or a cluster's).
        self.redis_url = redis_url or REDIS_URL
        # The tree whose ``app`` package the workers import (default: this one, through the
        # venv's editable install). bench/durable_cost.py (durable_bench checkpoints) points it at a
        # worktree of an earlier commit, so that this very script measures both apps.
        self.app_path = os.path.abspath(app_path) if app_path else None
        self.app_file = ""
        """``app.__file__`` as the workers import it (checked with their environment and cwd)."""
        # (py-spy, output): worker 0 runs under `py-spy record` for its whole life (attaching to a
        # running process is refused on some machines), stopped with SIGINT at the end.
        # Both absolute: py-spy and the worker run in the temporary directory.
        self.profile = (os.path.abspath(profile[0]), os.path.abspath(profile[1])) if profile else None
        self.pg_database: ScratchDatabase | None = None
        self.fake_args = list(fake_args)
        self.n_workers = workers
        self.env_extra = env or {}
        self.prefix = f"agentstream-bench:{uuid.uuid4().hex[:12]}"
        self.tmp = tempfile.TemporaryDirectory(prefix="agentstream-bench-")
        self.fake: subprocess.Popen[str] | None = None
        self.workers: list[tuple[subprocess.Popen[bytes], int]] = []
        self.pids: list[int] = []
        """The workers' own process ids (for CPU and RSS): under py-spy, its child's."""
        self.llm_url = ""

    async def __aenter__(self) -> Stack:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _start(self) -> None:
        # Start-up, before any load: blocking process and file calls are fine here.
        self.fake = subprocess.Popen(  # noqa: ASYNC220
            [PY, "-m", "bench.fakellm", *self.fake_args], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        assert self.fake.stdout is not None
        self.llm_url = (await asyncio.to_thread(self.fake.stdout.readline)).strip()
        if not self.llm_url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"fake LLM did not start: {self.llm_url!r}")
        if self.db == "postgres":
            self.pg_database = ScratchDatabase()
            await self.pg_database.create()
            database_url = self.pg_database.url
        else:
            database_url = f"sqlite+aiosqlite:///{self.tmp.name}/bench.db"
        env = {
            **os.environ,
            "LLM_BASE_URL": self.llm_url,
            "LLM_API_KEY": "bench",
            "LLM_MODEL": "fake-model",
            "REDIS_URL": self.redis_url,
            "REDIS_KEY_PREFIX": self.prefix,
            "DATABASE_URL": database_url,
            "LOG_LEVEL": "WARNING",
            "SHUTDOWN_GRACE_S": "3",
            "TOOL_RATE_LIMIT_PER_MINUTE": "1000000",
            **self.env_extra,
        }
        if self.app_path:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.app_path, env.get("PYTHONPATH")]))
        if not self.factory.startswith("app."):
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.app_file = (
            await asyncio.to_thread(
                subprocess.run,
                [PY, "-c", "import app; print(app.__file__)"],
                cwd=self.tmp.name,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
        ).stdout.strip()
        for i in range(self.n_workers):
            port = free_port()
            log = open(Path(self.tmp.name) / f"worker{i}.log", "wb")  # noqa: ASYNC230
            spy: list[str] = list(self.wrapper) if i == 0 else []
            if self.profile and i == 0:
                py_spy, out = self.profile
                spy = [py_spy, "record", "-r", "100", "-f", "raw", "-o", out, "--gil", "--nonblocking", "--"]
            proc = subprocess.Popen(  # noqa: ASYNC220
                [
                    *spy,
                    PY,
                    "-m",
                    "uvicorn",
                    self.factory,
                    "--factory",
                    "--host",
                    HOST,
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                    "--no-access-log",
                    "--backlog",
                    "4096",
                    "--timeout-keep-alive",
                    "300",
                ],
                cwd=self.tmp.name,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            self.workers.append((proc, port))
            # One at a time: each worker migrates the shared database as it starts.
            await self._wait_healthy(port, proc)
            self.pids.append(_only_child(proc.pid) if self.profile and i == 0 else proc.pid)

    async def _wait_healthy(self, port: int, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}; log in {self.tmp.name}")
            conn = Connection(HOST, port)
            try:
                status, _ = await conn.request("GET", "/readyz")
                if status == 200:
                    return
            except OSError:
                pass
            finally:
                await conn.close()
            await asyncio.sleep(0.1)
        raise RuntimeError(f"worker did not become ready in {self.ready_timeout_s:.0f} s")

    def _redis_client(self) -> Any:
        if self.env_extra.get("REDIS_CLUSTER", "").lower() in ("1", "true", "yes"):
            from redis.asyncio.cluster import RedisCluster

            return RedisCluster.from_url(self.redis_url)
        return Redis.from_url(self.redis_url)

    def worker_log(self, i: int = 0) -> str:
        return (Path(self.tmp.name) / f"worker{i}.log").read_text(errors="replace")

    async def __aexit__(self, *exc: object) -> None:
        if exc and exc[0] is not None:
            for i in range(len(self.workers)):
                print(f"--- worker {i} log (tail) ---\n{self.worker_log(i)[-3000:]}", file=sys.stderr)
        if self.profile and self.workers and self.workers[0][0].poll() is None:
            # py-spy writes its samples on SIGINT (and takes the worker down with it).
            self.workers[0][0].send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.workers[0][0].wait, 30)
        for (proc, _), pid in zip(self.workers, self.pids, strict=False):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            if pid != proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        for proc, _ in self.workers:
            try:
                await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self.fake is not None and self.fake.poll() is None:
            self.fake.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.fake.wait, 10)
            except subprocess.TimeoutExpired:
                self.fake.kill()
        redis = self._redis_client()
        try:
            keys = [k async for k in redis.scan_iter(match=f"{self.prefix}:*", count=1000)]
            for i in range(0, len(keys), 500):
                await redis.delete(*keys[i : i + 500])
        finally:
            await redis.aclose()
        if self.pg_database is not None:
            await self.pg_database.drop()
        self.tmp.cleanup()

    @property
    def database(self) -> str:
        if self.db == "postgres":
            return "PostgreSQL (asyncpg) on 127.0.0.1, a database made for the run and dropped after"
        return "SQLite (aiosqlite, WAL) in a temporary directory"


async def new_conversation(conn: Connection) -> str:
    status, conv = await conn.request("POST", "/api/conversations", {"agent": AGENT})
    if status != 201:
        raise RuntimeError(f"create conversation: {status} {conv}")
    return str(conv["id"])


async def start_run(conn: Connection, conv_id: str) -> dict[str, Any]:
    status, run = await conn.request("POST", f"/api/conversations/{conv_id}/runs", {"message": QUESTION})
    if status != 202:
        raise RuntimeError(f"start run: {status} {run}")
    return dict(run)


class StreamResult:
    __slots__ = (
        "answer",
        "before_connect",
        "bytes_in",
        "done",
        "engine_side",
        "events",
        "first_step_at",
        "parts",
        "stamps",
        "transport_side",
    )

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.stamps: list[int] = []
        """Per timed token: delivery latency in µs (received minus the fake LLM's send stamp)."""
        self.engine_side: list[int] = []
        """µs from the fake LLM's send to the publish time in the event id (ms resolution)."""
        self.transport_side: list[int] = []
        """µs from that publish time to the client (ms resolution)."""
        self.before_connect = 0
        """Timed tokens sent before this client's stream was open (replayed, so not a delivery latency)."""
        self.events: list[str] = []
        self.done: dict[str, Any] | None = None
        self.first_step_at: float | None = None
        self.bytes_in = 0
        self.answer = ""


async def read_stream(port: int, conv_id: str, *, timed: bool = False) -> StreamResult:
    out = StreamResult()
    stream = SseStream(HOST, port, f"/api/conversations/{conv_id}/stream")
    async for received, event, data in stream.events():
        if out.first_step_at is None and event == "step":
            out.first_step_at = time.perf_counter()
        if event == "answer":
            payload = orjson.loads(data)
            if payload.get("status") == "delta":
                out.parts.append(payload["content"])
                if timed:
                    published_us = int(stream.last_id.split("-", 1)[0]) * 1000
                    for sent in parse_stamps(payload["content"]):
                        if sent >= stream.connected_us:
                            out.stamps.append(received - sent)
                            # The event id's time is when the engine published the (first) token.
                            out.engine_side.append(published_us - sent)
                            out.transport_side.append(received - published_us)
                        else:
                            out.before_connect += 1
        elif event == "done":
            out.done = orjson.loads(data)
        out.events.append(event)
    if stream.status != 200:
        raise RuntimeError(f"stream answered {stream.status}")
    out.bytes_in = stream.bytes_in
    out.answer = "".join(out.parts)
    return out
