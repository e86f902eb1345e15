"""Providers' ways of failing through ``OpenAICompatibleLLM`` (real openai client, real socket,
fake server): errors inside a 200 stream or body, streams that end without saying so, a cut by
length, and the API key in the messages that carry a provider's words.

Each shape names, in a comment, the public source whose wire format it copies.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from app.llm.base import (
    LLMRequestRejectedError,
    LLMResponseError,
    LLMUnavailableError,
    TextDelta,
    TokenUsage,
)
from tests.integration.llm.provider_wire import (
    QUESTION,
    RecordingSleep,
    chunk,
    collect,
    end,
    raw_stream,
    sse,
    texts,
    usage,
)
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.fake_replies import FakeReply

# -- errors inside a 200 stream --------------------------------------------------------------


async def test_an_error_chunk_before_the_first_token_with_429_is_retried(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    # OpenRouter docs "Errors": a rate limit reported as a data event of a 200 stream.
    server.script(
        sse(
            chunk({"role": "assistant", "content": ""}),
            {"error": {"code": 429, "message": "Rate limit exceeded"}},
        ),
        FakeReply.stream(["9.8"]),
    )

    items = await collect(make_llm().stream_chat(QUESTION))

    assert texts(items) == ["9.8"]
    assert end(items).attempts == 2
    assert len(sleep.delays) == 1


async def test_an_error_chunk_with_400_is_a_rejection_with_the_providers_message(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    # vLLM's create_streaming_error_response: {"error": {"object": "error", ..., "code": 400}}.
    error = {
        "object": "error",
        "message": "max_tokens is too large: 99999",
        "type": "BadRequestError",
        "code": 400,
    }
    server.script(sse({"error": error}))

    with pytest.raises(LLMRequestRejectedError) as caught:
        await collect(make_llm().stream_chat(QUESTION))

    assert caught.value.status == 400
    assert "max_tokens is too large: 99999" in str(caught.value)
    assert sleep.delays == []


@pytest.mark.parametrize(
    ("error", "raised"),
    [
        # OpenRouter docs "Errors", "Error during streaming": finish_reason "error" beside it.
        ({"code": "server_error", "message": "Provider disconnected unexpectedly"}, LLMUnavailableError),
        ({"code": 400, "message": "Content rejected by the provider's moderation"}, LLMResponseError),
    ],
    ids=["retryable", "not-retryable"],
)
async def test_an_error_chunk_after_tokens_raises_with_the_providers_message(
    error: dict[str, Any],
    raised: type[Exception],
    server: FakeOpenAIServer,
    make_llm: Any,
    sleep: RecordingSleep,
) -> None:
    server.script(
        sse(chunk({"content": "9.8 is"}), chunk({"content": ""}, finish="error", error=error), done=False)
    )
    received: list[str] = []

    with pytest.raises(raised) as caught:
        async for item in make_llm().stream_chat(QUESTION):
            assert isinstance(item, TextDelta)
            received.append(item.text)

    assert received == ["9.8 is"]
    assert error["message"] in str(caught.value)
    assert "after tokens were sent" in str(caught.value)
    assert (len(server.requests), sleep.delays) == (1, [])


async def test_a_llama_cpp_error_line_is_reported_with_its_message(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # llama.cpp server (server.cpp, server_sent_event(sink, "error", ...)): "error: {...}".
    server.script(
        raw_stream(
            'error: {"code":400,"type":"exceed_context_size_error",'
            '"message":"the request exceeds the available context size, try increasing it"}\n\n'
        )
    )

    with pytest.raises(LLMRequestRejectedError) as caught:
        await collect(make_llm().stream_chat(QUESTION))

    assert "the request exceeds the available context size" in str(caught.value)


async def test_a_llama_cpp_server_error_line_before_any_token_is_retried(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(
        raw_stream('error: {"code":503,"message":"Loading model","type":"unavailable_error"}\n\n'),
        FakeReply.stream(["ok"]),
    )

    items = await collect(make_llm().stream_chat(QUESTION))

    assert (texts(items), end(items).attempts) == (["ok"], 2)


# -- streams that end badly ------------------------------------------------------------------


async def test_a_stream_ending_without_done_or_finish_before_any_token_is_retried(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(sse(chunk({"role": "assistant", "content": ""}), done=False), FakeReply.stream(["ok"]))

    items = await collect(make_llm().stream_chat(QUESTION))

    assert (texts(items), end(items).attempts, len(sleep.delays)) == (["ok"], 2, 1)


async def test_a_stream_ending_without_done_or_finish_after_tokens_raises(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(sse(chunk({"content": "9.8 is"}), chunk({"content": " gre"}), done=False))
    received: list[str] = []

    with pytest.raises(LLMUnavailableError, match="ended before the answer was complete") as caught:
        async for item in make_llm().stream_chat(QUESTION):
            assert isinstance(item, TextDelta)
            received.append(item.text)

    assert received == ["9.8 is", " gre"]
    assert caught.value.attempts == 1
    assert (len(server.requests), sleep.delays) == (1, [])


async def test_a_stream_with_a_finish_reason_but_no_done_is_complete(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # ik_llama.cpp issue 467: the server never sends "data: [DONE]".
    server.script(sse(chunk({"content": "ok"}), chunk({}, finish="stop"), done=False))

    items = await collect(make_llm().stream_chat(QUESTION))

    assert (texts(items), end(items).finish_reason) == (["ok"], "stop")


async def test_a_stream_with_done_but_no_finish_reason_is_complete(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(sse(chunk({"content": "ok"})))

    items = await collect(make_llm().stream_chat(QUESTION))

    assert (texts(items), end(items).finish_reason, end(items).attempts) == (["ok"], None, 1)


async def test_a_length_cut_keeps_its_text_and_says_length(server: FakeOpenAIServer, make_llm: Any) -> None:
    # OpenAI API reference: finish_reason "length" when max_tokens is reached.
    server.script(sse(chunk({"content": "9.8 is"}), chunk({}, finish="length", usage=usage(5, 2))))

    items = await collect(make_llm().stream_chat(QUESTION))

    assert texts(items) == ["9.8 is"]
    assert (end(items).usage, end(items).attempts, end(items).finish_reason) == (
        TokenUsage(5, 2, 7),
        1,
        "length",
    )


# -- errors inside a 200 body ----------------------------------------------------------------


async def test_a_rate_limit_error_in_a_200_body_is_retried(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    # OpenRouter docs "Errors": {"error": {"code", "message", "metadata"}} once the model started.
    server.script(
        FakeReply.malformed(
            orjson.dumps({"error": {"code": 429, "message": "Rate limit exceeded", "metadata": {}}})
        ),
        FakeReply.text("9.8"),
    )

    result = await make_llm().chat(QUESTION)

    assert (result.content, result.attempts, len(sleep.delays)) == ("9.8", 2, 1)


async def test_rate_limit_errors_in_200_bodies_end_unavailable_with_the_providers_message(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    body = orjson.dumps({"error": {"code": 429, "message": "free-models-per-min exceeded"}})
    server.script(FakeReply.malformed(body), FakeReply.malformed(body))

    with pytest.raises(LLMUnavailableError, match="free-models-per-min exceeded"):
        await make_llm(max_retries=1).chat(QUESTION)


async def test_an_auth_error_in_a_200_body_is_a_rejection_with_the_providers_message(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(
        FakeReply.malformed(orjson.dumps({"error": {"code": 401, "message": "No auth credentials found"}}))
    )

    with pytest.raises(LLMRequestRejectedError, match="No auth credentials found") as caught:
        await make_llm().chat(QUESTION)

    assert (caught.value.status, sleep.delays) == (401, [])


# -- the key in messages ---------------------------------------------------------------------


async def test_a_one_letter_key_never_rewrites_words_but_is_masked_as_a_token(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(FakeReply.error(401, {"error": {"message": "Unexpected error: key e is not valid"}}))

    with pytest.raises(LLMRequestRejectedError) as caught:
        await make_llm(api_key="e").chat(QUESTION)

    assert "Unexpected error: key *** is not valid" in str(caught.value)


@pytest.mark.parametrize("key", ["gsk_SECRET0123456789abcdef", "AIzaSyD-SECRET0123456789"])
async def test_a_key_at_the_end_of_a_sentence_is_masked(
    key: str, server: FakeOpenAIServer, make_llm: Any
) -> None:
    # Providers echo the key they refused ("Incorrect API key provided: <key>."); keys that do not
    # look like sk-... (Groq's gsk_, Gemini's AIza) are masked only as the key itself.
    server.script(FakeReply.error(401, {"error": {"message": f"Incorrect API key provided: {key}."}}))

    with pytest.raises(LLMRequestRejectedError) as caught:
        await make_llm(api_key=key).chat(QUESTION)

    assert key not in str(caught.value)
    assert "Incorrect API key provided: ***." in str(caught.value)
