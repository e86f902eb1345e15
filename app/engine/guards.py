"""Deterministic guards against drift in the tool loop (E-19, E-20, E-21).

Each guard is a small state machine that the loop creates afresh for every run, so nothing carries
over between runs (a new attempt of the same run starts them from its checkpoint). They only decide
*whether* to nudge the model; the texts live in ``prompts``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from app.engine import prompts


def call_fingerprint(tool_name: str, args: Mapping[str, Any]) -> str:
    """A stable hash of a call: key order and whitespace in the arguments do not matter."""
    canonical = json.dumps(
        {"tool": tool_name, "args": args},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        default=repr,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class CycleDetector:
    """E-20: counts identical ``(tool, arguments)`` calls and warns once a call repeats too often.

    The warning repeats (with the new count) for every further identical call, because a model that
    ignored it once tends to keep looping.
    """

    def __init__(self, threshold: int, *, counts: dict[str, int] | None = None) -> None:
        self._threshold = max(1, threshold)
        # Shared with the caller (the loop's state), which checkpoints it.
        self._counts: dict[str, int] = counts if counts is not None else {}

    def record(self, tool_name: str, args: Mapping[str, Any]) -> str | None:
        """Count one executed call; returns the warning to inject, or None."""
        key = call_fingerprint(tool_name, args)
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        if count >= self._threshold:
            return prompts.cycle_warning(tool_name, count)
        return None


class ReflectionSchedule:
    """E-19: a reflection is due each time the number of real tool calls crosses a multiple of N.

    Native mode may run several calls in one reply; crossing the boundary inside such a batch still
    yields a single reflection, placed after all of the batch's results.
    """

    def __init__(self, interval: int, *, tool_calls: int = 0) -> None:
        self._interval = max(1, interval)
        self.tool_calls = tool_calls

    def record(self, real_calls: int) -> bool:
        before = self.tool_calls
        self.tool_calls += real_calls
        return self.tool_calls // self._interval > before // self._interval


class CompletionChecklist:
    """E-21: at most one verification prompt per run, and only after enough tools were used."""

    def __init__(self, *, enabled: bool, min_tools: int, fired: bool = False) -> None:
        self._enabled = enabled
        self._min_tools = max(1, min_tools)
        self.fired = fired

    def should_fire(self, tools_used: int) -> bool:
        """True exactly once per run, when the model signals done with enough tools used."""
        if not self._enabled or self.fired or tools_used < self._min_tools:
            return False
        self.fired = True
        return True
