"""Runs that wait for a person (RUNS.md A-02..A-06): how soon a decision carries a run on, and what
a waiting run costs a worker.

``decision``: two uvicorn workers on PostgreSQL and Redis; the fake LLM asks for a ``calculator``
call, which needs approval (``REQUIRE_APPROVAL=calculator``). A client starts each run through
worker A, follows its stream through worker B until the ``approval {status: "requested"}`` event,
then posts the decision through worker B and times how long until the run's next event (its
``approval {status: "approved"}``, published by whichever worker's claim loop carried it on)
arrives on that stream. p50/p99 over ``--rounds`` runs.

``waiting``: one worker; ``--runs`` runs (10,000 by default) started, each left waiting for its
approval. The worker's RSS and CPU are read before (after a warm-up) and after, its CPU over an idle
window of ``--idle-s`` seconds with nothing waiting and again with every run waiting, and the time
to list the pending approvals (``GET /api/approvals``) is timed. A waiting run must cost a worker
nothing: no task, lease or memory.

Loopback only; bounded in count and time (``--max-seconds``); the processes and the scratch
database are removed at the end, also on errors. From the repository root::

    .venv/bin/python -m bench.approvals_bench decision [--rounds 50]
    .venv/bin/python -m bench.approvals_bench waiting [--runs 10000] [--db postgres|sqlite]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from bench.measure import emit, percentile
from bench.service_stack import HOST, Stack, cpu_seconds, rss_mb

FAKE = ["--k", "1", "--tokens", "20", "--tool", "calculator"]
AGENT = {"tools": ["calculator"], "completion_check": False, "require_approval": ["calculator"]}
QUESTION = "What is 6*7? Use the calculator."


def base(port: int) -> str:
    return f"http://{HOST}:{port}"


async def events(client: httpx.AsyncClient, conv: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The conversation's stream as (event, data), from the first event of its active run."""
    async with client.stream("GET", f"/api/conversations/{conv}/stream") as response:
        name = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                yield name, json.loads(line[6:])


async def start(client: httpx.AsyncClient) -> tuple[str, str]:
    conv = (await client.post("/api/conversations", json={"agent": AGENT})).json()["id"]
    response = await client.post(f"/api/conversations/{conv}/runs", json={"message": QUESTION})
    if response.status_code != 202:
        raise RuntimeError(f"start run: {response.status_code} {response.text}")
    return conv, response.json()["run_id"]


async def one_decision(a: httpx.AsyncClient, b: httpx.AsyncClient, timeout_s: float) -> float:
    conv, _ = await start(a)
    stream = events(b, conv)
    async with asyncio.timeout(timeout_s):
        async for name, data in stream:
            if name == "approval" and data["status"] == "requested":
                approval_id = data["approval_id"]
                break
        t0 = time.perf_counter()
        decided = await b.post(
            f"/api/conversations/{conv}/approvals/{approval_id}", json={"decision": "approve"}
        )
        if decided.status_code != 200:
            raise RuntimeError(f"decide: {decided.status_code} {decided.text}")
        async for name, data in stream:
            took = time.perf_counter() - t0
            if name != "approval" or data["status"] != "approved":
                raise RuntimeError(f"expected the approved event first, got {name} {data}")
            break
        async for name, _data in stream:  # the run to its end: the next round starts on a quiet stack
            if name == "done":
                break
    await stream.aclose()
    return took


async def cmd_decision(args: argparse.Namespace) -> dict[str, Any]:
    env = {"RUN_LEASE_S": "30"}
    async with Stack(FAKE, workers=2, db=args.db, env=env) as stack:
        (_, port_a), (_, port_b) = stack.workers
        async with (
            httpx.AsyncClient(base_url=base(port_a), timeout=30) as a,
            httpx.AsyncClient(base_url=base(port_b), timeout=30) as b,
        ):
            for _ in range(args.warmup):
                await one_decision(a, b, 30)
            deadline = time.monotonic() + args.max_seconds
            ms: list[float] = []
            while len(ms) < args.rounds and time.monotonic() < deadline:
                ms.append(1000 * await one_decision(a, b, 30))
    return {
        "scenario": "approvals decision",
        "what": "decision POST through worker B -> the run's next event (approval approved) on B's stream",
        "database": stack.database,
        "rounds": len(ms),
        "p50_ms": percentile(ms, 0.5),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms) if ms else None,
        "mean_ms": statistics.fmean(ms) if ms else None,
    }


