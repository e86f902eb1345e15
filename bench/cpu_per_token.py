"""A worker's CPU time per streamed token at a steady load, split into user and system time.

Where ``bench/instructions.py`` counts user-space instructions (repeatable, but blind to the kernel),
this reads the worker's own user and system time from ``/proc`` over a number of complete runs: the
figure the knee's "CPU per token" is, without the knee's stepping. The worker is pinned to CPU 0 and
this process (the load generator) to CPU 1, as in ``capacity_bench knee``; ``--users`` users each
stream runs of ``--tokens`` tokens at 50 tokens/s (one tool call first for AgentStream; the floors
offer no tools), every run read to ``done`` and checked.

``python -m bench.cpu_per_token --subject one|floor|guarded [--users 40] [--runs 80] [--tokens 500]
[--split 100] [--app-path TREE]``

``--split N`` measures ``--split-runs`` runs of ``N`` tokens too (twice ``--runs`` by default)
and splits the time into each token's marginal part and a run's fixed part, as
``bench/instructions.py --split`` does with instructions. CPU time on these machines moves by
10-20 % between runs of the same code: compare subjects interleaved, two rounds or more
(bench/NOTES.md, sixth session).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.capacity_bench import FLOOR, GUARDED
from bench.capacity_client import Level
from bench.fakellm import timed_args
from bench.instructions import stream_runs
from bench.measure import emit
from bench.service_stack import Stack

SUBJECTS = {"one": "app.main:create_app", "floor": FLOOR, "guarded": GUARDED}
TOKEN_INTERVAL_S = 0.02


def cpu_seconds(stat: str) -> tuple[float, float]:
    """(user, system) seconds from the text of ``/proc/<pid>/stat``."""
    fields = stat.rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def _cpu(pid: int) -> tuple[float, float]:
    return cpu_seconds(Path(f"/proc/{pid}/stat").read_text())


def _pin(pid: int, cpu: int) -> None:
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {cpu})


async def measure(args: argparse.Namespace, tokens: int, runs: int) -> dict[str, Any]:
    """One point: ``runs`` runs of ``tokens`` tokens after a round of warm-up runs."""
    os.sched_setaffinity(0, {1})
    k = 1 if args.subject == "one" else 0
    env = {"MAX_ACTIVE_RUNS": "1000", "STREAM_RETENTION_S": "120"}
    async with Stack(
        timed_args(k, tokens, TOKEN_INTERVAL_S, "calculator"),
        workers=1,
        env=env,
        factory=SUBJECTS[args.subject],
        app_path=args.app_path or None,
    ) as stack:
        port, pid = stack.workers[0][1], stack.pids[0]
        _pin(pid, 0)
        warm = Level(args.users, tokens, 1 / TOKEN_INTERVAL_S, 0, 0, 0)
        await stream_runs(port, warm, args.users, args.users)
        user0, system0 = _cpu(pid)
        level = Level(args.users, tokens, 1 / TOKEN_INTERVAL_S, 0, 0, 0)
        await stream_runs(port, level, runs, args.users)
        user1, system1 = _cpu(pid)
    if level.runs_good != runs or warm.runs_good != args.users:
        raise SystemExit(f"runs failed: {level.problems} {level.examples}")
    streamed = runs * tokens
    return {
        "tokens_per_run": tokens,
        "runs": runs,
        "user_us_per_token": round(1e6 * (user1 - user0) / streamed, 1),
        "system_us_per_token": round(1e6 * (system1 - system0) / streamed, 1),
        "cpu_us_per_token": round(1e6 * (user1 - user0 + system1 - system0) / streamed, 1),
    }


def split(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Two points at two run lengths as each token's marginal CPU and a run's fixed CPU."""
    n_a, n_b = a["tokens_per_run"], b["tokens_per_run"]
    per_run_a, per_run_b = a["cpu_us_per_token"] * n_a, b["cpu_us_per_token"] * n_b
    marginal = (per_run_a - per_run_b) / (n_a - n_b)
    return {
        "cpu_us_per_token_marginal": round(marginal, 1),
        "cpu_ms_per_run_fixed": round((per_run_b - marginal * n_b) / 1000, 2),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--subject", choices=list(SUBJECTS), default="one")
    parser.add_argument("--users", type=int, default=40, help="runs streaming at once")
    parser.add_argument("--runs", type=int, default=80, help="measured runs")
    parser.add_argument("--tokens", type=int, default=500, help="answer tokens per run")
    parser.add_argument("--split", type=int, default=0, help="a second run length, for the split")
    parser.add_argument("--split-runs", type=int, default=0, help="runs at the second length")
    parser.add_argument("--app-path", default="", help="AgentStream's app/ from this tree (--subject one)")
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.app_path and args.subject != "one":
        parser.error("--app-path names AgentStream's tree; a floor is this tree's bench/peers")
    if args.split and args.split == args.tokens:
        parser.error("--split needs a run length other than --tokens")
    result: dict[str, Any] = {"scenario": "cpu_per_token", "subject": args.subject, "users": args.users}
    result["points"] = [asyncio.run(measure(args, args.tokens, args.runs))]
    if args.split:
        runs = args.split_runs or 2 * args.runs
        result["points"].append(asyncio.run(measure(args, args.split, runs)))
        result |= split(*result["points"])
    emit(result, args.out)


if __name__ == "__main__":
    main()
