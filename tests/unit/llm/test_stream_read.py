"""Reading a stream: ``StreamReader.feed`` chunk by chunk, and ``chunks`` on the SSE body as
providers write it. Each shape names, in a comment, the public source whose wire format it copies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import orjson
import pytest

from app.llm.base import LLMResponseError, TokenUsage
from app.llm.providers import PROFILES
from app.llm.replies import ProviderReportedError
from app.llm.stream_read import RAW_BODY, StreamReader, chunks

GENERIC = PROFILES["openai-compatible"]
OPENED = replace(GENERIC, opens_thinking=True)
NO_TAGS = PROFILES["openai"]


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, index: int = 0, **top: Any
) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": index, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": choices, **top}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def feed_all(reader: StreamReader, *items: dict[str, Any]) -> str:
    return "".join(reader.feed(item) for item in items) + reader.finish()


# -- text ------------------------------------------------------------------------------------


def test_content_deltas_are_the_answer_text() -> None:
    # OpenAI API reference, "The chat completion chunk object".
    reader = StreamReader(GENERIC)

    assert reader.feed(chunk({"role": "assistant", "content": ""})) == ""
    assert reader.feed(chunk({"content": "Hel"})) == "Hel"
    assert reader.feed(chunk({"content": "lo"})) == "lo"


@pytest.mark.parametrize(
    "field",
    [
        "reasoning_content",  # DeepSeek API docs, guides/thinking_mode, streaming example
        "reasoning",  # OpenRouter docs "Reasoning Tokens"; Ollama OpenAI compatibility; vLLM >= 0.11
    ],
)
def test_reasoning_deltas_with_null_content_are_never_answer_text(field: str) -> None:
    reader = StreamReader(GENERIC)

    text = feed_all(
        reader,
        chunk({"role": "assistant", "content": None, field: ""}),
        chunk({"content": None, field: "Compare 9.11"}),
        chunk({"content": None, field: " and 9.8."}),
        chunk({"content": "9.8", field: None}),
        chunk({"content": " is greater."}, finish="stop"),
    )

    assert text == "9.8 is greater."


def test_content_blocks_in_a_delta_give_only_their_text() -> None:
    # Mistral docs "Reasoning" (Magistral), streamed: thinking chunks, then text chunks.
    reader = StreamReader(GENERIC)
    thinking = [{"type": "thinking", "thinking": [{"type": "text", "text": "Compare."}]}]

    text = feed_all(
        reader,
        chunk({"content": thinking}),
        chunk({"content": [{"type": "text", "text": "9.8 is "}]}),
        chunk({"content": [{"type": "text", "text": "greater."}]}, finish="stop"),
    )

    assert text == "9.8 is greater."


def test_content_in_a_choice_other_than_the_first_is_read() -> None:
    # Gateways that number the streamed choice 1 (issue 15, "Tool calls anywhere").
    assert StreamReader(GENERIC).feed(chunk({"content": "hi"}, index=1)) == "hi"


def test_think_tags_in_streamed_content_are_held_back() -> None:
    # vLLM without --reasoning-parser; Groq docs "Reasoning", reasoning_format "raw".
    reader = StreamReader(GENERIC)

    text = feed_all(
        reader,
        chunk({"content": "<thi"}),
        chunk({"content": "nk>Compare."}),
        chunk({"content": "</th"}),
        chunk({"content": "ink>\n\n9.8"}),
        chunk({"content": " is greater."}, finish="stop"),
    )

    assert text == "9.8 is greater."


def test_an_opened_profile_holds_text_until_the_closing_tag() -> None:
    # QwQ / DeepSeek-R1 templates open the tag: only "</think>" arrives (vLLM, llama.cpp, Ollama).
    reader = StreamReader(OPENED)

    assert reader.feed(chunk({"content": "Compare."})) == ""
    assert reader.feed(chunk({"content": "</think>9.8"})) == "9.8"


def test_an_opened_profile_hands_the_text_over_at_finish_when_no_tag_came() -> None:
    reader = StreamReader(OPENED)

    assert reader.feed(chunk({"content": "Plain answer."}, finish="stop")) == ""
    assert reader.finish() == "Plain answer."


def test_a_profile_without_think_tags_streams_tags_as_text() -> None:
    reader = StreamReader(NO_TAGS)

    assert reader.feed(chunk({"content": "<think>"})) == "<think>"


# -- usage -----------------------------------------------------------------------------------


def test_no_usage_reported_leaves_usage_unset() -> None:
    # llama.cpp server README and old Azure API versions: no usage in the stream.
    reader = StreamReader(GENERIC)
    feed_all(reader, chunk({"content": "a"}), chunk({}, finish="stop"))

    assert reader.usage is None


def test_usage_null_on_every_chunk_then_a_usage_chunk_is_that_usage() -> None:
    # OpenAI API reference, stream_options.include_usage: "usage": null on each chunk, then a
    # chunk with empty choices and the usage.
    reader = StreamReader(GENERIC)
    feed_all(
        reader,
        chunk({"content": "a"}, usage=None),
        chunk({}, finish="stop", usage=None),
        chunk(None, usage=usage(10, 2)),
    )

    assert reader.usage == TokenUsage(10, 2, 12)


def test_cumulative_usage_on_every_chunk_is_taken_once_from_the_last() -> None:
    # vLLM docs, stream_options.continuous_usage_stats: cumulative usage on every chunk.
    reader = StreamReader(GENERIC)
    feed_all(
        reader,
        chunk({"content": "a"}, usage=usage(10, 1)),
        chunk({"content": "b"}, usage=usage(10, 2)),
        chunk({}, finish="stop", usage=usage(10, 3)),
    )

    assert reader.usage == TokenUsage(10, 3, 13)


def test_usage_on_the_finish_chunk_is_the_usage() -> None:
    # Gemini's OpenAI-compatible endpoint and Together put usage on the finish chunk.
    reader = StreamReader(GENERIC)
    feed_all(reader, chunk({"content": "a"}), chunk({}, finish="stop", usage=usage(8, 1)))

    assert reader.usage == TokenUsage(8, 1, 9)


def test_a_null_usage_after_a_reported_one_does_not_erase_it() -> None:
    reader = StreamReader(GENERIC)
    feed_all(reader, chunk({}, finish="stop", usage=usage(8, 1)), chunk(None, usage=None))

    assert reader.usage == TokenUsage(8, 1, 9)


def test_usage_only_in_x_groq_is_the_usage() -> None:
    # Groq docs: streamed usage arrives in the last chunk's x_groq.usage.
    reader = StreamReader(GENERIC)
    feed_all(
        reader,
        chunk({"role": "assistant", "content": ""}, x_groq={"id": "req_1"}),
        chunk({"content": "a"}),
        chunk({}, finish="stop", x_groq={"id": "req_1", "usage": {"queue_time": 0.01, **usage(6, 1)}}),
    )

    assert reader.usage == TokenUsage(6, 1, 7)


# -- the end ---------------------------------------------------------------------------------


def test_the_finish_reason_is_kept_and_makes_the_stream_complete() -> None:
    reader = StreamReader(GENERIC)
    reader.feed(chunk({"content": "cut"}))
    assert not reader.complete

    reader.feed(chunk({}, finish="length"))

    assert (reader.finish_reason, reader.complete) == ("length", True)


def test_done_alone_makes_the_stream_complete() -> None:
    reader = StreamReader(GENERIC)
    reader.saw_done = True

    assert reader.complete


def test_an_error_chunk_raises_the_providers_message() -> None:
    # OpenRouter docs "Errors", "Error during streaming": a data chunk with an error and
    # finish_reason "error"; vLLM's create_streaming_error_response writes {"error": {...}}.
    reader = StreamReader(GENERIC)
    error_chunk = chunk(
        {"content": ""}, finish="error", error={"code": "server_error", "message": "Provider disconnected"}
    )

    with pytest.raises(ProviderReportedError) as caught:
        reader.feed(error_chunk)

    assert caught.value.message == "Provider disconnected"
    assert caught.value.retryable is True


def test_a_client_error_chunk_is_not_retryable() -> None:
    # vLLM: {"error": {"object": "error", "message", "type": "BadRequestError", "code": 400}}.
    error = {"object": "error", "message": "max_tokens is too large", "type": "BadRequestError", "code": 400}

    with pytest.raises(ProviderReportedError) as caught:
        StreamReader(GENERIC).feed({"error": error})

    assert (caught.value.retryable, caught.value.status) == (False, 400)


def test_a_chunk_that_is_not_an_object_is_unusable() -> None:
    with pytest.raises(LLMResponseError, match="not a JSON object"):
        StreamReader(GENERIC, attempts=2).feed(["a"])


def test_choices_that_are_not_a_list_are_unusable() -> None:
    with pytest.raises(LLMResponseError, match="malformed choices"):
        StreamReader(GENERIC).feed({"choices": {"index": 0}})


def test_a_keep_alive_chunk_without_choices_is_no_text() -> None:
    assert StreamReader(GENERIC).feed({"id": "x", "object": "chat.completion.chunk"}) == ""


# -- chunks: the SSE body --------------------------------------------------------------------


class FakeBody:
    """What ``chunks`` reads of a response: its bytes, in the pieces the network delivered,
    through httpx (``aiter_bytes``) or, when ``raw``, straight from the aiohttp response the
    default transport leaves in ``extensions`` (``content.iter_any``)."""

    raw = False

    def __init__(self, *pieces: str | bytes) -> None:
        self.pieces = [piece.encode() if isinstance(piece, str) else piece for piece in pieces]
        self.read_to_end = False
        self.headers: dict[str, str] = {}
        self.extensions = {RAW_BODY: self} if self.raw else {}
        self.content = self

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        assert not self.raw, "read through httpx although the aiohttp response was there"
        for piece in self.pieces:
            yield piece
        self.read_to_end = True

    async def iter_any(self) -> AsyncIterator[bytes]:
        assert self.raw
        for piece in self.pieces:
            yield piece
        self.read_to_end = True


@pytest.fixture(autouse=True, params=["httpx", "aiohttp"])
def body_source(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test of ``chunks`` reads its body both ways."""
    monkeypatch.setattr(FakeBody, "raw", request.param == "aiohttp")
    return str(request.param)


