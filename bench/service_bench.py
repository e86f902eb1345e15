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

The fake LLM, the workers and the client calls they share are in ``bench/service_stack.py``. With
``--profile FILE`` (``http``, ``latency``, ``throughput``) worker 0 runs under ``py-spy record``
(``--py-spy``: its path; without py-spy there, no profile) and its samples are written at the end.

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
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.fakellm import timed_args
from bench.measure import emit, expected_answer, percentile
from bench.service_stack import (
    HOST,
    ROOT,
    Connection,
    SseStream,
    Stack,
    cpu_seconds,
    loop_thread_sched,
    machine_cpu,
    machine_share,
    new_conversation,
    postgres_cpu,
    probe_env,
    probe_summary,
    read_stream,
    rss_mb,
    sched_shares,
    start_run,
)


async def scenario_http(args: argparse.Namespace) -> dict[str, Any]:
    fake = ["--k", str(args.k), "--tokens", str(args.tokens), "--tool", "calculator"]
    expected = expected_answer(args.tokens)
    walls: list[float] = []
    ttft: list[float] = []
    stream_bytes: list[int] = []
    request_bytes: list[int] = []
    persisted_ok = 0
    worker_cpu_s = 0.0
    profile = (args.py_spy, args.profile) if args.profile and args.have_py_spy else None
    async with Stack(fake, db=args.db, app_path=args.app_path, profile=profile) as stack:
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
    fake = timed_args(1, args.tokens, args.delay_s)
    levels = []
    profile = (args.py_spy, args.profile) if args.profile and args.have_py_spy else None
    probe_dir = tempfile.TemporaryDirectory(prefix="agentstream-probe-")
    probe = Path(probe_dir.name) / "probe.txt"
    env = probe_env(probe) if args.probe else None
    async with Stack(fake, db=args.db, profile=profile, env=env, app_path=args.app_path or None) as stack:
        database = stack.database
        pid, port = stack.pids[0], stack.workers[0][1]
        for concurrency in args.concurrency:
            cpu0, t0, client0 = cpu_seconds(pid), time.perf_counter(), time.process_time()
            machine0, wall0 = machine_cpu(), time.time()
            sched0 = loop_thread_sched(pid), postgres_cpu()
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
            level.update(
                sched_shares(sched0, (loop_thread_sched(pid), postgres_cpu()), time.perf_counter() - t0)
            )
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
                f"stolen {level['machine_steal_pct']:.0f}%; event loop's thread on a CPU "
                f"{level['loop_thread_cpu_pct']:.0f}%, waiting for one "
                f"{level['loop_thread_runqueue_pct']:.1f}%; PostgreSQL {level['postgres_cpu_pct']:.0f}%",
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


async def throughput_load(
    stack: Stack, concurrency: int, tokens: int, seconds: float, max_runs: int
) -> dict[str, Any]:
    """``concurrency`` users on a started ``stack`` of two workers (a fake LLM streaming ``tokens``
    untimed tokens), for ``seconds``: each starts a run on one worker and streams it from the other,
    again and again; every answer checked. Also bench/capacity_bench.py's ``cluster-throughput``."""
    expected = expected_answer(tokens)
    delivered = 0
    runs = 0
    bad: list[str] = []
    ports = [port for _, port in stack.workers]
    pids = stack.pids
    deadline = time.monotonic() + seconds

    async def user(n: int) -> None:
        nonlocal delivered, runs
        start_port, stream_port = ports[n % 2], ports[(n + 1) % 2]
        conn = Connection(HOST, start_port)
        try:
            while time.monotonic() < deadline and runs < max_runs:
                conv_id = await new_conversation(conn)
                await start_run(conn, conv_id)
                # Started on one worker, streamed from the other: the tokens cross Redis.
                result = await read_stream(stream_port, conv_id)
                if result.answer != expected or (result.done or {}).get("answer") != expected:
                    bad.append(conv_id)
                else:
                    delivered += tokens
                runs += 1
        finally:
            await conn.close()

    cpu0 = [cpu_seconds(p) for p in pids]
    t0 = time.perf_counter()
    await asyncio.gather(*(user(n) for n in range(concurrency)))
    elapsed = time.perf_counter() - t0
    cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
    return {
        "workers": 2,
        "database": stack.database,
        "concurrency": concurrency,
        "tokens_per_run": tokens,
        "runs": runs,
        "runs_wrong": len(bad),
        "tokens_delivered": delivered,
        "seconds": elapsed,
        "tokens_per_s": delivered / elapsed,
        "worker_cpu_pct": [100 * c / elapsed for c in cpu],
        "worker_cpu_us_per_token": 1e6 * sum(cpu) / max(1, delivered),
    }


async def scenario_throughput(args: argparse.Namespace) -> dict[str, Any]:
    fake = ["--k", "0", "--tokens", str(args.tokens), "--tool", "calculator"]
    profile = (args.py_spy, args.profile) if args.profile and args.have_py_spy else None
    async with Stack(fake, workers=2, db=args.db, profile=profile) as stack:
        result = await throughput_load(stack, args.concurrency, args.tokens, args.seconds, args.max_runs)
    return {"scenario": "throughput", **result}


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
    h.add_argument("--profile", default="", help="write a py-spy profile of the worker here")
    h.add_argument("--py-spy", default=str(ROOT / "bench/.venv-peers/bin/py-spy"))
    lat = sub.add_parser("latency")
    lat.add_argument("--app-path", default="", help="import the worker's app package from this tree")
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
