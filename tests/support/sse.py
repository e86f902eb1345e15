"""A small, strict SSE reader over an httpx stream, for tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class SseEvent:
    id: str | None
    event: str
    data: dict[str, Any]
    raw_data: str


def iter_sse(response: httpx.Response) -> Iterator[SseEvent | str]:
    """Yields events, and comment lines (like ``": ping"``) as plain strings."""
    fields: dict[str, str] = {}
    for line in response.iter_lines():
        if line == "":
            if "data" in fields:
                raw = fields["data"]
                yield SseEvent(fields.get("id"), fields.get("event", "message"), json.loads(raw), raw)
            fields = {}
            continue
        if line.startswith(":"):
            yield line
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name in fields and name == "data":
            raise AssertionError("multi-line data: SSE framing was broken")
        fields[name] = value


def read_events(response: httpx.Response, *, stop_after: int | None = None) -> list[SseEvent]:
    out: list[SseEvent] = []
    for item in iter_sse(response):
        if isinstance(item, SseEvent):
            out.append(item)
            if stop_after is not None and len(out) >= stop_after:
                break
    return out
