"""``scripts/load.py``: its checker catches lost, repeated and altered events, and a tiny load
(5 conversations x 2 runs over two workers, SQLite and Redis) runs clean end to end."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

from tests.support.services import REDIS_URL, unavailable

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "load.py"


def load_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("agentstream_load_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def events(*ids: str) -> list[tuple[str, str, Any]]:
    return [(i, "done" if n == len(ids) - 1 else "step", {"n": i}) for n, i in enumerate(ids)]


def test_the_checker_counts_lost_repeated_and_altered_events() -> None:
    compare = load_module().compare
    stored = events("1-0", "1-1", "2-0", "3-0")

    clean = compare(stored, stored)
    lost = compare([stored[0], stored[2], stored[3]], stored)
    repeated = compare([stored[0], stored[1], stored[1], stored[2], stored[3]], stored)
    altered = compare([stored[0], ("1-1", "step", {"n": "changed"}), stored[2], stored[3]], stored)
    unfinished = compare(stored[:3], stored[:3])

    assert (clean.lost, clean.duplicated, clean.problems) == (0, 0, [])
    assert (lost.lost, lost.duplicated) == (1, 0) and lost.problems
    assert (repeated.lost, repeated.duplicated) == (0, 1) and repeated.problems
    assert altered.problems == ["events differ from the stored ones (order or content)"]
    assert unfinished.problems and "done" in unfinished.problems[0]


def test_the_script_refuses_anything_but_loopback() -> None:
    with pytest.raises(SystemExit):
        load_module().parse_args(["--redis-url", "redis://10.0.0.1:6379/0"])


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_tiny_load_runs_clean_over_two_workers() -> None:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        unavailable(f"Redis not reachable at {REDIS_URL}: {exc}")

    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *("--conversations", "5", "--runs", "2", "--tokens", "8", "--token-delay", "0.01"),
            *("--max-seconds", "60", "--ramp-seconds", "0.5", "--redis-url", REDIS_URL, "--json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["runs"] == 10 and summary["errors"] == 0
    assert summary["lost"] == 0 and summary["duplicated"] == 0
    assert summary["events"] > 10 * 5
    assert summary["reconnects"] >= 10  # two drops a run, resumed on the other worker
    assert summary["interrupts"]["queued"] + summary["interrupts"]["after_the_run"] == 10
    assert summary["latency_ms"]["start run"]["n"] == 10
    assert "errors 0  lost 0  duplicated 0" in result.stdout
