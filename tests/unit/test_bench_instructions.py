"""bench/instructions.py reads the instruction counts of callgrind's dumps."""

from __future__ import annotations

from pathlib import Path

from bench.instructions import instructions

DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: {pid}
events: Ir
summary: {ir}

fn=(1) main
0 {ir}
totals: {ir}
"""


def test_the_counts_of_every_dump_are_added(tmp_path: Path) -> None:
    (tmp_path / "callgrind.out.41").write_text(DUMP.format(pid=41, ir=0))  # before counting began
    (tmp_path / "callgrind.out.41.1").write_text(DUMP.format(pid=41, ir=1_234_567))
    (tmp_path / "other.txt").write_text("totals: 99\n")

    assert instructions(tmp_path) == 1_234_567


def test_no_dump_is_no_count(tmp_path: Path) -> None:
    assert instructions(tmp_path) == 0
