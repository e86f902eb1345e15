"""The repositories' pure parts: page cursors and id generation."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

import pytest

from app.db.errors import InvalidCursorError
from app.db.repositories import (
    MessageRecord,
    decode_page_cursor,
    encode_page_cursor,
    new_conversation_id,
    new_run_id,
)
from app.llm.base import ChatMessage, ToolCall


def b64(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def test_page_cursor_round_trips_created_at_and_id() -> None:
    created_at = datetime(2025, 3, 4, 5, 6, 7, 891011, tzinfo=UTC)

    cursor = encode_page_cursor(created_at, "conv_abc")

    assert decode_page_cursor(cursor) == (created_at, "conv_abc")
    assert "=" not in cursor and "conv_abc" not in cursor


@pytest.mark.parametrize(
    "cursor",
    [
        "",
        "!!!",
        b64("not json"),
        b64('{"a": 1}'),
        b64('["2025-01-01T00:00:00+00:00"]'),
        b64('["yesterday", "conv_x"]'),
        b64('["2025-01-01T00:00:00", "conv_x"]'),  # naive: not one we hand out
        b64('["2025-01-01T00:00:00+00:00", 7]'),
        b64("[1, 2]"),
    ],
)
def test_a_cursor_we_did_not_hand_out_is_an_invalid_cursor_error(cursor: str) -> None:
    with pytest.raises(InvalidCursorError):
        decode_page_cursor(cursor)


def test_invalid_cursor_error_is_a_value_error() -> None:
    assert issubclass(InvalidCursorError, ValueError)


def test_ids_are_prefixed_opaque_and_unguessable() -> None:
    conversation_ids = {new_conversation_id() for _ in range(200)}
    run_ids = {new_run_id() for _ in range(200)}

    assert len(conversation_ids) == len(run_ids) == 200
    assert all(i.startswith("conv_") and len(i) == 5 + 22 for i in conversation_ids)
    assert all(i.startswith("run_") and len(i) == 4 + 22 for i in run_ids)


def test_message_record_converts_to_the_chat_message_it_stores() -> None:
    calls = (ToolCall(id="c1", name="calculator", arguments=json.dumps({"expression": "1+1"})),)
    record = MessageRecord(
        id=1,
        conversation_id="conv_x",
        run_id="run_x",
        seq=0,
        role="assistant",
        content=None,
        tool_calls=calls,
        tool_call_id=None,
        name="agent",
        pinned=True,
        created_at=datetime(2025, 1, 1, tzinfo=UTC),
    )

    assert record.to_chat_message() == ChatMessage(
        role="assistant", content=None, tool_calls=calls, name="agent", pinned=True
    )
