"""The whole service over HTTP: uvicorn worker(s) on 127.0.0.1, Redis Streams, SQLite, the fake LLM.

Scenarios (each prints one JSON object):

* ``http``: sequential runs of the benchmark job through the API (create a conversation, POST a
  run, read its SSE stream to ``done``); wall time per run, bytes on the wire per answer token, the
  time from POST .../runs to the first ``step`` event, and a check that every event was persisted;
* ``latency``: C concurrent streaming runs on one worker, the fake LLM stamping each answer token
  with its send time; delivery latency per token, for each C;
* ``throughput``: two workers sharing Redis and the database; runs start on one worker and are
  streamed from the other; answer tokens delivered per second, every token checked;
* ``idle``: one worker holding R quiet runs (their LLM call held) and N SSE connections open on
  them, pings flowing; the worker's RSS before, with the runs, and with the connections.

Every load loop is bounded in count and time. Redis keys use a unique prefix and are deleted at
the end; the SQLite database lives in a temporary directory. Run from the repository root:
``.venv/bin/python -m bench.service_bench http --runs 50``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
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
from bench.measure import QUESTION, emit, expected_answer, percentile
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
    ) -> None:
        self.db = db
        # The tree whose ``app`` package the workers import (default: this one, through the
        # venv's editable install). bench/durable_bench.py points it at a worktree of an earlier
        # commit, so that this very script measures both apps.
        self.app_path = os.path.abspath(app_path) if app_path else None
        self.app_file = ""
        """``app.__file__`` as the workers import it (checked with their environment and cwd)."""
        # (py-spy, output): worker 0 runs under `py-spy record` for its whole life (attaching to a
        # running process is refused on some machines), stopped with SIGINT at the end.
        # Absolute: the worker runs in the temporary directory.
        self.profile = (profile[0], os.path.abspath(profile[1])) if profile else None
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
            "REDIS_URL": REDIS_URL,
            "REDIS_KEY_PREFIX": self.prefix,
            "DATABASE_URL": database_url,
            "LOG_LEVEL": "WARNING",
            "SHUTDOWN_GRACE_S": "3",
            "TOOL_RATE_LIMIT_PER_MINUTE": "1000000",
            **self.env_extra,
        }
        if self.app_path:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.app_path, env.get("PYTHONPATH")]))
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
            spy: list[str] = []
            if self.profile and i == 0:
                py_spy, out = self.profile
                spy = [py_spy, "record", "-r", "100", "-f", "raw", "-o", out, "--gil", "--nonblocking", "--"]
            proc = subprocess.Popen(  # noqa: ASYNC220
                [
                    *spy,
                    PY,
                    "-m",
                    "uvicorn",
                    "app.main:create_app",
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
            self.pids.append(_only_child(proc.pid) if spy else proc.pid)

    async def _wait_healthy(self, port: int, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 60
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
        raise RuntimeError("worker did not become ready in 60 s")

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
        redis = Redis.from_url(REDIS_URL)
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


# ---- scenarios ------------------------------------------------------------------------------


async def scenario_http(args: argparse.Namespace) -> dict[str, Any]:
    fake = ["--k", str(args.k), "--tokens", str(args.tokens), "--tool", "calculator"]
    expected = expected_answer(args.tokens)
    walls: list[float] = []
    ttft: list[float] = []
    stream_bytes: list[int] = []
    request_bytes: list[int] = []
    persisted_ok = 0
    worker_cpu_s = 0.0
    async with Stack(fake, db=args.db, app_path=args.app_path) as stack:
        port, pid = stack.workers[0][1], stack.pids[0]
        conn = Connection(HOST, port)
        deadline = time.monotonic() + args.max_seconds
        for i in range(args.warmup + args.runs):
            cpu_before = cpu_seconds(pid)
            before_in, before_out = conn.bytes_in, conn.bytes_out
            t0 = time.perf_counter()
            conv_id = await new_conversation(conn)
            t_post = time.perf_counter()
            run = await start_run(conn, conv_id)
            result = await read_stream(port, conv_id)
            t_done = time.perf_counter()
            assert result.done is not None and result.first_step_at is not None
            if result.answer != expected or result.done["answer"] != expected:
                raise RuntimeError(f"run {run['run_id']}: answer differs from the fake LLM's")
            if result.done.get("status") != "completed":
                raise RuntimeError(f"run {run['run_id']} ended {result.done.get('status')}")
            # Persisted: the durable log holds exactly the streamed events (polled: the store is async).
            for _ in range(100):
                status, stored = await conn.request("GET", f"/api/runs/{run['run_id']}/events")
                if status == 200 and [e["event"] for e in stored] == result.events:
                    persisted_ok += 1
                    break
                await asyncio.sleep(0.02)
            if i < args.warmup:
                continue
            # The worker's CPU (all its threads: the SQLite driver's too) over the whole run: the
            # requests, the run, its stream, storing it, and the persistence check above.
            worker_cpu_s += cpu_seconds(pid) - cpu_before
            walls.append(t_done - t0)
            ttft.append(result.first_step_at - t_post)
            stream_bytes.append(result.bytes_in)
            request_bytes.append(conn.bytes_in - before_in + conn.bytes_out - before_out)
            if time.monotonic() > deadline:
                break
        await conn.close()
    n = len(walls)
    return {
        "scenario": "http",
        "runs": n,
        "k": args.k,
        "tokens": args.tokens,
        "wall_ms_mean": 1000 * statistics.fmean(walls),
        "wall_ms_p50": 1000 * statistics.median(walls),
        "wall_ms_p99": 1000 * percentile(walls, 0.99),
        "ttft_ms_p50": 1000 * statistics.median(ttft),
        "ttft_ms_p99": 1000 * percentile(ttft, 0.99),
        "stream_bytes_per_token": statistics.fmean(stream_bytes) / args.tokens,
        "all_bytes_per_token": (statistics.fmean(stream_bytes) + statistics.fmean(request_bytes))
        / args.tokens,
        "persisted_ok": persisted_ok,
        "persisted_checked": args.warmup + n,
        "database": stack.database,
        "worker_cpu_ms_per_run": 1000 * worker_cpu_s / n,
        "app_file": stack.app_file,
    }


async def _latency_level(
    port: int,
    concurrency: int,
    runs_each: int,
    tokens: int,
    deadline: float,
    follow_ups: bool = False,
    steady_s: float = 0.0,
) -> dict[str, Any]:
    """One concurrency level. ``steady_s`` > 0: users arrive spread over that long (about one run)
    and each does an untimed run before and after its timed ones, so the timed runs stream while
    the other users' runs come and go at the rate a steady load of ``concurrency`` runs has; 0:
    all users arrive within the first second (a start storm) and every run is timed."""
    latencies: list[int] = []
    engine_side: list[int] = []
    transport_side: list[int] = []
    lost = 0
    replayed = 0
    runs = 0

    async def untimed(conn: Connection, conv_id: str) -> str:
        conv_id = conv_id if follow_ups and conv_id else await new_conversation(conn)
        await start_run(conn, conv_id)
        await read_stream(port, conv_id)
        return conv_id

    async def user(n: int) -> None:
        nonlocal lost, runs, replayed
        await asyncio.sleep(n * (steady_s or 1.0) / concurrency)
        conn = Connection(HOST, port)
        try:
            conv_id = ""
            if follow_ups or steady_s:
                # An untimed first run: with follow-ups, the timed ones go to a conversation whose
                # stream already exists on the bus; when steady, it is the ramp up.
                conv_id = await untimed(conn, conv_id)
            for _ in range(runs_each):
                if time.monotonic() > deadline:
                    return
                if not follow_ups:
                    conv_id = await new_conversation(conn)
                await start_run(conn, conv_id)
                result = await read_stream(port, conv_id, timed=True)
                latencies.extend(result.stamps)
                engine_side.extend(result.engine_side)
                transport_side.extend(result.transport_side)
                replayed += result.before_connect
                lost += tokens - len(result.stamps) - result.before_connect
                runs += 1
            if steady_s:
                await untimed(conn, conv_id)  # keeps the load up while the others finish theirs
        finally:
            await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(user(n) for n in range(concurrency)))
    elapsed = time.perf_counter() - t0
    ms = [x / 1000 for x in latencies]
    return {
        "concurrency": concurrency,
        "runs": runs,
        "tokens": len(ms),
        "tokens_missing": lost,
        "tokens_sent_before_client_connected": replayed,
        "tokens_per_s": len(ms) / elapsed,
        "p50_ms": percentile(ms, 0.5),
        "p90_ms": percentile(ms, 0.9),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms) if ms else float("nan"),
        "llm_to_publish_p50_ms": percentile([x / 1000 for x in engine_side], 0.5),
        "llm_to_publish_p99_ms": percentile([x / 1000 for x in engine_side], 0.99),
        "publish_to_client_p50_ms": percentile([x / 1000 for x in transport_side], 0.5),
        "publish_to_client_p99_ms": percentile([x / 1000 for x in transport_side], 0.99),
    }


async def scenario_latency(args: argparse.Namespace) -> dict[str, Any]:
    fake = [
        "--k",
        "1",
        "--tokens",
        str(args.tokens),
        "--tool",
        "calculator",
        "--timed",
        "--delay-s",
        str(args.delay_s),
    ]
    levels = []
    profile = (args.py_spy, args.profile) if args.profile and args.have_py_spy else None
    probe_dir = tempfile.TemporaryDirectory(prefix="agentstream-probe-")
    probe = Path(probe_dir.name) / "probe.txt"
    env = probe_env(probe) if args.probe else None
    async with Stack(fake, db=args.db, profile=profile, env=env) as stack:
        database = stack.database
        pid, port = stack.pids[0], stack.workers[0][1]
        for concurrency in args.concurrency:
            cpu0, t0, client0 = cpu_seconds(pid), time.perf_counter(), time.process_time()
            machine0, wall0 = machine_cpu(), time.time()
            deadline = time.monotonic() + args.max_seconds
            level = await _latency_level(
                port,
                concurrency,
                args.runs_each,
                args.tokens,
                deadline,
                args.follow_ups,
                args.tokens * args.delay_s if args.steady else 0.0,
            )
            level["worker_cpu_pct"] = 100 * (cpu_seconds(pid) - cpu0) / (time.perf_counter() - t0)
            level["client_cpu_pct"] = 100 * (time.process_time() - client0) / (time.perf_counter() - t0)
            level["worker_rss_mb"] = rss_mb(pid)
            level.update(machine_share(machine0, machine_cpu()))
            if args.probe:
                level["probe"] = probe_summary(probe, wall0, time.time())
            levels.append(level)
            print(
                f"  latency c={concurrency}: p50 {level['p50_ms']:.2f} ms p99 {level['p99_ms']:.2f} ms; "
                f"LLM->publish p50 {level['llm_to_publish_p50_ms']:.1f} "
                f"p99 {level['llm_to_publish_p99_ms']:.1f}; "
                f"publish->client p50 {level['publish_to_client_p50_ms']:.1f} "
                f"p99 {level['publish_to_client_p99_ms']:.1f}; worker CPU {level['worker_cpu_pct']:.0f}% "
                f"client CPU {level['client_cpu_pct']:.0f}%; machine busy {level['machine_busy_pct']:.0f}% "
                f"stolen {level['machine_steal_pct']:.0f}%",
                file=sys.stderr,
            )
            if args.probe:
                found = level["probe"]
                lag = found["loop_lag_ms"]
                print(
                    f"    loop lag p50 {lag['p50']:.1f} p90 {lag['p90']:.1f} max {lag['max']:.1f} ms; "
                    + "; ".join(
                        f"gc{g}: {found[f'gc{g}']['passes']} passes, {found[f'gc{g}']['passes_over_3ms']} "
                        f"over 3 ms, max {found[f'gc{g}']['ms_max']:.1f} ms, "
                        f"objects p50 {found[f'gc{g}']['objects_p50']} max {found[f'gc{g}']['objects_max']}"
                        for g in (0, 1, 2)
                    ),
                    file=sys.stderr,
                )
    probe_dir.cleanup()
    return {
        "scenario": "latency",
        "tokens_per_run": args.tokens,
        "token_interval_ms": 1000 * args.delay_s,
        "mode": "follow-up runs in existing conversations"
        if args.follow_ups
        else "first run of new conversations",
        "arrival": "steady: users arrive over one run's length, an untimed run before and after"
        if args.steady
        else "storm: every user arrives within the first second",
        "database": database,
        "levels": levels,
        "clock": "fake LLM stamps time.time() right before writing each token; the client reads the "
        "same clock when the bytes arrive",
    }


async def scenario_throughput(args: argparse.Namespace) -> dict[str, Any]:
    fake = ["--k", "0", "--tokens", str(args.tokens), "--tool", "calculator"]
    expected = expected_answer(args.tokens)
    delivered = 0
    runs = 0
    bad: list[str] = []
    profile = (args.py_spy, args.profile) if args.profile and args.have_py_spy else None
    async with Stack(fake, workers=2, db=args.db, profile=profile) as stack:
        database = stack.database
        ports = [port for _, port in stack.workers]
        pids = stack.pids
        deadline = time.monotonic() + args.seconds

        async def user(n: int) -> None:
            nonlocal delivered, runs
            start_port, stream_port = ports[n % 2], ports[(n + 1) % 2]
            conn = Connection(HOST, start_port)
            try:
                while time.monotonic() < deadline and runs < args.max_runs:
                    conv_id = await new_conversation(conn)
                    await start_run(conn, conv_id)
                    # Started on one worker, streamed from the other: the tokens cross Redis.
                    result = await read_stream(stream_port, conv_id)
                    if result.answer != expected or (result.done or {}).get("answer") != expected:
                        bad.append(conv_id)
                    else:
                        delivered += args.tokens
                    runs += 1
            finally:
                await conn.close()

        cpu0 = [cpu_seconds(p) for p in pids]
        t0 = time.perf_counter()
        await asyncio.gather(*(user(n) for n in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
        cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
    return {
        "scenario": "throughput",
        "workers": 2,
        "database": database,
        "concurrency": args.concurrency,
        "tokens_per_run": args.tokens,
        "runs": runs,
        "runs_wrong": len(bad),
        "tokens_delivered": delivered,
        "seconds": elapsed,
        "tokens_per_s": delivered / elapsed,
        "worker_cpu_pct": [100 * c / elapsed for c in cpu],
        "worker_cpu_us_per_token": 1e6 * sum(cpu) / max(1, delivered),
    }


async def scenario_idle(args: argparse.Namespace) -> dict[str, Any]:
    hold = args.seconds + 60  # released by SIGUSR1 well before; the timer is the backstop
    fake = ["--k", "1", "--tokens", "20", "--tool", "calculator", "--hold-s", str(hold)]
    env = {"SSE_PING_SECONDS": str(args.ping_s)}
    async with Stack(fake, env=env, db=args.db) as stack:
        database = stack.database
        pid, port = stack.pids[0], stack.workers[0][1]
        conn = Connection(HOST, port)
        # Warm the worker (imports, pools) with conversations, so the baseline is a working worker.
        warm = [await new_conversation(conn) for _ in range(5)]
        rss_idle = rss_mb(pid)
        convs = [await new_conversation(conn) for _ in range(args.runs)]
        for conv_id in convs:
            await start_run(conn, conv_id)
        await asyncio.sleep(1.0)
        rss_runs = rss_mb(pid)

        streams = [
            SseStream(HOST, port, f"/api/conversations/{convs[i % len(convs)]}/stream")
            for i in range(args.connections)
        ]
        finished = 0
        done_events = 0

        async def follow(stream: SseStream) -> None:
            nonlocal finished, done_events
            async for _, event, _ in stream.events():
                if event == "done":
                    done_events += 1
            finished += 1

        tasks = []
        for i in range(0, len(streams), 100):
            tasks += [asyncio.create_task(follow(s)) for s in streams[i : i + 100]]
            await asyncio.sleep(0.05)
        t_open = time.monotonic()
        # Every stream answered (headers in), bounded; then long enough for two pings each.
        # A bounded poll of many streams' state.
        while sum(1 for s in streams if s.status) < len(streams) and time.monotonic() - t_open < 90:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        open_s = time.monotonic() - t_open
        for s in streams:
            s.pings = 0
        await asyncio.sleep(max(args.seconds, 2 * args.ping_s + 0.5))
        open_now = sum(1 for s in streams if s.status == 200) - finished
        pinged = sum(1 for s in streams if s.pings > 0)
        rss_conns = rss_mb(pid)
        cpu0 = cpu_seconds(pid)
        await asyncio.sleep(2.0)
        idle_cpu_pct = 100 * (cpu_seconds(pid) - cpu0) / 2.0
        held_s = time.monotonic() - t_open
        assert stack.fake is not None
        stack.fake.send_signal(signal.SIGUSR1)  # release the held LLM calls: every run finishes
        try:
            async with asyncio.timeout(120):
                await asyncio.gather(*tasks)
        except TimeoutError:
            for s in streams:
                s.abort()
        await conn.close()
        del warm
    return {
        "scenario": "idle",
        "connections": args.connections,
        "database": database,
        "active_runs": args.runs,
        "ping_s": args.ping_s,
        "held_s": held_s,
        "seconds_to_open_all": open_s,
        "open_while_idle": open_now,
        "connections_pinged": pinged,
        "done_received": done_events,
        "rss_idle_mb": rss_idle,
        "rss_with_runs_mb": rss_runs,
        "rss_with_connections_mb": rss_conns,
        "rss_per_active_run_kb": 1024 * (rss_runs - rss_idle) / args.runs,
        "rss_per_connection_kb": 1024 * (rss_conns - rss_runs) / args.connections,
        "worker_cpu_pct_while_idle": idle_cpu_pct,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="scenario", required=True)
    h = sub.add_parser("http")
    h.add_argument("--runs", type=int, default=100)
    h.add_argument("--warmup", type=int, default=10)
    h.add_argument("--k", type=int, default=5)
    h.add_argument("--tokens", type=int, default=200)
    h.add_argument("--max-seconds", type=float, default=120)
    h.add_argument(
        "--app-path",
        default="",
        help="import the workers' app package from this tree (a worktree of another commit)",
    )
    lat = sub.add_parser("latency")
    lat.add_argument("--concurrency", type=int, nargs="+", default=[1, 10, 50, 100, 200])
    lat.add_argument("--runs-each", type=int, default=2)
    lat.add_argument("--tokens", type=int, default=100)
    lat.add_argument("--delay-s", type=float, default=0.05)
    lat.add_argument("--max-seconds", type=float, default=60, help="per concurrency level")
    lat.add_argument("--profile", default="", help="write a py-spy profile of the worker here")
    lat.add_argument(
        "--follow-ups", action="store_true", help="time follow-up runs in conversations that had one run"
    )
    lat.add_argument(
        "--steady",
        action="store_true",
        help="users arrive over one run's length, with an untimed run before and after the timed ones",
    )
    lat.add_argument(
        "--probe",
        action="store_true",
        help="probe the worker's event-loop lag and collection passes (bench/probe); adds their cost",
    )
    lat.add_argument("--py-spy", default=str(ROOT / "bench/.venv-peers/bin/py-spy"))
    t = sub.add_parser("throughput")
    t.add_argument("--concurrency", type=int, default=16)
    t.add_argument("--tokens", type=int, default=2000)
    t.add_argument("--seconds", type=float, default=20)
    t.add_argument("--max-runs", type=int, default=5000)
    t.add_argument("--profile", default="", help="write a py-spy profile of worker 0 here")
    t.add_argument("--py-spy", default=str(ROOT / "bench/.venv-peers/bin/py-spy"))
    i = sub.add_parser("idle")
    i.add_argument("--connections", type=int, default=2000)
    i.add_argument("--runs", type=int, default=100)
    i.add_argument("--seconds", type=float, default=8)
    i.add_argument("--ping-s", type=float, default=2)
    for p in (h, lat, t, i):
        p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    args = parser.parse_args(argv)
    args.have_py_spy = os.path.exists(getattr(args, "py_spy", ""))
    scenario = {
        "http": scenario_http,
        "latency": scenario_latency,
        "throughput": scenario_throughput,
        "idle": scenario_idle,
    }[args.scenario]
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401  - the client loop matters little; stock asyncio keeps it comparable
    emit(asyncio.run(scenario(args)))


if __name__ == "__main__":
    main(sys.argv[1:])
