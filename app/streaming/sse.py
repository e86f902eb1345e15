"""Server-Sent Events wire encoding of stored events.

The publisher encodes an event's JSON once; here it only gets framed. ``encode_event`` is the cheap
raw-bytes path (``id:``/``event:``/``data:`` lines, blank line); ``to_server_sent_event`` builds the
equivalent sse-starlette object for a route that prefers it.
"""

from __future__ import annotations

from sse_starlette import ServerSentEvent

from app.streaming.bus import StoredEvent

PING = b": ping\n\n"

# CR, LF and NUL would end an SSE line or confuse a client. orjson escapes them inside strings and
# never emits them between tokens, so this only fires on JSON made elsewhere. In valid JSON a raw
# CR/LF can only be whitespace between tokens, so a space keeps the JSON equal; a raw NUL is invalid
# anywhere, and its escape is right if it sat in a string.
_UNSAFE = str.maketrans({"\r": " ", "\n": " ", "\0": "\\u0000"})


def _field(value: str) -> str:
    if "\n" in value or "\r" in value or "\0" in value:
        return value.translate(_UNSAFE)
    return value


def encode_event(event: StoredEvent) -> bytes:
    """``id: <id>\\nevent: <event>\\ndata: <data>\\n\\n`` as UTF-8, one line per field."""
    return f"id: {_field(event.id)}\nevent: {_field(event.event)}\ndata: {_field(event.data)}\n\n".encode()


def to_server_sent_event(event: StoredEvent) -> ServerSentEvent:
    """The same frame as an sse-starlette ``ServerSentEvent`` (LF line ends, like ``encode_event``)."""
    return ServerSentEvent(data=_field(event.data), event=_field(event.event), id=_field(event.id), sep="\n")
