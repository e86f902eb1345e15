"""bench/report_capacity.py's instruction counts against the floor (bench/instructions.py --split)."""

from __future__ import annotations

from bench.report_capacity import INSTRUCTION_SUBJECTS, capacity_section, capacity_targets

FLOOR = {"instructions_per_token_marginal": 100_000, "instructions_per_run_fixed": 5_000_000}
ONE = {"instructions_per_token_marginal": 300_000, "instructions_per_run_fixed": 50_000_000}
KNEE = {"tokens_per_run": 250, "subjects": []}  # not the 500 assumed when a knee does not say


def _row(rows: list[tuple[str, str, str, bool | None]]) -> tuple[str, str, str, bool | None]:
    return next(r for r in rows if "instructions" in r[1])


def test_the_ratio_is_per_token_at_the_knees_run_length_fixed_part_included() -> None:
    # floor 100 k + 5 M / 250 = 120 k; AgentStream 300 k + 50 M / 250 = 500 k: 4.17x
    row = _row(capacity_targets(KNEE, None, None, {"floor": FLOOR, "one": ONE, "ablated": None}))

    assert row[2] == "4.17x (500 k / 120 k)"
    assert "250-token runs" in row[1]
    assert row[3] is None  # reported: issue 29's target is CPU time

    section = "\n".join(capacity_section(KNEE, None, None, {"floor": FLOOR, "one": ONE, "ablated": None}))
    assert "| 300.0 k | 50.0 M | 500.0 k | 4.17x |" in section
    assert f"| {INSTRUCTION_SUBJECTS['ablated']} | n/a (did not run) |" in section


def test_a_failed_or_missing_count_gives_no_ratio() -> None:
    failed = {"error": "bench/instructions.py failed"}
    no_fixed = {"instructions_per_token_marginal": 300_000}

    for counts in (
        {"floor": FLOOR, "one": failed},
        {"floor": failed, "one": ONE},
        {"floor": FLOOR, "one": no_fixed},
        {},
    ):
        row = _row(capacity_targets(KNEE, None, None, {"ablated": None, **counts}))
        assert row[2].startswith("n/a")


def test_the_section_says_why_a_count_is_missing() -> None:
    failed = {"error": "bench/instructions.py failed (valgrind installed?)"}

    section = "\n".join(capacity_section(KNEE, None, None, {"floor": failed, "one": ONE, "ablated": None}))

    assert (
        f"| {INSTRUCTION_SUBJECTS['floor']} | n/a (bench/instructions.py failed (valgrind installed?)) |"
        in section
    )
    assert "| 300.0 k | 50.0 M | 500.0 k | n/a |" in section  # no floor, no ratio


def test_one_worker_is_set_against_the_guarded_floor_when_it_was_counted() -> None:
    # guarded 150 k + 10 M / 250 = 190 k; AgentStream 500 k: 2.63x
    guarded = {"instructions_per_token_marginal": 150_000, "instructions_per_run_fixed": 10_000_000}

    with_it = "\n".join(capacity_section(KNEE, None, None, {"floor": FLOOR, "guarded": guarded, "one": ONE}))
    without = "\n".join(capacity_section(KNEE, None, None, {"floor": FLOOR, "guarded": None, "one": ONE}))

    assert "| 150.0 k | 10.0 M | 190.0 k | 1.58x |" in with_it
    assert "the floor with the guarantees kept: 2.63x" in with_it
    assert "guarantees kept: " not in without
    assert f"| {INSTRUCTION_SUBJECTS['guarded']} | n/a (did not run) |" in without
