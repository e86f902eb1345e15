"""OpenAICompatibleLLM through the real openai client, over a socket, against the fake server."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import random
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from app.llm.base import (
    ChatMessage,
    LLMRequestRejectedError,
    LLMResponseError,
    LLMUnavailableError,
    StreamEnd,
    StreamItem,
    TextDelta,
    TokenUsage,
)
from app.llm.openai_client import BACKOFF_BASE_S, RETRY_AFTER_MAX_S, OpenAICompatibleLLM
from app.llm.stream_read import RAW_BODY, StreamReader, chunks
from tests.integration.llm.provider_wire import RecordingSleep
from tests.support.fake_agents import EchoAgentBehaviour, ToolAgentBehaviour, answer_tokens, iter_stream_text
from tests.support.fake_openai import FakeOpenAIServer, FakeReply

API_KEY = "sk-test-SECRET-0123456789abcdef"
QUESTION = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
ABILITIES = {"tool_call": True, "json_mode": True, "streaming": True}


async def collect(stream: AsyncIterator[StreamItem]) -> list[StreamItem]:
    return [item async for item in stream]


# -- chat ------------------------------------------------------------------------------------


async def test_chat_returns_content_usage_and_finish_reason(server: FakeOpenAIServer, make_llm: Any) -> None:
    server.script(FakeReply.text("Hello there.", usage=(12, 3)))

    result = await make_llm().chat(QUESTION)

    assert result.content == "Hello there."
    assert result.tool_calls == ()
    assert result.usage == TokenUsage(12, 3, 15)
    assert result.finish_reason == "stop"
    assert result.attempts == 1
    body = server.requests[0]
    assert body["model"] == "test-model"
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert "tools" not in body and "response_format" not in body and not body.get("stream")


async def test_chat_sends_the_api_key_as_bearer_token(server: FakeOpenAIServer, make_llm: Any) -> None:
    server.script(FakeReply.text("ok"))

    await make_llm().chat(QUESTION)

    assert server.received[0].headers["authorization"] == f"Bearer {API_KEY}"


async def test_chat_passes_tools_tool_choice_and_response_format_through(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    choice = {"type": "function", "function": {"name": "calc"}}
    server.script(FakeReply.text("{}"))

    await make_llm().chat(QUESTION, tools=[tool], tool_choice=choice, response_format={"type": "json_object"})

    body = server.requests[0]
    assert body["tools"] == [tool]
    assert body["tool_choice"] == choice
    assert body["response_format"] == {"type": "json_object"}


async def test_tool_calls_keep_ids_names_and_raw_argument_strings(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(FakeReply.tool_calls([("calculator", {"expression": "2+2"}), ("broken", "{not json")]))

    result = await make_llm().chat(QUESTION)

    assert [(c.name, c.arguments) for c in result.tool_calls] == [
        ("calculator", '{"expression":"2+2"}'),
        ("broken", "{not json"),
    ]
    assert result.tool_calls[0].id == "call_0_calculator"
    assert result.finish_reason == "tool_calls"


async def test_assistant_tool_call_history_is_sent_in_openai_shape(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(FakeReply.tool_calls([("calculator", {"expression": "1+1"})]), FakeReply.text("2"))
    llm = make_llm()
    first = await llm.chat(QUESTION)

    history = [
        *QUESTION,
        ChatMessage(role="assistant", content=None, tool_calls=first.tool_calls),
        ChatMessage(role="tool", content="2", tool_call_id=first.tool_calls[0].id),
    ]
    await llm.chat(history)

    sent = server.requests[1]["messages"]
    assert sent[2]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression":"1+1"}'}
    assert sent[3] == {"role": "tool", "content": "2", "tool_call_id": "call_0_calculator"}


async def test_reasoning_content_is_read_from_the_message_extra_field(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(FakeReply.text('{"type": "final_answer"}', reasoning_content="First I think."))

    result = await make_llm().chat(QUESTION)

    assert result.reasoning_content == "First I think."


async def test_reasoning_content_is_none_when_the_provider_sends_none(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(FakeReply.text("plain"))

    assert (await make_llm().chat(QUESTION)).reasoning_content is None


# -- retries ---------------------------------------------------------------------------------


async def test_429_waits_exactly_the_retry_after_seconds_then_succeeds(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(FakeReply.error(429, headers={"Retry-After": "7"}), FakeReply.text("ok"))

    result = await make_llm().chat(QUESTION)

    assert result.content == "ok"
    assert result.attempts == 2
    assert sleep.delays == [7.0]


async def test_retry_after_ms_takes_precedence_over_retry_after(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    headers = {"retry-after-ms": "250", "retry-after": "9"}
    server.script(FakeReply.error(429, headers=headers), FakeReply.text("ok"))

    await make_llm().chat(QUESTION)

    assert sleep.delays == [0.25]


async def test_retry_after_as_http_date_is_honoured(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=20), usegmt=True)
    server.script(FakeReply.error(503, headers={"Retry-After": when}), FakeReply.text("ok"))

    await make_llm().chat(QUESTION)

    assert len(sleep.delays) == 1
    assert 15.0 <= sleep.delays[0] <= 20.0


async def test_a_huge_retry_after_is_capped(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(FakeReply.error(429, headers={"Retry-After": "86400"}), FakeReply.text("ok"))

    await make_llm().chat(QUESTION)

    assert sleep.delays == [RETRY_AFTER_MAX_S]


async def test_500_then_success_retries_after_a_jittered_backoff(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(FakeReply.error(500), FakeReply.error(502), FakeReply.text("ok", usage=(4, 2)))

    result = await make_llm().chat(QUESTION)

    assert result.content == "ok"
    assert result.attempts == 3
    assert len(sleep.delays) == 2
    assert 0.0 <= sleep.delays[0] <= BACKOFF_BASE_S
    assert 0.0 <= sleep.delays[1] <= 2 * BACKOFF_BASE_S
    assert len(server.requests) == 3


class RecordingRandom(random.Random):
    """A seeded generator that keeps the bounds of every ``uniform`` draw."""

    def __init__(self) -> None:
        super().__init__(1234)
        self.bounds: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.bounds.append((a, b))
        return super().uniform(a, b)


async def test_backoff_is_full_jitter_drawn_from_zero_to_a_doubling_capped_ceiling(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    """E-27: each delay is uniform in [0, min(8 s, 0.5 s * 2^retry)], not a fixed step."""
    server.script(*[FakeReply.error(500) for _ in range(6)], FakeReply.text("ok"))
    rng = RecordingRandom()

    result = await make_llm(max_retries=6, rng=rng).chat(QUESTION)

    assert result.attempts == 7
    assert rng.bounds == [(0.0, 0.5), (0.0, 1.0), (0.0, 2.0), (0.0, 4.0), (0.0, 8.0), (0.0, 8.0)]
    expected = random.Random(1234)
    assert sleep.delays == [expected.uniform(a, b) for a, b in rng.bounds]
    assert len(set(sleep.delays)) == 6  # drawn, not a fixed step


async def test_retries_are_exhausted_into_llm_unavailable_with_the_status(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(*[FakeReply.error(503) for _ in range(3)])

    with pytest.raises(LLMUnavailableError) as caught:
        await make_llm(max_retries=2).chat(QUESTION)

    assert caught.value.attempts == 3
    assert "503" in str(caught.value)
    assert len(sleep.delays) == 2


@pytest.mark.parametrize("status", [408, 409])
async def test_408_and_409_are_retried(status: int, server: FakeOpenAIServer, make_llm: Any) -> None:
    server.script(FakeReply.error(status), FakeReply.text("ok"))

    assert (await make_llm().chat(QUESTION)).attempts == 2


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_other_4xx_is_a_rejection_and_not_retried(
    status: int, server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(FakeReply.error(status))

    with pytest.raises(LLMRequestRejectedError) as caught:
        await make_llm().chat(QUESTION)

    assert str(status) in str(caught.value)
    assert caught.value.status == status
    assert caught.value.attempts == 1
    assert sleep.delays == []


async def test_a_hang_past_the_timeout_is_retried_then_reported_unavailable(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(FakeReply.hang(5), FakeReply.hang(5))

    with pytest.raises(LLMUnavailableError) as caught:
        await make_llm(timeout_s=0.3, max_retries=1).chat(QUESTION)

    assert "timed out" in str(caught.value)
    assert caught.value.attempts == 2
    assert len(sleep.delays) == 1


async def test_a_hang_then_a_fast_reply_succeeds_on_the_retry(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(FakeReply.hang(5), FakeReply.text("fast"))

    result = await make_llm(timeout_s=0.3).chat(QUESTION)

    assert (result.content, result.attempts) == ("fast", 2)


async def test_connection_refused_becomes_llm_unavailable(sleep: RecordingSleep) -> None:
    with FakeOpenAIServer() as closed:
        url = closed.base_url  # the port is free again once the server stops
    llm = OpenAICompatibleLLM(url, API_KEY, "m", ABILITIES, timeout_s=2, max_retries=2, sleep=sleep)
    try:
        with pytest.raises(LLMUnavailableError) as caught:
            await llm.chat(QUESTION)
    finally:
        await llm.aclose()

    assert "connection error" in str(caught.value)
    assert caught.value.attempts == 3


# -- unusable replies ------------------------------------------------------------------------


async def test_a_malformed_json_body_is_a_response_error_and_not_retried(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(FakeReply.malformed(b'{"choices": [ this is not json'))

    with pytest.raises(LLMResponseError, match="not valid JSON"):
        await make_llm().chat(QUESTION)

    assert sleep.delays == []


async def test_a_body_that_is_not_json_at_all_is_a_response_error(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(FakeReply.malformed(b"<html>gateway says hi</html>", content_type="text/html"))

    with pytest.raises(LLMResponseError, match="not JSON"):
        await make_llm().chat(QUESTION)


async def test_an_empty_choice_list_is_a_response_error(server: FakeOpenAIServer, make_llm: Any) -> None:
    server.script(FakeReply.no_choices())

    with pytest.raises(LLMResponseError, match="no choices"):
        await make_llm().chat(QUESTION)


async def test_a_json_body_of_the_wrong_shape_is_a_response_error(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(FakeReply.malformed(json.dumps({"object": "chat.completion", "choices": "nope"}).encode()))

    with pytest.raises(LLMResponseError):
        await make_llm().chat(QUESTION)


async def test_the_api_key_never_appears_in_error_messages(server: FakeOpenAIServer, make_llm: Any) -> None:
    echoed = {"error": {"message": f"Incorrect API key provided: {API_KEY}. Bearer {API_KEY}"}}
    server.script(FakeReply.error(401, body=echoed), *[FakeReply.error(500, body=echoed) for _ in range(2)])
    llm = make_llm(max_retries=1)

    with pytest.raises(LLMRequestRejectedError) as auth_error:
        await llm.chat(QUESTION)
    with pytest.raises(LLMUnavailableError) as unavailable:
        await llm.chat(QUESTION)

    for error in (auth_error.value, unavailable.value):
        text = f"{error} {error!r}"
        assert API_KEY not in text
        assert "SECRET" not in text
    assert "401" in str(auth_error.value)


# -- streaming -------------------------------------------------------------------------------


async def test_stream_yields_deltas_then_usage_from_the_final_chunk(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(FakeReply.stream(["Hel", "lo", " world"], usage=(21, 3)))

    items = await collect(make_llm().stream_chat(QUESTION))

    assert items == [
        TextDelta("Hel"),
        TextDelta("lo"),
        TextDelta(" world"),
        # The model and id the chunks carry, for traces.
        StreamEnd(
            usage=TokenUsage(21, 3, 24),
            attempts=1,
            finish_reason="stop",
            response_model="test-model",
            response_id="chatcmpl-fake",
        ),
    ]
    body = server.requests[0]
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


async def test_stream_is_retried_when_it_fails_before_the_first_delta(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(
        FakeReply.error(503),
        FakeReply.stream(["never", "sent"], cut_after=0),
        FakeReply.stream(["a", "b"], usage=(1, 2)),
    )

    items = await collect(make_llm().stream_chat(QUESTION))

    assert [i.text for i in items if isinstance(i, TextDelta)] == ["a", "b"]
    end = items[-1]
    assert isinstance(end, StreamEnd)
    assert (end.usage, end.attempts, end.finish_reason) == (TokenUsage(1, 2, 3), 3, "stop")
    assert len(sleep.delays) == 2


async def test_stream_cut_after_tokens_raises_and_never_resends_them(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(FakeReply.stream(["one ", "two ", "three ", "four"], cut_after=2))
    received: list[str] = []

    with pytest.raises(LLMUnavailableError) as caught:
        async for item in make_llm().stream_chat(QUESTION):
            assert isinstance(item, TextDelta)
            received.append(item.text)

    assert received == ["one ", "two "]
    assert "after tokens were sent: connection error" in str(caught.value)  # a hang-up, not a timeout
    assert len(server.requests) == 1
    assert sleep.delays == []


async def test_stream_retries_are_exhausted_into_llm_unavailable(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(FakeReply.error(500), FakeReply.error(500))

    with pytest.raises(LLMUnavailableError) as caught:
        await collect(make_llm(max_retries=1).stream_chat(QUESTION))

    assert caught.value.attempts == 2


async def test_stream_stalling_past_the_timeout_before_any_token_is_retried(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(FakeReply.stream(["late"], delay_s=5), FakeReply.stream(["on time"]))

    items = await collect(make_llm(timeout_s=0.3).stream_chat(QUESTION))

    assert [i.text for i in items if isinstance(i, TextDelta)] == ["on time"]
    assert isinstance(items[-1], StreamEnd) and items[-1].attempts == 2


async def test_stream_with_a_4xx_is_a_rejection(server: FakeOpenAIServer, make_llm: Any) -> None:
    server.script(FakeReply.error(400))

    with pytest.raises(LLMRequestRejectedError):
        await collect(make_llm().stream_chat(QUESTION))


async def test_stream_with_a_malformed_chunk_is_a_response_error(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    raw = b"data: {this is not json\n\n"
    server.script(FakeReply.malformed(raw, content_type="text/event-stream"))

    with pytest.raises(LLMResponseError):
        await collect(make_llm().stream_chat(QUESTION))


async def test_the_default_client_reads_a_stream_straight_from_aiohttp(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # The per-token path (bench/RESULTS.md): the transport leaves the aiohttp response for
    # stream_read to read the body from. If httpx_aiohttp stops exposing it, this says so.
    server.script(FakeReply.stream(["a", "b"]))
    llm = make_llm()

    stream = await llm._client.chat.completions.create(model="test-model", messages=[], stream=True)
    async with stream:
        assert isinstance(stream.response.extensions.get(RAW_BODY), aiohttp.ClientResponse)
        reader = StreamReader(llm.profile)
        texts = [reader.feed(chunk) async for chunk in chunks(stream.response, reader)]

    assert "".join(texts) == "ab"
    assert reader.saw_done


async def test_a_compressed_stream_is_read_through_its_content_coding(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    frames = b"".join(
        b"data: " + json.dumps(chunk).encode() + b"\n\n"
        for chunk in (
            {"choices": [{"index": 0, "delta": {"content": "zipped "}}]},
            {"choices": [{"index": 0, "delta": {"content": "answer"}, "finish_reason": "stop"}]},
        )
    )
    server.script(
        FakeReply.malformed(
            gzip.compress(frames + b"data: [DONE]\n\n"),
            content_type="text/event-stream",
            headers={"content-encoding": "gzip"},
        )
    )

    items = await collect(make_llm().stream_chat(QUESTION))

    assert "".join(i.text for i in items if isinstance(i, TextDelta)) == "zipped answer"


async def test_a_token_far_longer_than_aiohttps_line_limit_arrives_whole(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # aiohttp's readline refuses lines over 128 KiB; a provider may send a whole answer in one chunk.
    long = "x" * 300_000
    server.script(FakeReply.stream(["a", long, "b"]))

    items = await collect(make_llm().stream_chat(QUESTION))

    assert [i.text for i in items if isinstance(i, TextDelta)] == ["a", long, "b"]


# -- lifecycle -------------------------------------------------------------------------------


async def test_concurrent_calls_are_not_queued_behind_a_connection_cap(server: FakeOpenAIServer) -> None:
    """Every active run holds one upstream request: 150 of them are all in flight at once."""
    release = threading.Event()
    server.set_handler(lambda body: FakeReply.blocked(release, FakeReply.stream(["ok"])))
    llm = OpenAICompatibleLLM(server.base_url, None, "m", ABILITIES, timeout_s=30)
    calls = [asyncio.create_task(collect(llm.stream_chat(QUESTION))) for _ in range(150)]
    try:
        await server.wait_for_requests_async(150, within_s=20)
    finally:
        release.set()
        results = await asyncio.gather(*calls, return_exceptions=True)
        await llm.aclose()
    assert all(not isinstance(r, BaseException) and r[0] == TextDelta("ok") for r in results)


async def test_aclose_leaves_a_caller_supplied_http_client_open(server: FakeOpenAIServer) -> None:
    server.script(FakeReply.text("ok"))
    async with httpx.AsyncClient() as http:
        llm = OpenAICompatibleLLM(server.base_url, None, "m", ABILITIES, http_client=http)
        await llm.aclose()

        assert not http.is_closed
        assert (await llm.chat(QUESTION)).content == "ok"


async def test_exposes_model_name_and_abilities() -> None:
    llm = OpenAICompatibleLLM("http://127.0.0.1:9/v1", None, "gpt-x", {"tool_call": False})
    await llm.aclose()

    assert llm.model_name == "gpt-x"
    assert llm.abilities == {"tool_call": False}


# -- the fake server's own contract ----------------------------------------------------------


async def test_an_unscripted_request_gets_a_500_and_fails_assert_done() -> None:
    with FakeOpenAIServer() as lonely:
        llm = OpenAICompatibleLLM(lonely.base_url, None, "m", ABILITIES, max_retries=0)
        try:
            with pytest.raises(LLMUnavailableError, match="unscripted request"):
                await llm.chat(QUESTION)
        finally:
            await llm.aclose()

        assert len(lonely.unexpected) == 1
        with pytest.raises(AssertionError, match="unscripted"):
            lonely.assert_done()


def test_assert_done_fails_when_scripted_replies_were_never_requested() -> None:
    with FakeOpenAIServer() as srv:
        srv.script(FakeReply.text("never asked for"))

        with pytest.raises(AssertionError, match="1 scripted replies never requested"):
            srv.assert_done()


def test_models_route_lists_the_fake_model(server: FakeOpenAIServer) -> None:
    response = httpx.get(f"{server.base_url}/models")

    assert response.status_code == 200
    assert response.json()["data"][0]["id"] == "fake-model"


async def test_a_blocked_reply_waits_for_the_test_to_release_it(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    release = threading.Event()
    server.script(FakeReply.blocked(release, FakeReply.text("released")))
    call = asyncio.ensure_future(make_llm().chat(QUESTION))

    await server.wait_for_requests_async(1)
    assert not call.done()
    release.set()

    assert (await call).content == "released"


async def test_echo_behaviour_answers_native_json_and_streaming_calls(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    behaviour = EchoAgentBehaviour(tokens=5)
    server.set_handler(behaviour)
    llm = make_llm()
    json_system = ChatMessage(
        role="system", content='Reply with {"type": "tool_call"} or {"type": "final_answer"}'
    )
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}

    native = await llm.chat([ChatMessage(role="user", content="ping")], tools=[tool])
    json_mode = await llm.chat([json_system, ChatMessage(role="user", content="ping")])
    streamed = await collect(llm.stream_chat(QUESTION))

    assert native.content == "Echo: ping"
    assert json.loads(json_mode.content or "") == {
        "type": "final_answer",
        "answer": "Echo: ping",
        "reasoning": "Nothing to look up.",
    }
    assert "".join(i.text for i in streamed if isinstance(i, TextDelta)) == behaviour.answer
    assert sum(1 for i in streamed if isinstance(i, TextDelta)) == 5


async def test_tool_behaviour_calls_its_tool_once_then_answers(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.set_handler(ToolAgentBehaviour("calculator", {"expression": "6*7"}))
    llm = make_llm()
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    messages = [ChatMessage(role="user", content="what is 6*7")]

    first = await llm.chat(messages, tools=[tool])
    messages += [
        ChatMessage(role="assistant", tool_calls=first.tool_calls),
        ChatMessage(role="tool", content="42", tool_call_id=first.tool_calls[0].id),
    ]
    second = await llm.chat(messages, tools=[tool])

    assert [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [
        ("calculator", {"expression": "6*7"})
    ]
    assert second.tool_calls == ()
    assert second.content == "Echo: what is 6*7"


@pytest.mark.slow
def test_the_server_runs_as_a_standalone_process() -> None:
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.fake_openai", "--port", "0", "--mode", "echo", "--tokens", "3"],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        response = httpx.post(f"{url}/chat/completions", json=body, timeout=5)
        assert "".join(iter_stream_text(response.content)) == "".join(answer_tokens(3))
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        if proc.stdout is not None:
            proc.stdout.close()


# -- the environment's proxy ----------------------------------------------------------------------


@pytest.fixture
def no_proxy_variables(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


async def test_the_environments_proxy_carries_every_call(
    server: FakeOpenAIServer, no_proxy_variables: pytest.MonkeyPatch
) -> None:
    # The fake server plays the proxy: a request through a proxy names the whole URL.
    no_proxy_variables.setenv("HTTP_PROXY", server.base_url.removesuffix("/v1"))
    server.script(FakeReply.text("first"), FakeReply.stream(["second"]))
    llm = OpenAICompatibleLLM("http://llm.invalid/v1", "sk-test", "m", ABILITIES, max_retries=0)
    try:
        first = await llm.chat(QUESTION)
        second = await collect(llm.stream_chat(QUESTION))
    finally:
        await llm.aclose()

    assert (first.content, [i.text for i in second if isinstance(i, TextDelta)]) == ("first", ["second"])
    assert [r.path for r in server.received] == ["http://llm.invalid/v1/chat/completions"] * 2


async def test_no_proxy_sends_the_calls_straight_to_the_provider(
    server: FakeOpenAIServer, no_proxy_variables: pytest.MonkeyPatch
) -> None:
    no_proxy_variables.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    no_proxy_variables.setenv("NO_PROXY", "127.0.0.1")
    server.script(FakeReply.text("direct"))
    llm = OpenAICompatibleLLM(server.base_url, "sk-test", "m", ABILITIES, max_retries=0)
    try:
        result = await llm.chat(QUESTION)
    finally:
        await llm.aclose()

    assert result.content == "direct"
    assert [r.path for r in server.received] == ["/v1/chat/completions"]


async def test_a_proxy_with_credentials_gets_them_on_every_call(
    server: FakeOpenAIServer, no_proxy_variables: pytest.MonkeyPatch
) -> None:
    address = server.base_url.removesuffix("/v1").removeprefix("http://")
    no_proxy_variables.setenv("HTTP_PROXY", f"http://proxy-user:proxy%20pw@{address}")
    server.script(FakeReply.text("first"), FakeReply.text("second"))
    llm = OpenAICompatibleLLM("http://llm.invalid/v1", "sk-test", "m", ABILITIES, max_retries=0)
    try:
        answers = [(await llm.chat(QUESTION)).content for _ in range(2)]
    finally:
        await llm.aclose()

    assert answers == ["first", "second"]
    expected = "Basic " + base64.b64encode(b"proxy-user:proxy pw").decode()
    assert [r.headers.get("proxy-authorization") for r in server.received] == [expected] * 2
