"""LLM transport failures and malformed replies as the engine meets them over the wire (E-27)."""

from __future__ import annotations

import pytest

from app.engine.events import AnswerStarted, ThinkingDone
from tests.integration.engine.wire import (
    API_KEY,
    EventLog,
    MakeLLM,
    RecordingSleep,
    echo_tool,
    make_agent,
    registry,
)
from tests.support.fake_openai import FakeOpenAIServer, FakeReply


async def test_429_with_retry_after_is_retried_after_exactly_that_delay(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM, retry_sleep: RecordingSleep
) -> None:
    fake_server.script(
        FakeReply.error(429, headers={"Retry-After": "3"}),
        FakeReply.text("Fine now.", usage=(10, 2)),
        FakeReply.stream(["Fine."], usage=(5, 1)),
    )
    log = EventLog()

    await make_agent(make_llm(), registry(echo_tool())).run("Hello?", sink=log)

    assert retry_sleep.delays == [3.0]
    assert log.done.status == "completed" and log.done.answer == "Fine."
    assert log.done.usage == {"prompt_tokens": 15, "completion_tokens": 3, "total_tokens": 18, "llm_calls": 3}
    assert fake_server.requests[0] == fake_server.requests[1]


async def test_500s_past_max_retries_fail_the_run_with_a_reason_that_hides_the_api_key(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM, retry_sleep: RecordingSleep
) -> None:
    leaky = {"error": {"message": f"upstream rejected key {API_KEY}", "type": "server_error"}}
    fake_server.script(*(FakeReply.error(500, body=leaky) for _ in range(3)))
    log = EventLog()

    result = await make_agent(make_llm(max_retries=2), registry(echo_tool())).run("Hello?", sink=log)

    done = log.done
    assert done.status == "failed" and result.status == "failed"
    assert done.error is not None
    assert "LLM unavailable" in done.error and "HTTP 500" in done.error and "3 attempt" in done.error
    assert API_KEY not in done.error
    assert API_KEY not in log.wire_text()
    assert done.usage["llm_calls"] == 3
    assert len(retry_sleep.delays) == 2
    assert log.of(AnswerStarted) == []  # no synthesis for a run that never reached the LLM


async def test_a_hang_past_the_timeout_is_retried_and_the_run_completes(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM, retry_sleep: RecordingSleep
) -> None:
    fake_server.script(
        FakeReply.hang(3.0),
        FakeReply.text("Answered on the second try."),
        FakeReply.stream(["Second try."]),
    )
    log = EventLog()

    await make_agent(make_llm(timeout_s=0.3, max_retries=1), registry(echo_tool())).run("Hi?", sink=log)

    assert log.done.status == "completed" and log.done.answer == "Second try."
    assert len(retry_sleep.delays) == 1
    assert log.done.usage["llm_calls"] == 3


async def test_hangs_on_every_attempt_fail_the_run_naming_the_timeout(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    fake_server.script(FakeReply.hang(3.0), FakeReply.hang(3.0))
    log = EventLog()

    await make_agent(make_llm(timeout_s=0.3, max_retries=1), registry(echo_tool())).run("Hi?", sink=log)

    assert log.done.status == "failed"
    assert log.done.error is not None and "timed out after 0.3s" in log.done.error


@pytest.mark.parametrize(
    "reply",
    [
        FakeReply.malformed(b'{"choices": [ this is not json'),
        FakeReply.malformed(b"<html><body>Bad gateway</body></html>", content_type="text/html"),
    ],
    ids=["labelled-json", "html"],
)
async def test_a_reply_body_that_is_not_json_is_handled_by_the_loop_and_the_next_iteration_succeeds(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM, retry_sleep: RecordingSleep, reply: FakeReply
) -> None:
    fake_server.script(
        reply,
        FakeReply.text("Recovered."),
        FakeReply.stream(["Recovered."]),
    )
    log = EventLog()

    await make_agent(make_llm(), registry(echo_tool())).run("Hi?", sink=log)

    assert retry_sleep.delays == []  # not a transport error: the loop deals with it, not the client
    first = log.of(ThinkingDone)[0]
    assert first.reasoning.startswith("(unusable LLM reply:")
    assert "not JSON" in first.reasoning or "not valid JSON" in first.reasoning
    assert log.done.status == "completed" and log.done.iterations == 2


async def test_a_reply_without_choices_is_handled_by_the_loop_and_the_next_iteration_succeeds(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    fake_server.script(FakeReply.no_choices(), FakeReply.text("Recovered."), FakeReply.stream(["Recovered."]))
    log = EventLog()

    await make_agent(make_llm(), registry(echo_tool())).run("Hi?", sink=log)

    assert "no choices" in log.of(ThinkingDone)[0].reasoning
    assert log.done.status == "completed" and log.done.iterations == 2


async def test_three_unusable_replies_in_a_row_fail_the_run(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    fake_server.script(
        FakeReply.no_choices(), FakeReply.malformed(b"<html>oops</html>"), FakeReply.no_choices()
    )
    log = EventLog()

    await make_agent(make_llm(), registry(echo_tool())).run("Hi?", sink=log)

    assert log.done.status == "failed"
    assert log.done.error is not None and "3 unusable replies in a row" in log.done.error
    assert log.done.usage["llm_calls"] == 3


async def test_401_echoing_the_key_fails_the_run_at_once_without_the_key_in_the_reason(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM, retry_sleep: RecordingSleep
) -> None:
    refused = {"error": {"message": f"Incorrect API key provided: {API_KEY}.", "code": "invalid_api_key"}}
    fake_server.script(FakeReply.error(401, body=refused))
    log = EventLog()

    await make_agent(make_llm(), registry(echo_tool())).run("Hello?", sink=log)

    assert log.done.status == "failed"
    assert log.done.error is not None and "HTTP 401" in log.done.error
    assert "refused" in log.done.error
    assert log.done.usage["llm_calls"] == 1  # sending the refused request again cannot help
    assert API_KEY not in log.wire_text()
    assert retry_sleep.delays == []  # a refused key is not a transport hiccup worth waiting for
    assert fake_server.received[0].headers["authorization"] == f"Bearer {API_KEY}"
