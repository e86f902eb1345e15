"""What becomes of a tool call on its way in and out of the loop: the arguments the model sent,
decoded (E-27), and the result as the model reads it (E-26) and as an event shows it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from app.engine import prompts
from app.tools.registry import ToolResult

EVENT_OBSERVATION_CHARS = 8000
"""IterationDone carries at most this much of an observation; the LLM still sees all of it."""


def cap_observation(text: str, limit: int = EVENT_OBSERVATION_CHARS) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n… [truncated {len(text) - limit} characters for display]"


def artifact_payload(result: ToolResult) -> dict[str, str] | None:
    """The artifact as the UI previews it (its full body), for IterationDone."""
    a = result.artifact
    if a is None or result.error is not None:
        return None
    return {"filename": a.filename, "mime_type": a.mime_type, "content": a.content}


def observation_of(result: ToolResult) -> str:
    """The text the LLM sees for a tool result (E-26): errors say so, artifacts become a marker."""
    if result.error is not None:
        return f"Error: {result.error}"
    if result.artifact is not None:
        note = result.content.strip() if result.content != result.artifact.content else ""
        return prompts.artifact_observation(result.artifact.filename, note)
    return result.content if result.content.strip() else "(the tool returned no output)"


def json_args_error(tool_name: str, raw: str, problem: str) -> str:
    shown = raw if len(raw) <= 200 else raw[:199] + "…"
    return f"Invalid arguments for tool '{tool_name}': {problem}. Received: {shown}"


def decode_args(tool_name: str, raw: object) -> tuple[dict[str, Any], str | None]:
    """Tool arguments the model sent (JSON text or an object) -> (args, error) (E-27)."""
    if raw is None:
        return {}, None
    if isinstance(raw, Mapping):
        return dict(raw), None
    if isinstance(raw, str):
        if not raw.strip():
            return {}, None
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            return {}, json_args_error(tool_name, raw, f"not valid JSON ({exc})")
        if isinstance(value, dict):
            return value, None
        return {}, json_args_error(tool_name, raw, "expected a JSON object")
    return {}, json_args_error(tool_name, repr(raw), "expected a JSON object")
