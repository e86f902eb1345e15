"""``capacity_bench burst``: a burst of run starts against two workers with a bounded run queue.

Two uvicorn workers (``MAX_ACTIVE_RUNS`` 200 each by default) on PostgreSQL (a database of the
bench's own, dropped after) and a Redis of its own; the fake LLM streams short timed answers (20
tokens at 50 tokens/s). Beforehand: one conversation per POST, made alternately through each worker,
and one keep-alive connection per POST, opened (and warmed with ``GET /healthz``) to the worker
that made its conversation. The burst: POST i is sent at ``t0 + i * spread / posts`` (so 2,000 in one
second); the send times actually reached are reported. Every answer must be ``202`` with status
``running`` or ``queued``, or ``429`` with error code ``queue_full``.

Then the drain: both workers' ``/readyz`` capacity is polled (every 0.25 s, bounded) until neither
runs nor queues anything. Then every accepted run is read back (``GET /api/runs/{id}/events``): its
last event must be ``done`` with status ``completed``, its deltas must add up to ``done.answer``, and
that must be the fake's answer. Time in the queue: from the client's receipt of the ``202`` to the
run's first event that is not its ``queued`` phase, read off that event's id (``<ms>-<seq>``: the
publisher's clock, the same machine's); the drain's wall time runs from the first POST to the last
run's ``done`` (its id's time). The workers' CPU covers the burst and the drain; on PostgreSQL,
what the database's sessions were doing (``pg_stat_activity``, sampled every 0.2 s) too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from bench.capacity_client import fake_answer_ok
from bench.capacity_procs import RedisNode
from bench.capacity_profile import top_frames
from bench.fakellm import timed_args
from bench.measure import QUESTION, percentile
from bench.scratch_pg import POSTGRES_URL
from bench.service_stack import HOST, ROOT, Stack, cpu_seconds, machine_cpu, machine_share, new_conversation
from bench.wire import Connection


async def _over(conns: list[Connection], items: list[Any], fn: Any) -> list[Any]:
    """``await fn(conn, item)`` for every item, item i on ``conns[i % len(conns)]``, one request
    at a time per connection; the results in the order of ``items``."""
    out: list[Any] = [None] * len(items)

    async def lane(k: int) -> None:
        for i in range(k, len(items), len(conns)):
            out[i] = await fn(conns[k], items[i])

    await asyncio.gather(*(lane(k) for k in range(len(conns))))
    return out


def _ms(event_id: str) -> int:
    return int(event_id.split("-", 1)[0])


async def _capacity(port: int) -> dict[str, Any]:
    conn = Connection(HOST, port)
    try:
        _, body = await conn.request("GET", "/readyz")
        return dict((body or {}).get("capacity") or {})
    finally:
        await conn.close()


async def _pg_waits(url: str, name: str, stop: asyncio.Event, out: dict[str, int]) -> None:
    """What the database's sessions wait on, sampled every 0.2 s until ``stop`` (PostgreSQL's
    ``pg_stat_activity``: ``Lock/advisory`` is a session waiting for an advisory lock, ``Client/
    ClientRead`` an idle one, ``active`` a statement running). Counts of session-samples."""
    import asyncpg

    conn = await asyncpg.connect(f"{url}/postgres", timeout=5)
    try:
        while not stop.is_set():
            rows = await conn.fetch(
                "SELECT state, wait_event_type, wait_event FROM pg_stat_activity WHERE datname = $1", name
            )
            for r in rows:
                key = f"{r['state']}: {r['wait_event_type'] or '-'}/{r['wait_event'] or '-'}"
                out[key] = out.get(key, 0) + 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
    finally:
        await conn.close()


async def cmd_burst(args: argparse.Namespace) -> dict[str, Any]:
    env = {"MAX_ACTIVE_RUNS": str(args.max_active_runs), "STREAM_RETENTION_S": "300"}
    if args.max_queued_runs is not None:
        env["MAX_QUEUED_RUNS"] = str(args.max_queued_runs)
    fake = timed_args(0, args.tokens, args.delay_s)
    with RedisNode() as redis:
        profile = (str(ROOT / "bench/.venv-peers/bin/py-spy"), args.profile) if args.profile else None
        async with Stack(fake, workers=2, env=env, db=args.db, redis_url=redis.url, profile=profile) as stack:
            ports = [port for _, port in stack.workers]
            setup = [Connection(HOST, ports[i % 2]) for i in range(20)]
            t_setup = time.perf_counter()
            convs = await _over(setup, list(range(args.posts)), lambda conn, _: new_conversation(conn))
            conns = [Connection(HOST, ports[(i % 20) % 2]) for i in range(args.posts)]
            for k in range(0, len(conns), 100):
                await asyncio.gather(*(c.request("GET", "/healthz") for c in conns[k : k + 100]))
            for c in setup:
                await c.close()
            setup_s = time.perf_counter() - t_setup

            sent = [0.0] * args.posts
            answered = [0.0] * args.posts
            replies: list[tuple[int, Any]] = [(0, None)] * args.posts

            async def post(i: int, at: float) -> None:
                await asyncio.sleep(max(0.0, at - time.time()))
                sent[i] = time.time()
                try:
                    replies[i] = await conns[i].request(
                        "POST", f"/api/conversations/{convs[i]}/runs", {"message": QUESTION}
                    )
                except (OSError, asyncio.IncompleteReadError) as exc:
                    replies[i] = (-1, repr(exc))
                answered[i] = time.time()

            cpu0 = [cpu_seconds(p) for p in stack.pids]
            machine0 = machine_cpu()
            waits: dict[str, int] = {}
            stop_sampling = asyncio.Event()
            sampler = (
                asyncio.create_task(_pg_waits(POSTGRES_URL, stack.pg_database.name, stop_sampling, waits))
                if stack.pg_database is not None
                else None
            )
            t0 = time.time() + 0.5
            await asyncio.wait_for(
                asyncio.gather(*(post(i, t0 + i * args.spread_s / args.posts) for i in range(args.posts))),
                timeout=args.drain_max_s,
            )
            peak: dict[str, Any] = {}
            drained = False
            deadline = time.monotonic() + args.drain_max_s
            while time.monotonic() < deadline:
                caps = [await _capacity(p) for p in ports]
                if not peak or caps[0].get("queued", 0) > peak.get("queued", 0):
                    peak = {
                        "queued": caps[0].get("queued"),
                        "active_runs": [c.get("active_runs") for c in caps],
                    }
                if all(c.get("active_runs") == 0 and c.get("queued") == 0 for c in caps):
                    drained = True
                    break
                await asyncio.sleep(0.25)
            drain_wall = time.time() - t0
            stop_sampling.set()
            if sampler is not None:
                await sampler
            cpu = [cpu_seconds(p) - c for p, c in zip(stack.pids, cpu0, strict=True)]
            machine = machine_share(machine0, machine_cpu())
            for c in conns:
                await c.close()

            counts: dict[str, int] = {}
            accepted: list[tuple[int, str, str]] = []  # (index, run id, status at 202)
            for i, (status, body) in enumerate(replies):
                if status == 202 and body.get("status") in ("running", "queued"):
                    kind = f"202 {body['status']}"
                    accepted.append((i, body["run_id"], body["status"]))
                elif status == 429 and (body or {}).get("error", {}).get("code") == "queue_full":
                    kind = "429 queue_full"
                else:
                    kind = f"unexpected {status}"
                counts[kind] = counts.get(kind, 0) + 1

            readers = [Connection(HOST, ports[i % 2]) for i in range(20)]

            async def check(
                reader: Connection, item: tuple[int, str, str]
            ) -> tuple[str, float | None, int | None]:
                i, run_id, _ = item
                status, events = await reader.request("GET", f"/api/runs/{run_id}/events")
                if status != 200 or not events:
                    return f"events {status}", None, None
                done = events[-1]
                if done["event"] != "done" or done["data"].get("status") != "completed":
                    return f"not completed: {done['event']} {done['data'].get('status')}", None, None
                answer = "".join(
                    e["data"]["content"]
                    for e in events
                    if e["event"] == "answer" and e["data"].get("status") == "delta"
                )
                if answer != done["data"].get("answer") or not fake_answer_ok(answer, args.tokens):
                    return "answer wrong", None, None
                started = next(
                    (e for e in events if not (e["event"] == "phase" and e["data"].get("phase") == "queued")),
                    None,
                )
                waited = (_ms(started["id"]) - 1000 * answered[i]) if started else None
                return "ok", waited, _ms(done["id"])

            checks = await _over(readers, accepted, check)
            for c in readers:
                await c.close()
    problems: dict[str, int] = {}
    for verdict, _, _ in checks:
        if verdict != "ok":
            problems[verdict] = problems.get(verdict, 0) + 1
    queued_waits = [
        w for (_, _, st), (_, w, _) in zip(accepted, checks, strict=True) if st == "queued" and w is not None
    ]
    all_waits = [max(0.0, w) for _, w, _ in checks if w is not None]
    last_done = max((d for _, _, d in checks if d is not None), default=None)
    sends = sorted(sent)
    latency = sorted(a - s for a, s in zip(answered, sent, strict=True))
    return {
        "scenario": "burst",
        "workers": 2,
        "database": stack.database,
        "env": env,
        "posts": args.posts,
        "send_span_s": sends[-1] - sends[0],
        "sent_within_s": args.spread_s,
        "post_response_ms_p50": 1000 * percentile(latency, 0.5),
        "post_response_ms_p99": 1000 * percentile(latency, 0.99),
        "answers": counts,
        "accepted": len(accepted),
        "accepted_completed": sum(1 for v, _, _ in checks if v == "ok"),
        "lost_or_wrong": problems,
        "all_good": not problems and set(counts) <= {"202 running", "202 queued", "429 queue_full"},
        "queue_ms_queued_runs_p50": percentile(queued_waits, 0.5),
        "queue_ms_queued_runs_p99": percentile(queued_waits, 0.99),
        "queue_ms_queued_runs_max": max(queued_waits, default=None),
        "queue_ms_all_accepted_p50": percentile(all_waits, 0.5),
        "queue_ms_all_accepted_p99": percentile(all_waits, 0.99),
        "queue_time_from": "the client's receipt of the 202 to the run's first non-queued event (id's ms)",
        "peak_seen": peak,
        "drained": drained,
        "drain_wall_s_to_last_done": (last_done / 1000 - sends[0]) if last_done else None,
        "drain_wall_s_to_idle_seen": drain_wall,
        "setup_s": setup_s,
        "worker_cpu_s": [round(c, 2) for c in cpu],
        "worker_cpu_pct": [round(100 * c / (drain_wall + 0.5), 1) for c in cpu],
        **machine,
        "pg_session_samples": dict(sorted(waits.items(), key=lambda kv: -kv[1])),
        "profile_worker0_top_app_frames": top_frames(Path(args.profile)) if profile else None,
    }
