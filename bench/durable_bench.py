"""Durable runs: what checkpointing costs a run, and how soon a run lives on after its worker.

The command line of two benchmarks, each printing one JSON object on stdout:

* ``checkpoints`` (``bench/durable_cost.py``): the worker's CPU per HTTP run, the database work per
  run and iteration 50 against iteration 1, with checkpoints, against the baseline commit (the last
  one before durable runs, ``eaaa192``, checked out in a temporary git worktree); baseline and new
  interleaved round by round in one invocation;
* ``resume`` (``bench/durable_resume.py``): uvicorn workers on PostgreSQL and Redis, a run in
  flight followed through another worker's stream; the time from its worker's end (SIGKILL, a
  lease that runs out, SIGTERM) to the ``resumed`` phase event arriving at the client.

What the two share is in ``bench/durable_common.py``. Loopback only; every loop is bounded in count
and time; the child processes are stopped by pid (or by the process group of a child started in a
session of its own) when the script ends, also on errors. Run from the repository root::

    .venv/bin/python -m bench.durable_bench checkpoints [--quick]
    .venv/bin/python -m bench.durable_bench resume [--quick]

``SUBCOMMAND --help`` describes each in full.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from typing import Any

from bench import durable_cost, durable_resume
from bench.measure import emit


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "checkpoints",
        help="checkpoint cost: baseline against new, one invocation",
        description=durable_cost.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--baseline", default=durable_cost.BASELINE)
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--http-runs", type=int, default=100)
    c.add_argument("--http-warmup", type=int, default=10)
    c.add_argument("--db-runs", type=int, default=200)
    c.add_argument("--db-warmup", type=int, default=20)
    c.add_argument("--dbs", nargs="+", choices=["sqlite", "postgres"], default=["sqlite", "postgres"])
    c.add_argument("--iterations", type=int, default=50)
    c.add_argument("--scale-repeats", type=int, default=20)
    c.add_argument("--max-seconds", type=float, default=600, help="no new round after this long")
    c.add_argument(
        "--parts",
        nargs="+",
        choices=["http", "dbwork", "scaling"],
        default=["http", "dbwork", "scaling"],
        help="measure only these (e.g. more rounds of one part)",
    )
    r = sub.add_parser(
        "resume",
        help="time from a worker's end to the resumed event at the client",
        description=durable_resume.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("--kills", type=int, default=20, help="SIGKILL rounds")
    r.add_argument("--leases", type=int, default=20, help="rounds of a run whose other-host lease runs out")
    r.add_argument("--terms", type=int, default=20, help="SIGTERM rounds")
    r.add_argument("--run-lease-s", type=float, default=6.0, help="the workers' RUN_LEASE_S")
    r.add_argument("--other-lease-s", type=float, default=1.0, help="lease of the other host's run")
    r.add_argument("--grace-s", type=float, default=0.2, help="the workers' SHUTDOWN_GRACE_S")
    r.add_argument("--tokens", type=int, default=100)
    r.add_argument("--delay-s", type=float, default=0.01)
    r.add_argument("--jitter-s", type=float, default=0.3)
    r.add_argument("--poll-s", type=float, default=0.003)
    r.add_argument("--max-restarts", type=int, default=0, help="default: kills + terms + 5")
    r.add_argument("--max-seconds", type=float, default=420)
    for p in (c, r):
        p.add_argument("--quick", action="store_true", help="fewer rounds and runs")
    args = parser.parse_args(argv)
    if args.quick and args.command == "checkpoints":
        args.rounds, args.http_runs, args.db_runs, args.scale_repeats = 2, 30, 60, 6
    if args.quick and args.command == "resume":
        args.kills = args.leases = args.terms = 5
    if args.command == "resume" and not args.max_restarts:
        args.max_restarts = args.kills + args.terms + 5

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # so that the finally blocks stop the children

    signal.signal(signal.SIGTERM, stop)
    if args.command == "checkpoints":
        emit(durable_cost.cmd_checkpoints(args))
    else:
        emit(asyncio.run(durable_resume.resume(args)))


if __name__ == "__main__":
    main(sys.argv[1:])
