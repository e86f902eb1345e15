"""A bounded load test of the whole service: N concurrent conversations over two uvicorn workers.

It starts everything it needs on 127.0.0.1 and stops it when done: the fake OpenAI server (a tool
call, then an answer streamed token by token with a small delay, so that runs overlap), a database
(a shared SQLite file in a temporary directory, or a PostgreSQL database made for the run and
dropped after), a Redis key prefix of its own (deleted after), and two uvicorn workers sharing both.

Each conversation does several runs. Every run is started on one worker and streamed alternately
from both; mid-run a follow-up is posted (an interrupt) and the stream is dropped and resumed with
``Last-Event-ID`` on the other worker, more than once. When the run's ``done`` arrives, the events
the client received across its connections must equal ``GET /api/runs/{id}/events`` (read from the
database): nothing lost, nothing repeated, nothing changed.

The load is bounded in count (``--conversations`` x ``--runs``) and time (``--max-seconds``: past
it, what is running is cancelled and reported as an error). It prints figures (requests, runs,
events, errors, p50/p99 latencies) and exits 0 only with zero errors and zero lost or duplicated
events. From the repository root::

    .venv/bin/python scripts/load.py --conversations 200 --runs 3
    .venv/bin/python scripts/load.py --conversations 5 --runs 2 --json   # a summary object as well
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
AGENT = {"tools": ["calculator"], "completion_check": False}
QUESTION = "What is 6*7? Use the calculator."
FOLLOW_UP = "Also say it in words."
REQUEST_KINDS = {"create conversation", "start run", "interrupt", "stream (headers)", "run events"}


# ---- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    conversations: int = 200
    runs: int = 3
    reconnects: int = 2
    tokens: int = 30
    token_delay_s: float = 0.02
    database: str = "sqlite"
    redis_url: str = "redis://127.0.0.1:6379/0"
    postgres_url: str = "postgresql://postgres@127.0.0.1:5432"
    max_seconds: float = 600.0
    ramp_seconds: float = 2.0
    seed: int = 1


def parse_args(argv: Sequence[str] | None) -> tuple[LoadConfig, bool]:
    d = LoadConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--conversations", type=int, default=d.conversations, help="concurrent conversations")
    p.add_argument("--runs", type=int, default=d.runs, help="runs per conversation, one after another")
    p.add_argument("--reconnects", type=int, default=d.reconnects, help="stream drops per run")
    p.add_argument("--tokens", type=int, default=d.tokens, help="answer tokens the fake model streams")
    p.add_argument("--token-delay", type=float, default=d.token_delay_s, help="seconds between tokens")
    p.add_argument("--database", choices=["sqlite", "postgres"], default=d.database)
    p.add_argument("--redis-url", default=os.environ.get("AGENTSTREAM_TEST_REDIS", d.redis_url))
    p.add_argument("--postgres-url", default=os.environ.get("AGENTSTREAM_TEST_POSTGRES", d.postgres_url))
    p.add_argument("--max-seconds", type=float, default=d.max_seconds, help="stop the load after this")
    p.add_argument("--ramp-seconds", type=float, default=d.ramp_seconds, help="spread conversation starts")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    a = p.parse_args(argv)
    for url in (a.redis_url, a.postgres_url):
        if "127.0.0.1" not in url and "localhost" not in url:
            p.error(f"loopback only: {url}")
    if a.conversations < 1 or a.runs < 1 or a.reconnects < 0 or a.max_seconds <= 0:
        p.error("--conversations and --runs must be >= 1, --reconnects >= 0, --max-seconds > 0")
    config = LoadConfig(
        conversations=a.conversations,
        runs=a.runs,
        reconnects=a.reconnects,
        tokens=a.tokens,
        token_delay_s=a.token_delay,
        database=a.database,
        redis_url=a.redis_url,
        postgres_url=a.postgres_url.rstrip("/"),
        max_seconds=a.max_seconds,
        ramp_seconds=a.ramp_seconds,
        seed=a.seed,
    )
    return config, bool(a.json)


# ---- what is measured and checked ------------------------------------------------------------


@dataclass
class Stats:
    started: float = field(default_factory=time.monotonic)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    requests: int = 0
    runs: int = 0
    events: int = 0
    reconnects: int = 0
    interrupts_queued: int = 0
    interrupts_too_late: int = 0
    lost: int = 0
    duplicated: int = 0
    errors: list[str] = field(default_factory=list)

    def timed(self, kind: str, seconds: float) -> None:
        self.latencies.setdefault(kind, []).append(seconds)

    def error(self, message: str) -> None:
        self.errors.append(message)

    def summary(self, config: LoadConfig) -> dict[str, Any]:
        every = [s for kind, values in self.latencies.items() if kind in REQUEST_KINDS for s in values]
        return {
            "conversations": config.conversations,
            "runs_per_conversation": config.runs,
            "database": config.database,
            "seconds": round(time.monotonic() - self.started, 2),
            "requests": self.requests,
            "runs": self.runs,
            "events": self.events,
            "reconnects": self.reconnects,
            "interrupts": {"queued": self.interrupts_queued, "after_the_run": self.interrupts_too_late},
            "errors": len(self.errors),
            "lost": self.lost,
            "duplicated": self.duplicated,
            "latency_ms": {
                kind: {"p50": _ms(percentile(v, 0.5)), "p99": _ms(percentile(v, 0.99)), "n": len(v)}
                for kind, v in sorted({**self.latencies, "all requests": every}.items())
            },
            "first_errors": self.errors[:10],
        }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


Event = tuple[str, str, Any]
"""``(id, event, data)`` with ``data`` decoded, as a client and ``/api/runs/{id}/events`` see it."""


@dataclass(frozen=True)
class Comparison:
    lost: int
    duplicated: int
    problems: list[str]


def compare(received: list[Event], stored: list[Event]) -> Comparison:
    """What the client got across its connections against what the database holds."""
    problems: list[str] = []
    ids = [e[0] for e in received]
    duplicated = len(ids) - len(set(ids))
    stored_ids = {e[0] for e in stored}
    lost = len(stored_ids - set(ids))
    extra = set(ids) - stored_ids
    if duplicated:
        problems.append(f"{duplicated} event(s) received twice")
    if lost:
        problems.append(f"{lost} stored event(s) never received")
    if extra:
        problems.append(f"{len(extra)} received event(s) not stored: {sorted(extra)[:3]}")
    if not problems and received != stored:
        problems.append("events differ from the stored ones (order or content)")
    done = [e for e in received if e[1] == "done"]
    if len(done) != 1 or received[-1][1] != "done":
        problems.append(
            f"{len(done)} done event(s), the last event is {received[-1][1] if received else None}"
        )
    return Comparison(lost=lost, duplicated=duplicated, problems=problems)


# ---- the stack: fake model, database, Redis prefix, two workers ------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Stack:
    """The processes and stores of one load run; everything is removed on exit, processes by pid."""

    def __init__(self, config: LoadConfig) -> None:
        self.config = config
        self.tmp = tempfile.TemporaryDirectory(prefix="agentstream-load-")
        self.prefix = f"agentstream-load:{secrets.token_hex(6)}"
        self.api_key = f"load-{secrets.token_hex(8)}"
        self.pg_database = ""
        self.processes: list[subprocess.Popen[bytes]] = []
        self.base_urls: list[str] = []

    async def __aenter__(self) -> Stack:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _start(self) -> None:
        tmp = Path(self.tmp.name)
        fake = self._spawn(
            [
                "-m",
                "tests.support.fake_openai",
                "--port",
                "0",
                "--mode",
                "tool",
                "--tokens",
                str(self.config.tokens),
                "--delay-s",
                str(self.config.token_delay_s),
            ],
            tmp / "fake-llm.log",
            stdout=subprocess.PIPE,
        )
        assert fake.stdout is not None
        llm_url = (await asyncio.wait_for(asyncio.to_thread(fake.stdout.readline), 30)).decode().strip()
        if not llm_url.startswith(f"http://{HOST}:"):
            raise RuntimeError(f"the fake LLM did not start: {llm_url!r}")
        database_url = await self._database()
        env = {
            "DATABASE_URL": database_url,
            "REDIS_URL": self.config.redis_url,
            "REDIS_KEY_PREFIX": self.prefix,
            "API_KEYS": f"load:{self.api_key}",
            "LLM_BASE_URL": llm_url,
            "LLM_API_KEY": "load-test",
            "LLM_MODEL": "fake-model",
            "LOG_LEVEL": "WARNING",
            "SHUTDOWN_GRACE_S": "5",
            "TOOL_RATE_LIMIT_PER_MINUTE": "1000000",
        }
        migrate = self._spawn(["-m", "app.cli", "migrate"], tmp / "migrate.log", env=env)
        if await asyncio.to_thread(migrate.wait, 120) != 0:
            raise RuntimeError(f"migration failed: {(tmp / 'migrate.log').read_text(errors='replace')}")
        for i in range(2):
            port = free_port()
            self._spawn(
                [
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
                    "--backlog",
                    "4096",
                    "--timeout-keep-alive",
                    "120",
                ],
                tmp / f"worker-{i}.log",
                env=env,
            )
            self.base_urls.append(f"http://{HOST}:{port}")
        await asyncio.gather(*(self._ready(url) for url in self.base_urls))

    def _spawn(
        self, args: list[str], log: Path, *, env: dict[str, str] | None = None, stdout: int | None = None
    ) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                env={**os.environ, **(env or {})},
                stdout=stdout if stdout is not None else out,
                stderr=out,
            )
        self.processes.append(proc)
        return proc

    async def _database(self) -> str:
        if self.config.database == "sqlite":
            return f"sqlite+aiosqlite:///{Path(self.tmp.name) / 'agentstream.db'}"
        import asyncpg

        self.pg_database = f"agentstream_load_{secrets.token_hex(5)}"
        conn = await asyncpg.connect(f"{self.config.postgres_url}/postgres", timeout=5)
        try:
            await conn.execute(f'CREATE DATABASE "{self.pg_database}"')
        finally:
            await conn.close()
        return (
            f"{self.config.postgres_url.replace('postgresql://', 'postgresql+asyncpg://')}/{self.pg_database}"
        )

    async def _ready(self, base_url: str) -> None:
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(base_url=base_url, trust_env=False) as client:
            while time.monotonic() < deadline:
                if any(p.poll() is not None for p in self.processes[-2:]):
                    break
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/readyz", timeout=2)).status_code == 200:
                        return
                await asyncio.sleep(0.1)
        logs = await asyncio.to_thread(self.logs)
        raise RuntimeError(f"worker {base_url} did not become ready:\n{logs}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(Path(self.tmp.name).glob("*.log"))
        )

    async def __aexit__(self, *exc: object) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait, 10)
            if proc.stdout is not None:
                proc.stdout.close()
        with contextlib.suppress(Exception):
            await self._delete_redis_keys()
        if self.pg_database:
            with contextlib.suppress(Exception):
                await self._drop_database()
        self.tmp.cleanup()

    async def _delete_redis_keys(self) -> None:
        from redis.asyncio import Redis

        redis = Redis.from_url(self.config.redis_url)
        try:
            keys = [k async for k in redis.scan_iter(match=f"{self.prefix}:*", count=1000)]
            for i in range(0, len(keys), 500):
                await redis.delete(*keys[i : i + 500])
        finally:
            await redis.aclose()

    async def _drop_database(self) -> None:
        import asyncpg

        conn = await asyncpg.connect(f"{self.config.postgres_url}/postgres", timeout=5)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{self.pg_database}" WITH (FORCE)')
        finally:
            await conn.close()


# ---- the clients -----------------------------------------------------------------------------


class UnexpectedResponse(Exception):
    def __init__(self, what: str, response: httpx.Response) -> None:
        super().__init__(f"{what}: HTTP {response.status_code} {response.text[:200]}")


async def sse_events(response: httpx.Response) -> AsyncIterator[Event]:
    """Events of an open stream; comment lines (pings) are skipped. Lines end at LF (or CRLF)."""
    buffer = b""
    fields: dict[str, str] = {}
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.removesuffix(b"\r").decode()
            if not line:
                if "data" in fields:
                    yield fields.get("id", ""), fields.get("event", "message"), json.loads(fields["data"])
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                if name in fields:
                    raise ValueError(f"the field {name!r} came twice in one event: SSE framing broke")
                fields[name] = value.removeprefix(" ")


class LoadClient:
    """One HTTP client per worker; requests are timed and counted."""

    def __init__(self, base_urls: list[str], api_key: str, connections: int, stats: Stats) -> None:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        timeout = httpx.Timeout(60.0, connect=10.0, pool=120.0)
        headers = {"Authorization": f"Bearer {api_key}"}
        self.workers = [
            httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout, trust_env=False)
            for url in base_urls
        ]
        self.stats = stats

    async def aclose(self) -> None:
        for client in self.workers:
            await client.aclose()

    async def call(self, worker: int, kind: str, method: str, path: str, **kw: Any) -> httpx.Response:
        started = time.monotonic()
        self.stats.requests += 1
        response = await self.workers[worker % 2].request(method, path, **kw)
        self.stats.timed(kind, time.monotonic() - started)
        return response

    @contextlib.asynccontextmanager
    async def stream(self, worker: int, path: str, headers: dict[str, str]) -> AsyncIterator[httpx.Response]:
        started = time.monotonic()
        self.stats.requests += 1
        async with self.workers[worker % 2].stream("GET", path, headers=headers) as response:
            self.stats.timed("stream (headers)", time.monotonic() - started)
            yield response


async def one_run(client: LoadClient, conv: str, rng: random.Random, turn: int, config: LoadConfig) -> None:
    stats = client.stats
    started_at = time.monotonic()
    response = await client.call(
        turn, "start run", "POST", f"/api/conversations/{conv}/runs", json={"message": QUESTION}
    )
    if response.status_code != 202:
        raise UnexpectedResponse("start run", response)
    run_id = response.json()["run_id"]
    received: list[Event] = []
    drops = sorted(rng.sample(range(2, 12), k=min(config.reconnects, 10)))
    interrupt_after = rng.randint(1, 4)
    connection = turn + 1
    cursor: str | None = None
    while not received or received[-1][1] != "done":
        headers = {"Last-Event-ID": cursor} if cursor else {}
        if cursor:
            stats.reconnects += 1
        async with client.stream(connection, f"/api/conversations/{conv}/stream", headers) as stream:
            if stream.status_code != 200:
                await stream.aread()
                raise UnexpectedResponse(f"stream after {cursor}", stream)
            async for event in sse_events(stream):
                if not received:
                    stats.timed("first event after start", time.monotonic() - started_at)
                received.append(event)
                cursor = event[0]
                if len(received) == interrupt_after:
                    await interrupt(client, connection + 1, conv)
                if event[1] == "done" or (drops and len(received) >= drops[0]):
                    break
        if drops and len(received) >= drops[0]:
            drops.pop(0)  # dropped mid-run: resume on the other worker
        connection += 1
    stats.timed("run", time.monotonic() - started_at)
    stats.runs += 1
    stats.events += len(received)
    response = await client.call(rng.randint(0, 1), "run events", "GET", f"/api/runs/{run_id}/events")
    if response.status_code != 200:
        raise UnexpectedResponse("run events", response)
    stored = [(e["id"], e["event"], e["data"]) for e in response.json()]
    outcome = compare(received, stored)
    stats.lost += outcome.lost
    stats.duplicated += outcome.duplicated
    for problem in outcome.problems:
        stats.error(f"run {run_id}: {problem}")
    if received[-1][2].get("status") != "completed":
        stats.error(f"run {run_id} ended {received[-1][2].get('status')}: {received[-1][2].get('error')}")


async def interrupt(client: LoadClient, worker: int, conv: str) -> None:
    response = await client.call(
        worker, "interrupt", "POST", f"/api/conversations/{conv}/interrupt", json={"content": FOLLOW_UP}
    )
    if response.status_code == 202:
        client.stats.interrupts_queued += 1
    elif response.status_code == 409 and response.json()["error"]["code"] == "no_active_run":
        client.stats.interrupts_too_late += 1  # the run ended between two events: nothing to feed
    else:
        raise UnexpectedResponse("interrupt", response)


async def one_conversation(client: LoadClient, index: int, config: LoadConfig) -> None:
    rng = random.Random(config.seed * 1_000_003 + index)
    await asyncio.sleep(rng.uniform(0, config.ramp_seconds))
    try:
        response = await client.call(
            index, "create conversation", "POST", "/api/conversations", json={"agent": AGENT}
        )
        if response.status_code != 201:
            raise UnexpectedResponse("create conversation", response)
        conv = response.json()["id"]
        for turn in range(config.runs):
            await one_run(client, conv, rng, index + turn, config)
    except (httpx.HTTPError, UnexpectedResponse, ValueError, KeyError) as exc:
        client.stats.error(f"conversation {index}: {type(exc).__name__}: {exc}")


async def load(config: LoadConfig) -> tuple[dict[str, Any], str]:
    stats = Stats()
    async with Stack(config) as stack:
        stats.started = time.monotonic()
        client = LoadClient(stack.base_urls, stack.api_key, config.conversations * 2 + 8, stats)
        try:
            tasks = [
                asyncio.create_task(one_conversation(client, i, config)) for i in range(config.conversations)
            ]
            done, pending = await asyncio.wait(tasks, timeout=config.max_seconds)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=10)
                stats.error(
                    f"time limit: {len(pending)} conversation(s) still running after {config.max_seconds}s"
                )
            for task in done:
                if task.exception() is not None:
                    stats.error(f"conversation crashed: {task.exception()!r}")
        finally:
            await client.aclose()
        summary = stats.summary(config)
        logs = stack.logs() if stats.errors else ""
    return summary, logs


def report(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['conversations']} conversations x {summary['runs_per_conversation']} runs over 2 workers "
        f"({summary['database']} + Redis) in {summary['seconds']} s",
        f"requests {summary['requests']}  runs {summary['runs']}  events {summary['events']}  "
        f"reconnects {summary['reconnects']}  interrupts {summary['interrupts']['queued']} queued "
        f"(+{summary['interrupts']['after_the_run']} after their run)",
        f"errors {summary['errors']}  lost {summary['lost']}  duplicated {summary['duplicated']}",
        "latency (ms)            p50       p99        n",
    ]
    for kind, figures in summary["latency_ms"].items():
        lines.append(f"  {kind:<22}{figures['p50']:>8}  {figures['p99']:>8}  {figures['n']:>7}")
    lines.extend(f"  ! {message}" for message in summary["first_errors"])
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    config, as_json = parse_args(argv)
    summary, logs = asyncio.run(load(config))
    print(report(summary), flush=True)
    if logs:
        print(logs, file=sys.stderr)
    if as_json:
        print(json.dumps(summary), flush=True)
    clean = summary["errors"] == 0 and summary["lost"] == 0 and summary["duplicated"] == 0
    return 0 if clean and summary["runs"] == config.conversations * config.runs else 1


if __name__ == "__main__":
    sys.exit(main())
