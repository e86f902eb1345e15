"""Server-Sent Events wire encoding of stored events.

The publisher encodes an event's JSON once; here it only gets framed. ``encode_event`` is the cheap
raw-bytes path (``id:``/``event:``/``data:`` lines, blank line); ``to_server_sent_event`` builds the
equivalent sse-starlette object for a route that prefers it.
"""

from __future__ import annotations

import re

from sse_starlette import ServerSentEvent

from app.streaming.bus import StoredEvent

PING = b": ping\n\n"

# CR, LF and NUL would end an SSE line or confuse a client. orjson escapes them inside strings and
# never emits them between tokens, so they only come from JSON made elsewhere. In valid JSON a raw
# CR/LF can only be whitespace between tokens, so a space keeps the JSON equal; a raw NUL is invalid
# anywhere, and its escape is right if it sat in a string.
# U+0085, U+2028 and U+2029 end a line for readers that split like ``str.splitlines()`` (httpx's
# ``iter_lines``, so many Python SSE clients, our CLI among them). orjson leaves them raw inside
# strings, the only place they can be; their JSON escapes keep both the value and the line whole.
_UNSAFE = str.maketrans(
    {
        "\r": " ",
        "\n": " ",
        "\0": "\\u0000",
        "\x85": "\\u0085",
        "\u2028": "\\u2028",
        "\u2029": "\\u2029",
    }
)
# The same three separators in UTF-8 (a lead byte never occurs inside another character).
_SEPARATOR_BYTES = re.compile(rb"\xc2\x85|\xe2\x80[\xa8\xa9]")
_SEPARATOR_ESCAPES = {b"\xc2\x85": b"\\u0085", b"\xe2\x80\xa8": b"\\u2028", b"\xe2\x80\xa9": b"\\u2029"}


def _field(value: str) -> str:
    # Six substring tests, each a scan in C that ends at once for a character wider than any the
    # text holds, rather than the regular expression's test of every character against the set:
    # that was 2 % of a streaming worker's instructions (bench/NOTES.md).
    if (
        "\n" in value
        or "\r" in value
        or "\0" in value
        or "\x85" in value
        or "\u2028" in value
        or "\u2029" in value
    ):
        return value.translate(_UNSAFE)
    return value


def single_line_json(data: bytes) -> bytes:
    """orjson output made safe as one ``data:`` line for any SSE reader (see ``_UNSAFE``)."""
    return _SEPARATOR_BYTES.sub(lambda m: _SEPARATOR_ESCAPES[m.group()], data)


def encode_event(event: StoredEvent) -> bytes:
    """``id: <id>\\nevent: <event>\\ndata: <data>\\n\\n`` as UTF-8, one line per field."""
    return f"id: {_field(event.id)}\nevent: {_field(event.event)}\ndata: {_field(event.data)}\n\n".encode()


def to_server_sent_event(event: StoredEvent) -> ServerSentEvent:
    """The same frame as an sse-starlette ``ServerSentEvent`` (LF line ends, like ``encode_event``)."""
    return ServerSentEvent(data=_field(event.data), event=_field(event.event), id=_field(event.id), sep="\n")
