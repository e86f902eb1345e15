"""The CLI's SSE line parser and the decoded ``ServerEvent``."""

from __future__ import annotations

from app.cli.sse import ServerEvent, SSEEvent, SSEParser


def feed_all(parser: SSEParser, text: str) -> list[SSEEvent]:
    return [event for line in text.split("\n") if (event := parser.feed(line)) is not None]


def test_parser_dispatches_an_event_on_the_blank_line_with_id_name_and_data() -> None:
    parser = SSEParser()
    events = feed_all(parser, 'id: 17-0\nevent: step\ndata: {"type": "thinking"}\n\n')
    assert events == [SSEEvent(event="step", data='{"type": "thinking"}', id="17-0")]
    assert parser.last_event_id == "17-0"


def test_parser_ignores_ping_comments_between_events() -> None:
    parser = SSEParser()
    events = feed_all(parser, ": ping\n\nid: 1-0\nevent: answer\ndata: {}\n\n: ping\n\n")
    assert [e.id for e in events] == ["1-0"]


def test_parser_joins_multi_line_data_with_newlines() -> None:
    events = feed_all(SSEParser(), "data: first\ndata: second\n\n")
    assert events == [SSEEvent(event="message", data="first\nsecond")]


def test_parser_strips_only_one_leading_space_and_accepts_carriage_returns() -> None:
    events = feed_all(SSEParser(), "event:answer\r\ndata:  two spaces\r\n\r\n")
    assert events == [SSEEvent(event="answer", data=" two spaces")]


def test_parser_keeps_the_last_id_across_events_without_one() -> None:
    parser = SSEParser()
    events = feed_all(parser, "id: 5-1\ndata: a\n\ndata: b\n\n")
    assert [e.id for e in events] == ["5-1", None]
    assert parser.last_event_id == "5-1"


def test_parser_dispatches_nothing_for_a_block_without_data_but_moves_the_cursor() -> None:
    parser = SSEParser()
    assert feed_all(parser, "id: 9-0\nevent: step\n\n") == []
    assert parser.last_event_id == "9-0"


def test_parser_ignores_retry_and_unknown_fields() -> None:
    assert feed_all(SSEParser(), "retry: 1000\nfoo: bar\n\n") == []


def test_parser_rejects_ids_containing_nul() -> None:
    parser = SSEParser()
    events = feed_all(parser, "id: 1-0\ndata: a\n\nid: bad\0id\ndata: b\n\n")
    assert [e.id for e in events] == ["1-0", None]
    assert parser.last_event_id == "1-0"


def test_server_event_decodes_json_payload_and_exposes_run_id() -> None:
    event = ServerEvent.from_sse(
        SSEEvent(event="done", data='{"run_id": "r1", "status": "completed"}', id="3-0")
    )
    assert event.data == {"run_id": "r1", "status": "completed"}
    assert event.run_id == "r1"


def test_server_event_keeps_non_json_data_verbatim() -> None:
    event = ServerEvent.from_sse(SSEEvent(event="step", data="not json"))
    assert event.data == {"raw": "not json"}
    assert event.run_id is None


def test_server_event_from_stored_record_accepts_data_as_text_or_object() -> None:
    as_text = ServerEvent.from_record({"id": "1-0", "event": "inject", "data": '{"content": "x"}'})
    as_object = ServerEvent.from_record({"id": "1-0", "event": "inject", "data": {"content": "x"}})
    assert as_text == as_object == ServerEvent(event="inject", data={"content": "x"}, id="1-0")


def test_server_event_json_line_has_the_stored_events_shape() -> None:
    line = ServerEvent(event="answer", data={"status": "delta", "content": "é"}, id="2-0").json_line()
    assert line == '{"id": "2-0", "event": "answer", "data": {"status": "delta", "content": "é"}}'
