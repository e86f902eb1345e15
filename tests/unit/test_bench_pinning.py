"""The knee benchmark's load generator pins only its own threads (bench/capacity_procs.py): the
processes under test are its children and must stay on the CPU they were given."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.capacity_procs import load_generator_on, pin

CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to tell them apart")
def test_the_load_generator_pins_itself_and_not_the_workers_it_started() -> None:
    worker = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        pin(worker.pid, {CPUS[0]})
        with load_generator_on({CPUS[1]}):
            assert os.sched_getaffinity(0) == {CPUS[1]}
            assert os.sched_getaffinity(worker.pid) == {CPUS[0]}  # the child keeps its own CPU
        assert os.sched_getaffinity(0) == set(range(os.cpu_count() or 1))
        assert os.sched_getaffinity(worker.pid) == {CPUS[0]}
    finally:
        worker.kill()
        worker.wait(timeout=10)
