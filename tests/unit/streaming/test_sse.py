"""SSE framing of stored events: exact bytes, and no payload can break a frame."""

from __future__ import annotations

import orjson
import pytest

from app.streaming.bus import StoredEvent
from app.streaming.sse import PING, encode_event, to_server_sent_event


def frames(raw: bytes) -> list[dict[str, str]]:
    """Parse an SSE byte stream the way a browser does (fields per line, blank line ends a frame)."""
    out: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in raw.decode().split("\n"):
        if line == "":
            if current:
                out.append(current)
            current = {}
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(": ")
        current[field] = current[field] + "\n" + value if field in current else value
    return out


def test_an_event_is_framed_as_id_event_data_and_a_blank_line() -> None:
    event = StoredEvent("1700000000000-2", "answer", '{"status":"delta","content":"hi","run_id":"r"}', "r")
    assert encode_event(event) == (
        b'id: 1700000000000-2\nevent: answer\ndata: {"status":"delta","content":"hi","run_id":"r"}\n\n'
    )


@pytest.mark.parametrize(
    "content", ["line1\nline2", "cr\rhere", "crlf\r\n", "nul\x00byte", "\n\n\n", "é😀\u2028"]
)
def test_control_characters_in_content_never_break_framing(content: str) -> None:
    data = orjson.dumps({"status": "delta", "content": content, "run_id": "r"}).decode()
    raw = encode_event(StoredEvent("5-0", "answer", data, "r"))
    parsed = frames(raw)
    assert len(parsed) == 1
    assert parsed[0]["id"] == "5-0" and parsed[0]["event"] == "answer"
    assert orjson.loads(parsed[0]["data"])["content"] == content


def test_raw_line_breaks_and_nul_in_data_made_elsewhere_are_neutralised() -> None:
    raw = encode_event(StoredEvent("5-0", "step", '{"a":\r\n1,\n"b":"x\x00y"}', "r"))
    assert raw.count(b"\n\n") == 1 and raw.endswith(b"\n\n")
    assert b"\r" not in raw and b"\x00" not in raw
    parsed = frames(raw)
    assert orjson.loads(parsed[0]["data"]) == {"a": 1, "b": "x\x00y"}


def test_ping_is_a_comment_line() -> None:
    assert PING == b": ping\n\n"
    assert frames(PING) == []


def test_server_sent_event_object_matches_the_raw_frame() -> None:
    event = StoredEvent("7-1", "done", '{"answer":"a\\nb","run_id":"r"}', "r")
    encoded = to_server_sent_event(event).encode()
    assert frames(encoded) == frames(encode_event(event))