async def read(body: FakeBody, reader: StreamReader | None = None) -> list[object]:
    return [item async for item in chunks(body, reader or StreamReader(GENERIC))]


def data(obj: object) -> str:
    return "data: " + orjson.dumps(obj).decode() + "\n\n"


async def test_data_lines_are_the_chunks_and_done_is_noted() -> None:
    reader = StreamReader(GENERIC)
    body = FakeBody(data(chunk({"content": "a"})), data(chunk({}, finish="stop")), "data: [DONE]\n\n")

    items = await read(body, reader)

    assert items == [chunk({"content": "a"}), chunk({}, finish="stop")]
    assert reader.saw_done
    assert body.read_to_end


async def test_a_chunk_split_across_network_reads_is_one_chunk() -> None:
    whole = data(chunk({"content": "hello"}))

    assert await read(FakeBody(whole[:7], whole[7:20], whole[20:])) == [chunk({"content": "hello"})]


@pytest.mark.parametrize("end", ["\r\n", "\r", "\n"], ids=["crlf", "cr", "lf"])
async def test_lines_may_end_in_cr_lf_or_both(end: str) -> None:
    text = (
        f"data: {orjson.dumps({'n': 1}).decode()}{end}{end}data: {orjson.dumps({'n': 2}).decode()}{end}{end}"
    )

    assert await read(FakeBody(text)) == [{"n": 1}, {"n": 2}]


