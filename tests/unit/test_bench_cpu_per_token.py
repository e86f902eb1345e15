"""bench/cpu_per_token.py reads a process's CPU time and splits two run lengths into parts."""

from __future__ import annotations

import os

import pytest

from bench.cpu_per_token import cpu_seconds, main, split


def test_user_and_system_time_are_read_past_a_name_with_spaces_and_parentheses() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    fields = ["S", *["0"] * 10, str(3 * ticks), str(ticks // 2), *["0"] * 30]
    stat = "4242 (python -m uvicorn (x)) " + " ".join(fields)

    assert cpu_seconds(stat) == (3.0, (ticks // 2) / ticks)


def test_two_run_lengths_split_into_each_tokens_marginal_and_a_runs_fixed_cpu() -> None:
    # 500-token runs at 60 µs a token and 100-token runs at 100: 30,000 and 10,000 µs a run, so
    # 50 µs a token and 5 ms a run.
    long = {"tokens_per_run": 500, "cpu_us_per_token": 60.0}
    short = {"tokens_per_run": 100, "cpu_us_per_token": 100.0}

    assert split(long, short) == {"cpu_us_per_token_marginal": 50.0, "cpu_ms_per_run_fixed": 5.0}


@pytest.mark.parametrize(
    "argv", [["--subject", "floor", "--app-path", "/tmp/x"], ["--tokens", "100", "--split", "100"]]
)
def test_flags_that_cannot_measure_anything_are_refused_before_measuring(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(argv)  # would start a worker if it got that far
    assert refused.value.code == 2