async def pending_count(client: httpx.AsyncClient) -> tuple[int, float]:
    t0 = time.perf_counter()
    response = await client.get("/api/approvals", params={"status": "pending"})
    took = time.perf_counter() - t0
    return len(response.json()["items"]), took


async def idle_cpu_ms_per_s(pid: int, seconds: float) -> float:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)  # a measurement window, not a synchronisation
    return 1000 * (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


async def cmd_waiting(args: argparse.Namespace) -> dict[str, Any]:
    async with Stack(FAKE, workers=1, db=args.db, env={"RUN_LEASE_S": "30"}) as stack:
        (_, port), pid = stack.workers[0], stack.pids[0]
        limits = httpx.Limits(max_connections=args.concurrency)
        async with httpx.AsyncClient(base_url=base(port), timeout=60, limits=limits) as client:
            # Warm-up: a few runs through the whole cycle, so that imports and pools are paid for.
            for _ in range(5):
                conv, run_id = await start(client)
                await wait_waiting(client, run_id, 30)
                (item,) = [
                    a for a in (await client.get("/api/approvals")).json()["items"] if a["run_id"] == run_id
                ]
                await client.post(
                    f"/api/conversations/{conv}/approvals/{item['approval_id']}", json={"decision": "deny"}
                )
            await wait_no_pending(client, 30)
            rss_before, cpu_before = rss_mb(pid), cpu_seconds(pid)
            idle_before = await idle_cpu_ms_per_s(pid, args.idle_s)

            deadline = time.monotonic() + args.max_seconds
            started = 0
            t_start = time.perf_counter()

            async def starter() -> None:
                nonlocal started
                while started < args.runs and time.monotonic() < deadline:
                    started += 1
                    await start(client)

            await asyncio.gather(*(starter() for _ in range(args.concurrency)))
            waiting = 0
            while time.monotonic() < deadline:
                waiting, _ = await pending_count(client)
                if waiting >= started:
                    break
                await asyncio.sleep(0.5)  # polling a count, bounded by the deadline
            took_start = time.perf_counter() - t_start
            rss_after = rss_mb(pid)
            cpu_start = cpu_seconds(pid) - cpu_before
            idle_after = await idle_cpu_ms_per_s(pid, args.idle_s)
            list_times = []
            for _ in range(5):
                count, took = await pending_count(client)
                list_times.append(1000 * took)
    return {
        "scenario": "approvals waiting",
        "database": stack.database,
        "runs_started": started,
        "runs_waiting": waiting,
        "seconds_to_start_and_park_all": took_start,
        "worker_cpu_ms_per_run_to_start_and_park": 1000 * cpu_start / max(started, 1),
        "worker_rss_mb_before": rss_before,
        "worker_rss_mb_with_all_waiting": rss_after,
        "worker_rss_kb_per_waiting_run": 1024 * (rss_after - rss_before) / max(waiting, 1),
        "worker_idle_cpu_ms_per_s_nothing_waiting": idle_before,
        "worker_idle_cpu_ms_per_s_all_waiting": idle_after,
        "list_pending_ms_median": statistics.median(list_times),
        "list_pending_ms_max": max(list_times),
        "list_pending_items": count,
    }


async def wait_waiting(client: httpx.AsyncClient, run_id: str, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while (await client.get(f"/api/runs/{run_id}")).json()["status"] != "waiting":  # noqa: ASYNC110
            await asyncio.sleep(0.02)  # polling the service over HTTP: there is no event to wait on


async def wait_no_pending(client: httpx.AsyncClient, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while (await pending_count(client))[0]:  # noqa: ASYNC110 - polling the service over HTTP
            await asyncio.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decision")
    d.add_argument("--rounds", type=int, default=50)
    d.add_argument("--warmup", type=int, default=3)
    d.add_argument("--max-seconds", type=float, default=180)
    d.add_argument("--db", choices=["postgres", "sqlite"], default="postgres")
    w = sub.add_parser("waiting")
    w.add_argument("--runs", type=int, default=10_000)
    w.add_argument("--concurrency", type=int, default=50)
    w.add_argument("--idle-s", type=float, default=10.0)
    w.add_argument("--max-seconds", type=float, default=900)
    w.add_argument("--db", choices=["postgres", "sqlite"], default="postgres")
    args = parser.parse_args(argv)
    command = {"decision": cmd_decision, "waiting": cmd_waiting}[args.command]
    emit(asyncio.run(command(args)))


if __name__ == "__main__":
    main(sys.argv[1:])