async def test_a_line_separator_inside_a_json_string_does_not_cut_the_chunk() -> None:
    raw = '{"choices": [{"index": 0, "delta": {"content": "a\u2028b\u0085c"}}]}'

    assert await read(FakeBody(f"data: {raw}\n\n")) == [orjson.loads(raw)]


async def test_a_character_cut_across_network_reads_is_whole() -> None:
    whole = data(chunk({"content": "déjà 🙂"})).encode()
    cut = whole.index("🙂".encode()) + 2

    assert await read(FakeBody(whole[:cut], whole[cut:])) == [chunk({"content": "déjà 🙂"})]


async def test_bytes_that_are_not_utf8_are_replaced_not_fatal() -> None:
    assert await read(FakeBody(b'data: {"n": "a\xffb"}\n\n')) == [{"n": "a\ufffdb"}]


async def test_a_data_line_padded_with_unicode_spaces_is_read_as_text_strips_it() -> None:
    body = FakeBody('data:\u00a0{"n": 1}\u00a0\n\n', "data: \u00a0\n\n", "data: [DONE]\u0085\n\n")
    reader = StreamReader(GENERIC)

    assert await read(body, reader) == [{"n": 1}]
    assert reader.saw_done


async def test_comments_and_other_fields_are_ignored() -> None:
    # OpenRouter docs "Streaming": ": OPENROUTER PROCESSING" comments keep the connection alive.
    body = FakeBody(": OPENROUTER PROCESSING\n\n", "id: 7\nretry: 100\n", 'data:{"n":1}\n\n')

    assert await read(body) == [{"n": 1}]


