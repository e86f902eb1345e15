"""Instructions a worker executes per streamed token: a repeatable measure of the per-token path.

CPU time on these shared 2-core machines moves by 10-20 % from one run of the same code to the next
(bench/NOTES.md), too much to see a change of a few percent. Instructions do not move with the
machine's load: the worker runs under ``valgrind --tool=callgrind`` (which counts them, ``Ir``),
and one user at a time (or a few) streams runs through it as the knee benchmark's users do (one
tool call, then ``--tokens`` timed tokens, every run read to ``done`` and checked). Counting starts
after warm-up runs (first-use imports and caches are not the steady state) and covers the measured
runs only, every thread of the worker (aiosqlite's too). The figure is the count divided by the
tokens the clients received: per-run work (requests, database, the tool loop) is in it, spread over
the tokens, as in the knee's CPU per token.

The worker is about fifty times slower under valgrind: tokens come slowly (``--delay-s``, 0.1 s by
default) so that it keeps up and every token stays an event of its own, as at 50 tokens/s natively.

``python -m bench.instructions [--app-path TREE] [--db sqlite|postgres] [--runs 8] [--tokens 100]``

``--floor`` counts the knee's floor instead (``bench/peers/bare_relay.py``, the same client, fake LLM
and tokens): the ratio of the two counts is the knee's CPU-per-token ratio without the machine's
noise (bench/NOTES.md, fifth session). ``--guarded`` counts the floor with AgentStream's guarantees
kept at their cheapest (``bench/peers/guarded_relay.py``: every event in Redis before its client gets
it and in SQLite, the run's rows): between the two floors, what the guarantees cost at the least.
``--split 400`` measures runs of a second length too and splits the count into a run's fixed part
and each token's marginal part. ``--ablate store,redis`` takes
guarantees out of the worker to see what they cost (``bench/ablate/sitecustomize.py``).

``--app-path`` measures the app of another tree (a ``git worktree`` of an earlier commit) with this
very script: A/B of one change, within a few tenths of a percent between repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.capacity_bench import FLOOR, GUARDED
from bench.capacity_client import Level, agentstream_run
from bench.fakellm import timed_args
from bench.measure import emit
from bench.service_stack import ROOT, Stack
from bench.wire import Connection

_TOTALS = re.compile(r"^(?:summary|totals):\s*(\d+)", re.MULTILINE)


def callgrind(args: list[str]) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=120)


def instructions(out_dir: Path) -> int:
    """The ``Ir`` of the dumps callgrind wrote (the measured runs only: counting was off before)."""
    total = 0
    for dump in out_dir.glob("callgrind.out*"):
        found = _TOTALS.findall(dump.read_text(errors="replace"))
        if found:
            total += int(found[-1])
    return total


async def stream_runs(port: int, level: Level, runs: int, concurrency: int) -> None:
    """``runs`` runs, ``concurrency`` at a time, each read to its ``done`` and checked."""
    queue = list(range(runs))

    async def user() -> None:
        conn = Connection("127.0.0.1", port)
        try:
            while queue:
                queue.pop()
                await agentstream_run(level, conn, port)
        finally:
            await conn.close()

    await asyncio.gather(*(user() for _ in range(concurrency)))


ABLATIONS = ("store", "redis")
"""What ``bench/ablate/sitecustomize.py`` can take out of a worker."""


def ablate_env(names: str) -> dict[str, str]:
    """The workers' environment for ``--ablate`` (``bench/ablate/sitecustomize.py``). Its folder goes
    first on ``PYTHONPATH``: Python imports the first ``sitecustomize`` only, so another one on the
    path (``bench/probe``'s) is not loaded with it."""
    if not names:
        return {}
    search = [str(ROOT / "bench" / "ablate"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(search), "BENCH_ABLATE": names}


async def measure(args: argparse.Namespace, tokens_per_run: int) -> dict[str, Any]:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    out_dir = Path(tempfile.mkdtemp(prefix="agentstream-callgrind-"))
    wrapper = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out_dir}/callgrind.out.%p",
    ]
    async with Stack(
        timed_args(args.k, tokens_per_run, args.delay_s, "calculator"),
        workers=1,
        db=args.db,
        app_path=args.app_path or None,
        factory=FLOOR if args.floor else GUARDED if args.guarded else "app.main:create_app",
        wrapper=wrapper,
        ready_timeout_s=900,
        env={"MAX_ACTIVE_RUNS": "1000", "STREAM_RETENTION_S": "120", **ablate_env(args.ablate)},
    ) as stack:
        port = stack.workers[0][1]
        pid = stack.pids[0]
        warm = Level(args.concurrency, tokens_per_run, 1 / args.delay_s, 0, 0, 0)
        await stream_runs(port, warm, args.warmup, args.concurrency)
        await asyncio.to_thread(callgrind, ["--instr=on", str(pid)])
        level = Level(args.concurrency, tokens_per_run, 1 / args.delay_s, 0, 0, 0)
        started = time.monotonic()
        await stream_runs(port, level, args.runs, args.concurrency)
        elapsed = time.monotonic() - started
        await asyncio.to_thread(callgrind, ["--dump", str(pid)])
        await asyncio.to_thread(callgrind, ["--instr=off", str(pid)])
        app_file = stack.app_file
    ir = instructions(out_dir)
    if os.environ.get("KEEP_CALLGRIND"):
        print(out_dir)
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
    if level.runs_good != args.runs or warm.runs_good != args.warmup:
        raise SystemExit(f"runs failed: {level.problems} {level.examples}")
    tokens = args.runs * tokens_per_run
    return {
        "scenario": "instructions",
        "subject": "floor" if args.floor else "guarded" if args.guarded else "agentstream",
        "ablated": args.ablate.split(",") if args.ablate else [],
        "app": None if args.floor or args.guarded else app_file,
        "database": None if args.floor else args.db,
        "runs": args.runs,
        "tokens_per_run": tokens_per_run,
        "tool_calls_per_run": 0 if args.floor or args.guarded else args.k,  # a relay offers no tools
        "concurrency": args.concurrency,
        "token_interval_s": args.delay_s,
        "measured_s": round(elapsed, 1),
        "instructions": ir,
        "instructions_per_token": round(ir / tokens),
        "instructions_per_run": round(ir / args.runs),
    }


