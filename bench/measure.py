"""Timing one subject's runs: wall and CPU time per run, checked results, JSON on stdout.

Shared by the engine's benchmark (project venv) and the peers' (bench/.venv-peers), so it imports
nothing outside the standard library. Every subject does the same job against the same fake LLM:
``K`` sequential ``add`` tool calls, then an ``N``-token streamed answer.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

QUESTION = "Add one to each number from 0 to 4, one tool call at a time, then tell me about it."
ADD_SCHEMA = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def expected_answer(tokens: int) -> str:
    """The answer the fake LLM streams (tests.support.fake_openai.answer_tokens, restated here so the
    peers' venv needs nothing from the project)."""
    words = ["The", "fake", "model", "streams", "this", "answer", "one", "token", "at", "a", "time."]
    return "".join(("" if i == 0 else " ") + words[i % len(words)] for i in range(tokens))


@dataclass
class RunCheck:
    """What one run did, to check that every subject really did the whole job."""

    tool_calls: int
    answer: str
    deltas: int
    """Answer pieces the subject's caller received (tokens, or coalesced deltas)."""


class WrongResultError(Exception):
    pass


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def arguments(description: str, *, style: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", required=True, help="the fake LLM's base URL (…/v1)")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--max-seconds", type=float, default=120.0, help="stop early after this long")
    if style:
        parser.add_argument("--style", choices=["streamed", "two-phase"], default="streamed")
    return parser.parse_args()


async def measure(
    name: str,
    run_once: Callable[[], Awaitable[RunCheck]],
    args: argparse.Namespace,
    *,
    extra: dict[str, object] | None = None,
) -> dict[str, object]:
    """Warm up, then time ``args.runs`` sequential runs (bounded by ``args.max_seconds``)."""
    expected = expected_answer(args.tokens)

    async def checked() -> RunCheck:
        check = await run_once()
        if check.tool_calls != args.k or check.answer != expected:
            raise WrongResultError(
                f"{name}: expected {args.k} tool calls and the {args.tokens}-token answer, got "
                f"{check.tool_calls} calls and {check.answer[:80]!r}…"
            )
        return check

    for _ in range(args.warmup):
        await checked()
    gc.collect()
    walls: list[float] = []
    cpus: list[float] = []
    deltas = 0
    deadline = time.monotonic() + args.max_seconds
    cpu_total_0 = time.process_time()
    wall_total_0 = time.perf_counter()
    for _ in range(args.runs):
        w0, c0 = time.perf_counter(), time.process_time()
        check = await checked()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        deltas += check.deltas
        if time.monotonic() > deadline:
            break
    n = len(walls)
    result: dict[str, object] = {
        "subject": name,
        "runs": n,
        "k": args.k,
        "tokens": args.tokens,
        "wall_ms_mean": 1000 * (time.perf_counter() - wall_total_0) / n,
        "wall_ms_p50": 1000 * statistics.median(walls),
        "wall_ms_p99": 1000 * percentile(walls, 0.99),
        "cpu_ms_mean": 1000 * (time.process_time() - cpu_total_0) / n,
        "cpu_ms_p50": 1000 * statistics.median(cpus),
        "deltas_per_run": deltas / n,
        "python": sys.version.split()[0],
    }
    if extra:
        result.update(extra)
    return result


def emit(result: object, out: str = "") -> None:
    """A bench script's result: one JSON line on stdout, and the same in the file ``out`` if named."""
    text = json.dumps(result, default=str)
    print(text, flush=True)
    if out:
        Path(out).write_text(text + "\n")
