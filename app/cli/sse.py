"""Incremental parser for a ``text/event-stream`` body, fed one line at a time.

It follows the WHATWG event-stream rules the server relies on: ``id``/``event``/``data`` fields,
multi-line ``data`` joined with newlines, ``:`` comment lines (the server's pings) ignored, and an
event dispatched on the blank line that ends it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event; ``id`` is the server's cursor (``None`` if the event carried none)."""

    event: str
    data: str
    id: str | None = None

    def json(self) -> Any:
        """The decoded ``data``; raises ``ValueError`` when it is not JSON."""
        return json.loads(self.data)


class SSEParser:
    """Turns lines into events; keeps the last id seen, which is what a reconnect resumes after."""

    def __init__(self) -> None:
        self.last_event_id: str | None = None
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None
        self._has_fields = False

    def feed(self, line: str) -> SSEEvent | None:
        """Consume one line (without its terminator); return the event a blank line completes."""
        line = line.rstrip("\r\n")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            # The spec ignores ids containing NUL, so a broken server cannot poison the cursor.
            if "\0" not in value:
                self._id = value
        else:
            # ``retry`` and unknown fields do not start an event.
            return None
        self._has_fields = True
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._has_fields:
            return None
        if self._id is not None:
            self.last_event_id = self._id
        event_name, data, event_id = self._event, self._data, self._id
        self._event, self._data, self._id, self._has_fields = "", [], None, False
        if not data:
            # A block without data lines only moves the cursor; the spec dispatches nothing.
            return None
        return SSEEvent(event=event_name or "message", data="\n".join(data), id=event_id)


@dataclass(frozen=True, slots=True)
class ServerEvent:
    """An AgentStream event with its JSON payload decoded, however it was read (stream or store)."""

    event: str
    data: dict[str, Any]
    id: str | None = None

    @classmethod
    def from_sse(cls, raw: SSEEvent) -> ServerEvent:
        return cls(event=raw.event, data=_payload(raw.data), id=raw.id)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ServerEvent:
        """From an item of ``GET /api/runs/{id}/events`` (``data`` as an object or as JSON text)."""
        data = record.get("data")
        payload = _payload(data) if isinstance(data, str) else data
        raw_id = record.get("id")
        return cls(
            event=str(record.get("event", "message")),
            data=payload if isinstance(payload, dict) else {"raw": payload},
            id=None if raw_id is None else str(raw_id),
        )

    @property
    def run_id(self) -> str | None:
        run_id = self.data.get("run_id")
        return run_id if isinstance(run_id, str) else None

    def json_line(self) -> str:
        """The event as one JSON line, shaped like the items of ``/api/runs/{id}/events``."""
        return json.dumps({"id": self.id, "event": self.event, "data": self.data}, ensure_ascii=False)


def _payload(text: str) -> dict[str, Any]:
    # A payload that is not a JSON object is kept verbatim so nothing the server sent is lost.
    try:
        value = json.loads(text)
    except ValueError:
        return {"raw": text}
    return value if isinstance(value, dict) else {"raw": value}
