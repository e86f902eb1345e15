"""bench/instructions.py reads the instruction counts of callgrind's dumps."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from app.streaming.bus import StoredEvent
from bench.instructions import ablate_env, instructions, main, split

ABLATE_DIR = Path(__file__).resolve().parents[2] / "bench" / "ablate"

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


def test_two_run_lengths_split_into_a_runs_fixed_part_and_each_tokens() -> None:
    fixed, marginal = 40_000_000, 300_000
    points = [
        {"tokens_per_run": n, "instructions_per_run": fixed + marginal * n, "subject": "agentstream"}
        for n in (100, 400)
    ]

    result = split(points[0], points[1])

    assert result["instructions_per_token_marginal"] == marginal
    assert result["instructions_per_run_fixed"] == fixed
    assert result["subject"] == "agentstream"
    assert "instructions_per_run" not in result  # a point's figure, not the subject's
    with pytest.raises(SystemExit):
        split(points[0], points[0])


def _ablate_module() -> ModuleType:
    path = ABLATE_DIR / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("bench_ablate_sitecustomize", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no BENCH_ABLATE here: installs nothing
    return module


def test_the_ablations_take_out_the_store_and_redis_and_refuse_an_unknown_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from app.db.repositories.events import EventRepo

    monkeypatch.delenv("BENCH_ABLATE", raising=False)
    module = _ablate_module()
    monkeypatch.setattr(EventRepo, "save", EventRepo.save)  # put back after the test
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    saved = EventRepo.save

    with pytest.raises(SystemExit, match="cache"):
        module._install(["cache"])
    assert EventRepo.save is saved

    module._install(["store", "redis"])

    assert EventRepo.save is not saved
    event = StoredEvent("1-0", "answer", "{}", "r1", None)
    assert asyncio.run(EventRepo.save(object(), "c1", [event])) is None  # type: ignore[arg-type]
    assert "REDIS_URL" not in os.environ


def test_the_workers_get_the_ablations_folder_and_names_only_when_asked() -> None:
    assert ablate_env("") == {}
    env = ablate_env("store,redis")
    assert env["BENCH_ABLATE"] == "store,redis"
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith(os.path.join("bench", "ablate"))


@pytest.mark.parametrize(("names", "status"), [("cache", 3), ("store,redis", 0)])
def test_a_uvicorn_process_that_cannot_take_out_what_it_was_asked_to_exits_at_once(
    tmp_path: Path, names: str, status: int
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ABLATE_DIR), "BENCH_ABLATE": names}
    done = subprocess.run(
        [sys.executable, "-m", "uvicorn", "--version"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == status, done.stderr
    assert ("could not take out" in done.stderr) == (status != 0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--floor", "--ablate", "store"],
        ["--guarded", "--ablate", "redis"],
        ["--floor", "--guarded"],
        ["--guarded", "--db", "postgres"],
        ["--ablate", "store,cache"],
        ["--tokens", "100", "--split", "100"],
    ],
)
def test_flags_that_cannot_measure_anything_are_refused_before_measuring(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(argv)  # would start a worker under valgrind if it got that far

    assert refused.value.code == 2
