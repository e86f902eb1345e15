"""Synthesis over the wire: one streaming request over the trace, and a stream cut mid-answer."""

from __future__ import annotations

import asyncio
import json
import threading

from app.engine import prompts
from app.engine.events import AnswerDelta, AnswerDone
from app.engine.interrupts import MemoryInterruptQueue
from app.llm.openai_client import OpenAICompatibleLLM
from tests.integration.engine.wire import (
    JSON_ONLY,
    EventLog,
    MakeLLM,
    RecordingSleep,
    constant_tool,
    make_agent,
    registry,
    roles,
)
from tests.support.fake_openai import FakeOpenAIServer, FakeReply

LONG_RESULT = "".join(f"{i:04d}|" for i in range(1000))
"""5,000 characters, every cut position distinguishable."""


async def test_synthesis_streams_the_question_and_the_trace_with_each_result_cut_to_2000_chars(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    assert len(LONG_RESULT) == 5000
    fake_server.script(
        FakeReply.tool_calls([("fetch_page", {"url": "https://example.org"})]),
        FakeReply.text("The page lists 1000 numbers."),
        FakeReply.stream(["It ", "lists ", "1000 numbers."]),
    )
    log = EventLog()

    await make_agent(llm, registry(constant_tool("fetch_page", LONG_RESULT))).run(
        "What is on example.org?", sink=log
    )

    loop_tool_message = fake_server.requests[1]["messages"][-1]
    assert loop_tool_message["content"] == LONG_RESULT  # the loop's LLM sees the whole result
    synthesis = fake_server.requests[-1]
    assert synthesis["stream"] is True
    assert synthesis["stream_options"] == {"include_usage": True}
    assert "tools" not in synthesis
    assert roles(synthesis) == ["system", "user"]
    assert synthesis["messages"][0]["content"] == prompts.SYNTHESIS_SYSTEM
    user = synthesis["messages"][1]["content"]
    assert user.startswith("## Question\nWhat is on example.org?")
    assert '1. `fetch_page` {"url": "https://example.org"}' in user
    assert f"Result:\n{LONG_RESULT[:2000]}\n… [truncated 3000 characters]" in user
    assert LONG_RESULT[:2001] not in user
    assert "## Draft answer\nThe page lists 1000 numbers." in user
    assert [e.content for e in log.of(AnswerDelta)] == ["It ", "lists ", "1000 numbers."]
    assert log.done.answer == "It lists 1000 numbers."


async def test_json_mode_synthesis_trace_includes_the_tool_results(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    fake_server.script(
        FakeReply.text(
            json.dumps({"type": "tool_call", "tool_name": "population", "tool_args": {"city": "Paris"}})
        ),
        FakeReply.text(json.dumps({"type": "final_answer", "answer": "About 2.1 million."})),
        FakeReply.stream(["Paris has about 2.1 million inhabitants."]),
    )
    tools = registry(constant_tool("population", "Paris: 2,102,650 inhabitants (2023)"))

    await make_agent(make_llm(JSON_ONLY), tools).run("How many people live in Paris?", sink=EventLog())

    synthesis = fake_server.requests[-1]
    assert synthesis["stream"] is True
    user = synthesis["messages"][1]["content"]
    assert "## Question\nHow many people live in Paris?" in user
    assert '1. `population` {"city": "Paris"}\nResult:\nParis: 2,102,650 inhabitants (2023)' in user


async def test_stream_cut_after_some_tokens_keeps_them_sent_once_and_ends_with_the_loop_answer(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    fake_server.script(
        FakeReply.text("Loop answer: 42."),
        FakeReply.stream(["The ", "answer ", "is ", "42."], cut_after=2),
    )
    log = EventLog()

    await make_agent(llm, registry(constant_tool("noop", ""))).run("6*7?", sink=log)

    assert len(fake_server.requests) == 2  # no retry once tokens went out
    assert [e.content for e in log.of(AnswerDelta)] == ["The ", "answer "]
    assert len(log.of(AnswerDone)) == 1
    done = log.done
    assert done.status == "completed"
    assert done.answer == "Loop answer: 42."
    assert done.error is not None and done.error.startswith("synthesis failed")
    assert "stream broke after tokens were sent" in done.error


async def test_stream_cut_before_any_token_is_retried_and_the_answer_streams_once(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM, retry_sleep: RecordingSleep
) -> None:
    fake_server.script(
        FakeReply.text("Loop answer."),
        FakeReply.stream(["never", "sent"], cut_after=0),
        FakeReply.stream(["Streamed ", "answer."], usage=(7, 2)),
    )
    log = EventLog()

    await make_agent(make_llm(), registry(constant_tool("noop", ""))).run("Q?", sink=log)

    first_try, second_try = fake_server.requests[1:]
    assert first_try == second_try and first_try["stream"] is True
    assert len(retry_sleep.delays) == 1
    assert [e.content for e in log.of(AnswerDelta)] == ["Streamed ", "answer."]
    assert log.done.answer == "Streamed answer." and log.done.error is None
    assert log.done.usage["llm_calls"] == 3


async def test_synthesis_that_times_out_on_every_attempt_sends_the_loop_answer_once(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    fake_server.script(FakeReply.text("Loop answer: 42."), FakeReply.hang(3.0), FakeReply.hang(3.0))
    log = EventLog()

    await make_agent(make_llm(timeout_s=0.3, max_retries=1), registry(constant_tool("noop", ""))).run(
        "6*7?", sink=log
    )

    assert [e.content for e in log.of(AnswerDelta)] == ["Loop answer: 42."]
    done = log.done
    assert done.status == "completed" and done.answer == "Loop answer: 42."
    assert done.error is not None and done.error.startswith("synthesis failed")
    assert "timed out after 0.3s" in done.error


async def test_interrupt_arriving_during_synthesis_is_handed_back_in_done(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    queue = MemoryInterruptQueue()
    release = threading.Event()
    fake_server.script(
        FakeReply.text("Loop answer."),
        FakeReply.blocked(release, FakeReply.stream(["Synthesised."])),
    )
    log = EventLog()
    run = asyncio.create_task(
        make_agent(llm, registry(constant_tool("noop", ""))).run("Q?", sink=log, interrupts=queue)
    )
    await fake_server.wait_for_requests_async(2)
    await queue.put("one more thing")
    release.set()
    await asyncio.wait_for(run, timeout=10)

    assert log.done.pending_injections == ("one more thing",)
    assert log.done.answer == "Synthesised."
