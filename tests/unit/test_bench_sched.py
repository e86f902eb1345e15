"""service_bench's split of a level's wall time: the event loop's thread on a CPU, waiting for one,
and PostgreSQL's processes (bench/service_stack.py)."""

from __future__ import annotations

import os

import pytest

from bench.service_stack import loop_thread_sched, postgres_cpu, sched_shares


def test_shares_of_the_wall_time() -> None:
    before = ((1_000_000_000, 100_000_000), {10: 500_000_000, 11: 0})
    # Over 2 s: the loop's thread ran 1.8 s and waited 0.1 s; process 10 ran 0.3 s, 11 ran 0.1 s,
    # and 12 started meanwhile and ran 0.2 s (counted from zero). 13 was gone by the end.
    after = ((2_800_000_000, 300_000_000), {10: 800_000_000, 11: 100_000_000, 12: 200_000_000})
    shares = sched_shares(before, after, 2.0)
    assert shares["loop_thread_cpu_pct"] == pytest.approx(90.0)
    assert shares["loop_thread_runqueue_pct"] == pytest.approx(10.0)
    assert shares["postgres_cpu_pct"] == pytest.approx(30.0)


def test_the_readings_of_this_process() -> None:
    on_cpu, waiting = loop_thread_sched(os.getpid())
    sum(range(200_000))  # some CPU time for this thread
    assert loop_thread_sched(os.getpid())[0] > on_cpu >= 0
    assert waiting >= 0
    assert all(ns >= 0 for ns in postgres_cpu().values())
