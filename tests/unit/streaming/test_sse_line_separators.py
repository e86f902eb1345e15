"""SSE framing against every character some reader takes as a line end.

The spec ends lines at CR, LF and CRLF; Python readers that split like ``str.splitlines()``
(httpx's ``iter_lines``, the CLI) also at U+0085, U+2028 and U+2029, which orjson leaves raw.
"""

from __future__ import annotations

import json
import re

import orjson
import pytest

from app.streaming.bus import StoredEvent
from app.streaming.sse import encode_event, single_line_json

TEXTS = [
    "\n\ndata: fake\n\nevent: done\n",
    "a\r\nb\rc",
    "x\u2028data: y\u2029z\x85w",
    "nul\x00",
    "\x0b\x0c\x1c\x1d\x1e",
]


@pytest.mark.parametrize("text", TEXTS)
def test_an_event_is_the_same_four_lines_for_every_reader_and_its_json_unchanged(text: str) -> None:
    data = orjson.dumps({"content": text}).decode()

    frame = encode_event(StoredEvent(id="1-0", event="answer", data=data, run_id="run_x")).decode()

    lines = frame.splitlines()
    assert lines == re.split(r"\r\n|\r|\n", frame)[:-1]
    assert lines[:2] == ["id: 1-0", "event: answer"] and lines[3:] == [""]
    assert json.loads(lines[2].removeprefix("data: ")) == {"content": text}


@pytest.mark.parametrize("text", TEXTS)
def test_single_line_json_keeps_the_value_on_one_line(text: str) -> None:
    raw = single_line_json(orjson.dumps({"content": text, "other": "é ✓"}))

    assert len(raw.decode().splitlines()) == 1
    assert json.loads(raw) == {"content": text, "other": "é ✓"}


def test_single_line_json_leaves_ordinary_json_as_it_is() -> None:
    raw = orjson.dumps({"content": "plain … text ✓ 日本"})

    assert single_line_json(raw) == raw
