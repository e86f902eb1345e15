"""service_bench's split of a level's wall time: the event loop's thread on a CPU, waiting for one,
and PostgreSQL's processes (bench/service_stack.py)."""

from __future__ import annotations

import math
import os
import time

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


def test_a_process_id_reused_counts_from_zero_and_missing_counts_are_nan() -> None:
    shares = sched_shares((None, {10: 900_000_000}), ((5, 5), {10: 100_000_000}), 1.0)
    assert shares["postgres_cpu_pct"] == pytest.approx(10.0)  # a new process under an old id
    assert math.isnan(shares["loop_thread_cpu_pct"])


def test_the_readings_of_this_process() -> None:
    before = loop_thread_sched(os.getpid())
    assert before is not None
    # The kernel moves a thread's count at a clock tick or a switch: run past a few ticks of
    # this thread's own time, then let it be switched out.
    start = time.thread_time()
    while time.thread_time() - start < 0.03:
        pass
    time.sleep(0.001)
    after = loop_thread_sched(os.getpid())
    assert after is not None
    assert after[0] > before[0] >= 0
    assert after[1] >= before[1] >= 0
    assert all(ns >= 0 for ns in postgres_cpu().values())