async def test_a_llama_cpp_error_line_raises_the_servers_message() -> None:
    # llama.cpp server README / server.cpp: errors in a stream go out as an "error: {...}" line.
    line = (
        'error: {"code":400,"message":"the request exceeds the available context size",'
        '"type":"exceed_context_size_error"}\n\n'
    )

    with pytest.raises(ProviderReportedError) as caught:
        await read(FakeBody(data(chunk({"content": ""})), line))

    assert caught.value.message == "the request exceeds the available context size"
    assert (caught.value.retryable, caught.value.status) == (False, 400)


async def test_an_error_line_wrapping_its_error_object_is_read_too() -> None:
    line = 'error: {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}\n\n'

    with pytest.raises(ProviderReportedError) as caught:
        await read(FakeBody(line))

    assert (caught.value.message, caught.value.retryable) == ("Loading model", True)


async def test_an_error_line_that_is_not_json_is_the_message() -> None:
    with pytest.raises(ProviderReportedError, match="model crashed"):
        await read(FakeBody("error: model crashed\n\n"))


async def test_an_error_event_block_raises_its_data() -> None:
    # SSE "event: error" blocks (gateways in front of llama.cpp and TGI-style servers).
    body = FakeBody('event: error\ndata: {"message": "Too many requests", "code": 429}\n\n')

    with pytest.raises(ProviderReportedError) as caught:
        await read(body)

    assert (caught.value.message, caught.value.retryable) == ("Too many requests", True)


async def test_an_event_name_ends_with_its_block() -> None:
    body = FakeBody("event: error\n\n", 'data: {"n": 1}\n\n')

    assert await read(body) == [{"n": 1}]


async def test_a_data_line_that_is_not_json_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        await read(FakeBody("data: {not json\n\n"))


# -- review fixes ----------------------------------------------------------------------------


def test_an_empty_finish_reason_does_not_make_the_stream_complete() -> None:
    reader = StreamReader(GENERIC)
    reader.feed(chunk({"content": "a"}, finish=""))

    assert reader.complete is False


def test_vllms_error_response_sent_as_a_chunk_raises_its_message() -> None:
    # vLLM's ErrorResponse ({"object": "error", "message", "type", "code"}) written into a stream.
    error = {"object": "error", "message": "The model overloaded", "type": "ServiceUnavailable", "code": 503}

    with pytest.raises(ProviderReportedError, match="The model overloaded") as caught:
        StreamReader(GENERIC).feed(error)
    assert caught.value.retryable is True


def test_an_opened_stream_cut_at_the_output_limit_hands_nothing_over() -> None:
    reader = StreamReader(OPENED)

    text = feed_all(
        reader, chunk({"content": "Still comparing "}), chunk({"content": "9.11"}, finish="length")
    )

    assert text == ""


def test_a_reasoning_delta_releases_what_an_opened_profile_held_as_answer() -> None:
    # OpenRouter (deepseek/deepseek-r1): "reasoning" deltas apart, the content is the answer.
    reader = StreamReader(OPENED)

    first = reader.feed(chunk({"content": None, "reasoning": "2+2 is 4."}))
    second = reader.feed(chunk({"content": "Just 4."}))

    assert (first, second) == ("", "Just 4.")


async def test_nothing_after_done_counts() -> None:
    reader = StreamReader(GENERIC)
    body = FakeBody(
        data(chunk({"content": "a"}, finish="stop")), "data: [DONE]\n\n", data(chunk({"content": "x"}))
    )

    items = await read(body, reader)

    assert items == [chunk({"content": "a"}, finish="stop")]
    assert body.read_to_end


def test_the_streams_model_and_id_are_kept_for_traces() -> None:
    reader = StreamReader(GENERIC)

    feed_all(
        reader,
        chunk({"content": "4"}, model="gpt-x-2025-01", id="chatcmpl-9"),
        chunk({"content": "2"}, "stop", model="other", id="other"),
    )

    assert (reader.response_model, reader.response_id) == ("gpt-x-2025-01", "chatcmpl-9")


async def test_a_last_line_without_its_line_end_is_read_too() -> None:
    # A server that closes right after its last chunk, with no line end after it.
    body = FakeBody(data(chunk({"content": "a"})), "data: " + orjson.dumps(chunk({"content": "b"})).decode())

    assert await read(body) == [chunk({"content": "a"}), chunk({"content": "b"})]
    assert body.read_to_end
