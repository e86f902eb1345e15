"""Where a worker's CPU goes while it streams: a py-spy profile (raw, collapsed stacks) in categories.

Each sample (a stack, while the worker held the GIL) goes to the first category whose pattern one
of its frames matches, in the order of ``CATEGORIES``: database work wherever it happens, then the
bus's writer (XADD), the bus's reader and fan-out (XREAD), the SSE responses, the LLM client's
streamed read and parse, the tool loop's non-streaming calls, the publisher, the engine, the other
HTTP requests (create a conversation, start a run), and the rest (event loop, GC). Start-up
(imports, the lifespan) is left out. Figures per category: share of the samples, and, given the
tokens and runs the profile covers, µs per token and ms per run (samples x the sampling interval).

``top_frames``: the app's functions the most samples pass through (for ``burst``'s profile).

``python -m bench.capacity_profile FILE.folded --tokens N --runs R [--rate 100]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("startup", ("import_from_string", "lifespan (app/main.py", "_find_and_load")),
    ("database (SQLAlchemy, driver, repositories)", ("sqlalchemy/", "aiosqlite/", "asyncpg/", "app/db/")),
    (
        "Redis XADD (bus writer)",
        ("StreamWriter._run (app/streaming/redis_streams.py", "_Writer.", "RedisEventBus.append"),
    ),
    (
        "Redis XREAD and fan-out to followers",
        ("_StreamReader.", "RedisStreamsBus.follow", "Follower.", "Subscription."),
    ),
    (
        "SSE write (stream route, encoding, send)",
        (
            "app/api/sse_response.py",
            "app/api/routes/stream.py",
            "app/streaming/resume.py",
            "app/streaming/sse.py",
        ),
    ),
    (
        "LLM streamed read and parse",
        ("app/llm/stream_read.py", "OpenAICompatibleLLM.stream_chat", "InstrumentedLLM.stream_chat"),
    ),
    ("LLM calls of the tool loop", ("OpenAICompatibleLLM.chat", "InstrumentedLLM.chat", "aiohttp/")),
    ("publish and encode", ("app/streaming/publisher.py", "app/streaming/store_writer.py")),
    ("engine and run lifecycle (other)", ("app/engine/", "app/runs/")),
    ("other HTTP requests (create, start, ...)", ("app/api/", "fastapi/", "starlette/", "uvicorn/protocols")),
]
OTHER = "event loop, GC and the rest"


def categorize(folded: Path) -> dict[str, int]:
    counts: dict[str, int] = {name: 0 for name, _ in CATEGORIES}
    counts[OTHER] = 0
    for line in folded.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        for name, patterns in CATEGORIES:
            if any(p in stack for p in patterns):
                counts[name] += int(n)
                break
        else:
            counts[OTHER] += int(n)
    return counts


def summarize(folded: Path, tokens: int, runs: int, rate_hz: float = 100.0) -> dict[str, Any]:
    counts = categorize(folded)
    counts.pop("startup")
    total = sum(counts.values()) or 1
    interval_us = 1e6 / rate_hz
    rows = {
        name: {
            "share_pct": round(100 * n / total, 1),
            "us_per_token": round(n * interval_us / max(1, tokens), 1),
            "ms_per_run": round(n * interval_us / 1000 / max(1, runs), 2),
        }
        for name, n in sorted(counts.items(), key=lambda kv: -kv[1])
    }
    return {
        "samples": total,
        "sampled_cpu_s": total * interval_us / 1e6,
        "tokens": tokens,
        "runs": runs,
        "us_per_token_all": round(total * interval_us / max(1, tokens), 1),
        "categories": rows,
        "note": "samples while the worker held the GIL (py-spy --gil), start-up left out; a sample "
        "goes to the first category that matches one of its frames",
    }


def top_frames(folded: Path, within: str = "app/", most: int = 20) -> list[tuple[str, float]]:
    """The functions of files under ``within`` that the most samples pass through (start-up left
    out), with their share of the samples in %."""
    startup = CATEGORIES[0][1]
    seen_in: dict[str, int] = {}
    total = 0
    for line in folded.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit() or any(p in stack for p in startup):
            continue
        total += int(n)
        names = {frame.rsplit(":", 1)[0] + ")" for frame in stack.split(";") if within in frame}
        for name in names:
            seen_in[name] = seen_in.get(name, 0) + int(n)
    ranked = sorted(seen_in.items(), key=lambda kv: -kv[1])[:most]
    return [(name, round(100 * n / max(1, total), 1)) for name, n in ranked]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folded")
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--runs", type=int, required=True)
    parser.add_argument("--rate", type=float, default=100.0)
    args = parser.parse_args()
    print(json.dumps(summarize(Path(args.folded), args.tokens, args.runs, args.rate), indent=1))


if __name__ == "__main__":
    main()