_PER_POINT = (
    "tokens_per_run",
    "measured_s",
    "instructions",
    "instructions_per_token",
    "instructions_per_run",
)


def split(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two counts of one subject at two run lengths as a run's fixed instructions (its requests,
    database work, tool loop) and each token's marginal ones (the streaming path). Work that goes
    with time rather than with runs (timers, lease renewals, background loops) grows with the run's
    length and so lands in the marginal part."""
    n_a, n_b = a["tokens_per_run"], b["tokens_per_run"]
    if n_a == n_b:
        raise SystemExit("--split needs a run length other than --tokens")
    marginal = (b["instructions_per_run"] - a["instructions_per_run"]) / (n_b - n_a)
    return {
        **{k: v for k, v in a.items() if k not in _PER_POINT},
        "points": [a, b],
        "instructions_per_token_marginal": round(marginal),
        "instructions_per_run_fixed": round(a["instructions_per_run"] - marginal * n_a),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--app-path", default="", help="the worker imports app/ from this tree")
    parser.add_argument("--floor", action="store_true", help="count the floor (a bare relay) instead")
    parser.add_argument(
        "--guarded",
        action="store_true",
        help="count the floor with the guarantees kept (bench/peers/guarded_relay.py, SQLite) instead",
    )
    parser.add_argument(
        "--ablate",
        default="",
        help="take guarantees out to see what they cost: store, redis or store,redis "
        "(bench/ablate/sitecustomize.py; a difference, never a result of its own)",
    )
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--runs", type=int, default=8, help="measured runs")
    parser.add_argument("--warmup", type=int, default=2, help="runs before counting starts")
    parser.add_argument("--tokens", type=int, default=100, help="answer tokens per run")
    parser.add_argument("--k", type=int, default=1, help="tool calls before the answer")
    parser.add_argument("--delay-s", type=float, default=0.1, help="between tokens")
    parser.add_argument("--concurrency", type=int, default=2, help="runs streaming at once")
    parser.add_argument("--out", default="", help="also write the JSON here")
    parser.add_argument(
        "--split",
        type=int,
        default=0,
        help="measure runs of this many tokens too, and split the count into a run's fixed part "
        "and each token's (two points of instructions = fixed + tokens x marginal)",
    )
    args = parser.parse_args(argv)
    if args.floor and args.guarded:
        parser.error("--floor and --guarded are two subjects: count one at a time")
    if (args.floor or args.guarded) and args.ablate:
        parser.error("--ablate takes guarantees out of AgentStream, not out of a floor")
    if (args.floor or args.guarded) and args.app_path:
        parser.error("--app-path names AgentStream's tree; a floor is this tree's bench/peers")
    if args.guarded and args.db != "sqlite":
        parser.error("--guarded stores in SQLite only")
    unknown = set(filter(None, args.ablate.split(","))) - set(ABLATIONS)
    if unknown:
        parser.error(f"--ablate: unknown {sorted(unknown)}; known: {', '.join(ABLATIONS)}")
    if args.split and args.split == args.tokens:
        parser.error("--split needs a run length other than --tokens")
    result = asyncio.run(measure(args, args.tokens))
    if args.split:
        other = asyncio.run(measure(args, args.split))
        result = split(result, other)
    emit(result, args.out)


if __name__ == "__main__":
    main()
