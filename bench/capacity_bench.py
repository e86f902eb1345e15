"""Capacity (issue 17): how many streaming runs a worker holds, a burst of starts, Redis Cluster.

Subcommands, each printing one JSON object (and writing it to ``--out FILE``):

* ``knee``: N users each keep one run streaming at 50 tokens/s (the fake LLM paces its answer's
  tokens ``--delay-s`` apart and stamps each with its send time); N steps up; per level the token
  delivery latency (client receive - stamp) p50/p95/p99/max over a window after a ramp, every run
  checked, the CPU of everything involved. The knee is the largest N with p99 under ``--target-ms``
  and nothing lost. Subjects: the floor (``bench/peers/bare_relay.py``: one chat call per run relayed
  as SSE, nothing else), one AgentStream worker on SQLite and on PostgreSQL, two (round robin, one
  Redis, SQLite), and the LangGraph API server (``langgraph dev``, in-memory, through its HTTP
  streaming API); then each knee and worker CPU per token against the floor's (issue 29), and one
  worker's knee against LangGraph's. The client is ``bench/capacity_client.py``;
* ``burst``: two workers with ``MAX_ACTIVE_RUNS=200`` on PostgreSQL and Redis, 2,000 run starts
  within one second (``bench/capacity_burst.py``);
* ``cluster-throughput``: tokens/s through two workers on a Redis Cluster of its own (3 masters + 3
  replicas on loopback) against one Redis node of its own, same load (``service_bench``'s
  throughput load); "not run" when a worker does not start on the cluster.

Redis is always one of the bench's own (``bench/capacity_procs.py``), not the machine's, so other
work on 6379 neither disturbs nor is disturbed. ``--quick``: small levels, about 1-2 minutes each.
Run from the repository root: ``.venv/bin/python -m bench.capacity_bench knee --quick``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.capacity_client import Level, agentstream_run, langgraph_run, run_level
from bench.capacity_procs import CpuMeter, RedisClusterNodes, RedisNode, load_generator_on, pin
from bench.fakellm import timed_args
from bench.measure import emit
from bench.service_stack import ROOT, Stack, machine_cpu, machine_share, probe_env, probe_summary, rss_mb

PEERS_BIN = ROOT / "bench" / ".venv-peers" / "bin"
OUT_DIR = ROOT / "bench" / "out"
NOTE_CLOCK = (
    "delivery = client receive time (time.time(), read once per socket read) - the fake LLM's "
    "send stamp (time.time() right before it writes the token); same machine, same clock"
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def fake_args(args: argparse.Namespace, tool: str) -> list[str]:
    return timed_args(args.k, args.tokens, args.delay_s, tool)


def placement(args: argparse.Namespace, subject_procs: int) -> dict[str, set[int]] | None:
    """Where to pin: with one process under test on a machine of 2+ CPUs, it gets CPU 0 alone and the
    load generator, the fake LLM and Redis share the others (one worker per core, as the README
    advises); with two workers, nothing is pinned (they need both cores and share them with the rest)."""
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin == "none" or len(cpus) < 2 or subject_procs > 1:
        return None
    return {"subject": {cpus[0]}, "rest": set(cpus[1:])}


async def step_levels(
    args: argparse.Namespace,
    levels: Sequence[int],
    ports: list[int],
    one_run: Callable[..., Any],
    meter: CpuMeter,
    rss_pids: dict[str, int],
    probe: Path | None = None,
) -> list[dict[str, Any]]:
    """Each level in turn (bounded in time); stops ``--past-knee`` levels after the first that fails."""
    run_s = args.tokens * args.delay_s
    ramp_s = args.ramp_s if args.ramp_s is not None else run_s
    results: list[dict[str, Any]] = []
    failed = 0
    for users in levels:
        level = Level(users, args.tokens, 1 / args.delay_s, ramp_s, args.window_s, args.settle_s)
        hard = level.stop_at + run_s + args.drain_s
        task = asyncio.create_task(run_level(level, ports, one_run, hard))
        await asyncio.sleep(max(0.0, level.window_start_us / 1e6 - time.time()))
        meter.start()
        machine0 = machine_cpu()
        await asyncio.sleep(max(0.0, level.stop_at - time.time()))
        cpu = meter.read()
        machine = machine_share(machine0, machine_cpu())
        await task
        row = {**level.summary(), **cpu, **machine}
        row.update({f"{name}_rss_mb": round(rss_mb(pid)) for name, pid in rss_pids.items()})
        if probe is not None:
            row["probe"] = probe_summary(probe, level.window_start_us / 1e6, level.stop_at)
        row["streaming_share"] = row["tokens_per_s"] / row["tokens_per_s_offered"]
        row["ok"] = level_met(row, args.target_ms, args.min_streaming_share)
        results.append(row)
        log(
            f"  N={users}: p50 {row['p50_ms']:.1f} p95 {row['p95_ms']:.1f} p99 {row['p99_ms']:.1f} "
            f"max {row['max_ms']:.1f} ms (LLM->publish p50/p99 {row['llm_to_publish_ms_p50']:.0f}/"
            f"{row['llm_to_publish_ms_p99']:.0f}, publish->client {row['publish_to_client_ms_p50']:.0f}/"
            f"{row['publish_to_client_ms_p99']:.0f}); {row['tokens_per_s']:.0f}/"
            f"{row['tokens_per_s_offered']:.0f} tok/s "
            f"({row['streaming_runs_mean']:.0f} streaming), start->1st token p50/p99 "
            f"{row['start_to_first_token_ms_p50']:.0f}/{row['start_to_first_token_ms_p99']:.0f} ms; "
            f"runs {row['runs_good']}/{row['runs_started']} good {row['problems'] or ''}; CPU%: "
            + " ".join(f"{k[:-8]} {v:.0f}" for k, v in cpu.items())
            + f"; machine busy {row['machine_busy_pct']:.0f}% -> {'ok' if row['ok'] else 'MISSED'}"
        )
        failed += not row["ok"]
        if failed > args.past_knee:
            break
        await asyncio.sleep(args.pause_s)
    return results


def level_met(row: dict[str, Any], target_ms: float, min_share: float) -> bool:
    """p99 under the target, no run with a problem, every started run good, and the users' runs
    streaming at least ``min_share`` of the time (tokens received / N x 50 per s): a worker that
    keeps p99 low by starting runs late does not hold N streaming runs."""
    return bool(
        row["tokens_timed"]
        and row["p99_ms"] < target_ms
        and not row["problems"]
        and row["runs_good"] == row["runs_started"]
        and row["tokens_per_s"] >= min_share * row["tokens_per_s_offered"]
    )


def _profile_summary(path: str, levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    from bench.capacity_profile import summarize

    if not os.path.exists(path):
        return None
    return summarize(Path(path), sum(r["tokens_all"] for r in levels), sum(r["runs_started"] for r in levels))


def knee_of(levels: list[dict[str, Any]]) -> int | None:
    """The largest N met with every lower level met too (a met level above a missed one is noise
    around the knee, reported in the levels but not taken)."""
    knee = None
    for row in sorted(levels, key=lambda r: r["users"]):
        if not row["ok"]:
            break
        knee = row["users"]
    return knee


FLOOR = "bench.peers.bare_relay:create_app"
GUARDED = "bench.peers.guarded_relay:create_app"
RELAYS = {
    "floor": (FLOOR, "floor: a bare relay (bench/peers/bare_relay.py), 1 process", "no database, no Redis"),
    "guarded": (
        GUARDED,
        "the floor with the guarantees kept (bench/peers/guarded_relay.py), 1 process",
        "SQLite (aiosqlite, WAL) and Redis, written the cheapest way",
    ),
}
"""The relays a knee can measure besides AgentStream: (app factory, subject, what they keep)."""

KNEE_LEVELS = [50, 100, 120, 140, 160, 180, 200, 220, 240, 260, 300, 340, 380, 420, 500, 1000]
"""Users per level of the knee (the floor's steps go on past 300)."""
LANGGRAPH_LEVELS = [2, 4, 6, 8, 12, 16, 25, 50, 100, 200, 500, 1000]


async def knee_workers(
    args: argparse.Namespace, workers: int, db: str, peer: str | None = None
) -> dict[str, Any]:
    """One subject served by uvicorn worker processes: AgentStream's app (``workers`` of them, on
    ``db``), or a relay of ``RELAYS`` (one process): the floor (``bench/peers/bare_relay.py``: no
    database, no Redis) or the guarded floor (``bench/peers/guarded_relay.py``)."""
    relay = peer is not None
    env = {
        "MAX_ACTIVE_RUNS": str(args.max_active_runs),
        "STREAM_RETENTION_S": "120",
        "STREAM_LINGER_MS": str(args.linger_ms),
    }
    probe = OUT_DIR / f"capacity_probe_{os.getpid()}.txt" if args.probe and not relay else None
    if probe is not None:
        OUT_DIR.mkdir(exist_ok=True)
        env |= probe_env(probe)
    where = placement(args, workers)
    profile = (str(PEERS_BIN / "py-spy"), args.profile) if args.profile and workers == 1 else None
    with RedisNode() as redis:
        async with Stack(
            fake_args(args, "calculator"),
            workers=workers,
            env=env,
            db=db,
            redis_url=redis.url,
            profile=profile,
            factory=RELAYS[peer][0] if peer is not None else "app.main:create_app",
            app_path=args.app_path or None,
        ) as stack:
            assert stack.fake is not None
            if where:
                for pid in stack.pids:
                    pin(pid, where["subject"])
                for pid in (stack.fake.pid, *redis.pids):
                    pin(pid, where["rest"])
            trees = {f"worker{i}": [pid] for i, pid in enumerate(stack.pids)}
            trees |= {"fake_llm": [stack.fake.pid], "redis": redis.pids}
            with load_generator_on(where["rest"] if where else None):
                levels = await step_levels(
                    args,
                    args.levels,
                    [port for _, port in stack.workers],
                    agentstream_run,
                    CpuMeter(trees),
                    {f"worker{i}": pid for i, pid in enumerate(stack.pids)},
                    probe,
                )
            database = stack.database
    for row in levels:
        cpu = sum(row.get(f"worker{i}_cpu_pct", 0.0) for i in range(workers))
        row["worker_cpu_us_per_token"] = 1e4 * cpu / row["tokens_per_s"] if row["tokens_per_s"] else None
    summary = _profile_summary(args.profile, levels) if profile else None
    if peer is not None:
        subject = RELAYS[peer][1]
    else:
        subject = f"AgentStream, {workers} worker{'s' if workers > 1 else ''}, {DB_NAMES[db]}"
    return {
        "subject": subject,
        "key": peer or f"{'one' if workers == 1 else 'two'}{'-pg' if db == 'postgres' else ''}",
        "workers": workers,
        "database": RELAYS[peer][2] if peer is not None else database,
        "env": {} if relay else env,
        "pinning": _pinning_note(where, "worker"),
        "profile": args.profile if profile else None,
        "profile_summary": summary,
        "knee": knee_of(levels),
        "levels": levels,
    }


DB_NAMES = {"sqlite": "SQLite", "postgres": "PostgreSQL"}


async def knee_langgraph(args: argparse.Namespace) -> dict[str, Any]:
    from bench.peers.langgraph_server import LangGraphServer

    if not (PEERS_BIN / "langgraph").exists():
        return {
            "subject": "LangGraph API server",
            "not_run": "bench/.venv-peers has no langgraph CLI (run bench/peers/setup.sh)",
        }
    where = placement(args, 1)
    jobs = max(args.lg_levels) + 10
    OUT_DIR.mkdir(exist_ok=True)
    with RedisNode() as redis:
        # The fake LLM only (no workers); the Redis node is unused, given so nothing touches 6379.
        async with Stack(fake_args(args, "add"), workers=0, redis_url=redis.url) as fake:
            assert fake.fake is not None
            server = LangGraphServer(
                fake.llm_url,
                jobs=jobs,
                langgraph=str(PEERS_BIN / "langgraph"),
                log_dir=str(OUT_DIR),
                cpus=where["subject"] if where else None,
            )
            await asyncio.to_thread(server.__enter__)
            try:
                assert server.proc is not None
                if where:
                    pin(server.proc.pid, where["subject"])
                    pin(fake.fake.pid, where["rest"])
                port = int(server.base.rsplit(":", 1)[1])
                with load_generator_on(where["rest"] if where else None):
                    levels = await step_levels(
                        args,
                        args.lg_levels,
                        [port],
                        langgraph_run,
                        CpuMeter({"langgraph": [server.proc.pid], "fake_llm": [fake.fake.pid]}),
                        {"langgraph": server.proc.pid},
                    )
            finally:
                await asyncio.to_thread(server.__exit__, None, None, None)
    return {
        "subject": "LangGraph API server (langgraph dev, in-memory runtime)",
        "jobs_per_worker": jobs,
        "pinning": _pinning_note(where, "langgraph dev (its process tree)"),
        "knee": knee_of(levels),
        "levels": levels,
    }


def _pinning_note(where: dict[str, set[int]] | None, subject: str) -> str:
    if where is None:
        return "none: every process on every CPU"
    return (
        f"{subject} on CPU {sorted(where['subject'])}; the load generator (this process), the fake LLM "
        f"and Redis on CPU {sorted(where['rest'])}"
    )


SUBJECTS = {
    "floor": lambda args: knee_workers(args, 1, "sqlite", peer="floor"),
    "guarded": lambda args: knee_workers(args, 1, "sqlite", peer="guarded"),
    "one": lambda args: knee_workers(args, 1, "sqlite"),
    "one-pg": lambda args: knee_workers(args, 1, "postgres"),
    "two": lambda args: knee_workers(args, 2, "sqlite"),
    "langgraph": knee_langgraph,
}


def _at_same_level(subject: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any] | None:
    """A subject's worker CPU per token against the floor's, at the highest level both met (same
    users, so the same tokens and run starts a second)."""
    met = {r["users"]: r for r in floor.get("levels", ()) if r["ok"] and r.get("worker_cpu_us_per_token")}
    both = [
        r
        for r in subject.get("levels", ())
        if r["ok"] and r["users"] in met and r.get("worker_cpu_us_per_token")
    ]
    if not both:
        return None
    row = max(both, key=lambda r: r["users"])
    base = met[row["users"]]
    return {
        "users": row["users"],
        "worker_cpu_us_per_token": row["worker_cpu_us_per_token"],
        "floor_cpu_us_per_token": base["worker_cpu_us_per_token"],
        "cpu_per_token_ratio": row["worker_cpu_us_per_token"] / base["worker_cpu_us_per_token"],
    }


async def cmd_knee(args: argparse.Namespace) -> dict[str, Any]:
    load0 = os.getloadavg()
    out: dict[str, Any] = {
        "scenario": "knee",
        "target": f"token delivery p99 < {args.target_ms} ms, every run complete and exact, tokens received "
        f">= {args.min_streaming_share} x offered",
        "tokens_per_run": args.tokens,
        "token_interval_ms": 1000 * args.delay_s,
        "tool_calls_per_run": args.k,
        "window_s": args.window_s,
        "clock": NOTE_CLOCK,
        "load_average_before": load0,
        "subjects": [],
    }
    for subject in args.subjects:
        log(f"== knee: {subject}")
        result = await SUBJECTS[subject](args)
        result.setdefault("key", subject)
        out["subjects"].append(result)
    out["load_average_after"] = os.getloadavg()
    by_key = {s["key"]: s for s in out["subjects"]}
    out["knees"] = {s["subject"]: s.get("knee") for s in out["subjects"]}
    one, lg, floor = (
        by_key.get("one", {}).get("knee"),
        by_key.get("langgraph", {}).get("knee"),
        by_key.get("floor"),
    )
    out["ratio_agentstream_one_worker_to_langgraph"] = (one / lg) if one and lg else None
    if floor is not None:
        out["floor"] = {}
        for key, subject in by_key.items():
            if key in ("floor", "langgraph"):
                continue
            knee, floor_knee = subject.get("knee"), floor.get("knee")
            out["floor"][key] = {
                "knee": knee,
                "floor_knee": floor_knee,
                "knee_ratio": knee / floor_knee if knee and floor_knee else None,
                "cpu_per_token": _at_same_level(subject, floor),
            }
    return out


async def cmd_cluster_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from bench.service_bench import throughput_load

    fake = ["--k", "0", "--tokens", str(args.tokens), "--tool", "calculator"]
    out: dict[str, Any] = {"scenario": "cluster-throughput", "concurrency": args.concurrency, "rounds": []}
    for round_no in range(args.rounds):
        row: dict[str, Any] = {}
        order = ["node", "cluster"] if round_no % 2 == 0 else ["cluster", "node"]
        for kind in order:
            log(f"== cluster-throughput round {round_no + 1}: {kind}")
            servers: RedisNode | RedisClusterNodes = (
                RedisNode() if kind == "node" else RedisClusterNodes(args.first_port)
            )
            env = {"REDIS_CLUSTER": "true"} if kind == "cluster" else {}
            with servers:
                try:
                    stack = Stack(fake, workers=2, env=env, db=args.db, redis_url=servers.url)
                    await stack.__aenter__()
                except RuntimeError as exc:
                    row[kind] = {"not_run": f"a worker did not start on the {kind}: {exc}"}
                    log(f"   not run: {exc}")
                    continue
                try:
                    row[kind] = await throughput_load(
                        stack, args.concurrency, args.tokens, args.seconds, args.max_runs
                    )
                    row[kind]["redis"] = f"{kind}: {servers.url}" + (
                        " (3 masters + 3 replicas)" if kind == "cluster" else ""
                    )
                finally:
                    await stack.__aexit__(None, None, None)
            log(f"   {row[kind].get('tokens_per_s', 0):.0f} tokens/s")
        out["rounds"].append(row)
    done = [
        r
        for r in out["rounds"]
        if "tokens_per_s" in r.get("cluster", {}) and "tokens_per_s" in r.get("node", {})
    ]
    out["ratio_cluster_to_node"] = (
        sorted(r["cluster"]["tokens_per_s"] / r["node"]["tokens_per_s"] for r in done)[len(done) // 2]
        if done
        else None
    )
    if not done:
        out["not_run"] = next(
            (r["cluster"]["not_run"] for r in out["rounds"] if "not_run" in r.get("cluster", {})), ""
        )
    return out


def _no_nan(value: Any) -> Any:
    """NaN (a percentile of nothing) as null, so that the output is strict JSON."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    k = sub.add_parser("knee", help="the most streaming runs a worker holds with p99 under the target")
    k.add_argument(
        "--subjects",
        nargs="+",
        choices=list(SUBJECTS),
        default=["floor", "guarded", "one", "one-pg", "two", "langgraph"],
        help="floor: the bare relay; guarded: the floor with the guarantees kept (Redis and SQLite, "
        "written the cheapest way); one, one-pg, two: AgentStream's workers on SQLite, PostgreSQL, SQLite",
    )
    k.add_argument(
        "--levels",
        type=int,
        nargs="+",
        help=f"users per level (default {' '.join(map(str, KNEE_LEVELS))})",
    )
    k.add_argument(
        "--lg-levels",
        type=int,
        nargs="+",
        help=f"for LangGraph (default {' '.join(map(str, LANGGRAPH_LEVELS))})",
    )
    k.add_argument("--tokens", type=int, default=500, help="answer tokens per run (10 s at 50 tokens/s)")
    k.add_argument("--delay-s", type=float, default=0.02, help="between tokens: 20 ms is 50 tokens/s")
    k.add_argument("--k", type=int, default=1, help="tool calls before the answer")
    k.add_argument("--window-s", type=float, default=20.0, help="the timed window of a level")
    k.add_argument(
        "--ramp-s", type=float, default=None, help="users arrive over this long (default: a run's length)"
    )
    k.add_argument("--settle-s", type=float, default=2.0, help="between the ramp and the window")
    k.add_argument(
        "--drain-s", type=float, default=30.0, help="beyond a run's length for the last runs to end"
    )
    k.add_argument("--pause-s", type=float, default=3.0, help="between levels")
    k.add_argument("--target-ms", type=float, default=50.0)
    k.add_argument(
        "--min-streaming-share",
        type=float,
        default=0.85,
        help="tokens received / offered (N x 50/s) a met level needs (a run's start costs a few %%)",
    )
    k.add_argument("--past-knee", type=int, default=0, help="levels to run after the first that misses")
    k.add_argument("--max-active-runs", type=int, default=5000)
    k.add_argument(
        "--linger-ms", type=float, default=0.0, help="the workers' STREAM_LINGER_MS (answer tokens merged)"
    )
    k.add_argument("--pin", choices=["auto", "none"], default="auto")
    k.add_argument(
        "--app-path", default="", help="the workers import app/ from this tree (a worktree of another commit)"
    )
    k.add_argument(
        "--probe",
        action="store_true",
        help="the workers' event-loop lag and GC passes per level (bench/probe)",
    )
    k.add_argument(
        "--profile", default="", help="a py-spy profile (raw, collapsed) of the one worker, all levels"
    )
    b = sub.add_parser("burst", help="2,000 run starts in one second on two workers, MAX_ACTIVE_RUNS=200")
    b.add_argument("--posts", type=int, default=2000)
    b.add_argument("--spread-s", type=float, default=1.0)
    b.add_argument("--max-active-runs", type=int, default=200)
    b.add_argument("--max-queued-runs", type=int, default=None, help="default: the service's (10000)")
    b.add_argument("--tokens", type=int, default=20)
    b.add_argument("--delay-s", type=float, default=0.02)
    b.add_argument("--drain-max-s", type=float, default=300.0)
    b.add_argument("--db", choices=["postgres", "sqlite"], default="postgres")
    b.add_argument("--profile", default="", help="a py-spy profile (raw, collapsed) of worker 0")
    c = sub.add_parser("cluster-throughput", help="tokens/s, two workers, Redis Cluster against one node")
    c.add_argument("--concurrency", type=int, default=16)
    c.add_argument("--tokens", type=int, default=2000)
    c.add_argument("--seconds", type=float, default=20.0)
    c.add_argument("--max-runs", type=int, default=5000)
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--first-port", type=int, default=7501)
    c.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    for p in (k, b, c):
        p.add_argument("--quick", action="store_true", help="small levels, about 1-2 minutes")
        p.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.command == "knee" and not args.quick:
        args.levels = args.levels or KNEE_LEVELS
        args.lg_levels = args.lg_levels or LANGGRAPH_LEVELS
    if args.quick:
        if args.command == "knee":
            args.levels, args.lg_levels = args.levels or [10, 50], args.lg_levels or [5, 20]
            args.tokens, args.window_s, args.drain_s, args.pause_s, args.settle_s = 100, 5.0, 15.0, 1.0, 1.0
            args.past_knee = 1
            # 2 s runs: a run's start (and LangGraph's ~0.7 s to its first token) weighs far more.
            args.min_streaming_share = min(args.min_streaming_share, 0.5)
        elif args.command == "burst":
            args.posts, args.max_active_runs = 400, 50
            args.max_queued_runs = args.max_queued_runs if args.max_queued_runs is not None else 200
        else:
            args.seconds, args.rounds, args.tokens = 6.0, 1, 1000
    if args.command == "burst":
        from bench.capacity_burst import cmd_burst

        command: Callable[[argparse.Namespace], Any] = cmd_burst
    else:
        command = {"knee": cmd_knee, "cluster-throughput": cmd_cluster_throughput}[args.command]
    emit(_no_nan(asyncio.run(command(args))), args.out)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main(sys.argv[1:])
