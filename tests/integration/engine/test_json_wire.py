"""JSON mode over the wire: tools in the prompt, observations as user messages, reformat, drains."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from app.engine import prompts
from app.engine.events import Injected, ThinkingDone
from app.engine.interrupts import MemoryInterruptQueue
from tests.integration.engine.wire import (
    JSON_ONLY,
    NATIVE,
    EventLog,
    MakeLLM,
    contents,
    echo_tool,
    make_agent,
    registry,
    roles,
    tool,
)
from tests.support.fake_openai import FakeOpenAIServer, FakeReply


def action(kind: str, **fields: object) -> FakeReply:
    return FakeReply.text(json.dumps({"type": kind, **fields}))


async def _celsius(city: str) -> str:
    return f"{city}: 21 degrees"


WEATHER = tool(
    "weather",
    _celsius,
    description="Current temperature of a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


@pytest.mark.parametrize(
    ("abilities", "config"),
    [(JSON_ONLY, {}), (NATIVE, {"use_native_tools": False})],
    ids=["model-without-tool-call", "agent-without-native-tools"],
)
async def test_json_mode_describes_tools_in_the_system_prompt_and_sends_observations_as_user_messages(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM, abilities: dict[str, bool], config: dict[str, bool]
) -> None:
    fake_server.script(
        action("tool_call", tool_name="weather", tool_args={"city": "Oslo"}, reasoning="Need the weather."),
        action("final_answer", answer="21 degrees", reasoning="Have it."),
        FakeReply.stream(["It is 21 degrees."]),
    )
    log = EventLog()

    await make_agent(make_llm(abilities), registry(WEATHER), **config).run("How warm is Oslo?", sink=log)

    assert log.done.status == "completed" and log.done.answer == "It is 21 degrees."
    first, second, _ = fake_server.requests
    for body in (first, second):
        assert "tools" not in body and "tool_choice" not in body
    system = first["messages"][0]["content"]
    assert "### weather\nCurrent temperature of a city." in system
    assert '"required": ["city"]' in system
    assert '"type": "final_answer"' in system
    assert roles(second) == ["system", "user", "assistant", "user"]
    assert json.loads(second["messages"][2]["content"])["tool_name"] == "weather"
    assert second["messages"][3]["content"] == "Observation from `weather`:\nOslo: 21 degrees"


async def test_unparseable_reply_is_sent_back_with_the_reformat_instruction(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    fake_server.script(
        FakeReply.text("Sure! The answer is probably 42."),
        action("final_answer", answer="42", reasoning="Reformatted."),
        FakeReply.stream(["42."]),
    )
    log = EventLog()

    await make_agent(make_llm(JSON_ONLY), registry(echo_tool())).run("What is 6*7?", sink=log)

    assert log.done.iterations == 2
    assert log.of(ThinkingDone)[0].reasoning == prompts.PARSE_FAILURE_REASONING
    second = fake_server.requests[1]
    assert second["messages"][-2:] == [
        {"role": "assistant", "content": "Sure! The answer is probably 42."},
        {"role": "user", "content": prompts.REFORMAT_INSTRUCTION},
    ]
    assert "## Draft answer\n42" in contents(fake_server.requests[2], "user")[0]


async def test_second_unparseable_reply_in_a_row_is_taken_as_the_answer(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    fake_server.script(
        FakeReply.text("forty-two"),
        FakeReply.text("Still prose: forty-two."),
        FakeReply.stream(["42."]),
    )
    log = EventLog()

    await make_agent(make_llm(JSON_ONLY), registry(echo_tool())).run("What is 6*7?", sink=log)

    assert log.done.status == "completed" and log.done.iterations == 2
    synthesis = contents(fake_server.requests[2], "user")[0]
    assert "## Draft answer\nStill prose: forty-two." in synthesis


async def test_json_mode_drains_an_interrupt_right_after_the_assistant_message_before_the_observation(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    queue = MemoryInterruptQueue()
    release = threading.Event()
    fake_server.script(
        FakeReply.blocked(release, action("tool_call", tool_name="weather", tool_args={"city": "Oslo"})),
        action("final_answer", answer="21 degrees", reasoning="Have it."),
        FakeReply.stream(["21 degrees."]),
    )
    log = EventLog()
    run = asyncio.create_task(
        make_agent(make_llm(JSON_ONLY), registry(WEATHER)).run("Oslo?", sink=log, interrupts=queue)
    )
    await fake_server.wait_for_requests_async(1)
    await queue.put("in Fahrenheit please")
    release.set()
    await asyncio.wait_for(run, timeout=10)

    second = fake_server.requests[1]
    assert roles(second) == ["system", "user", "assistant", "user", "user"]
    assert second["messages"][3]["content"] == "[USER INTERRUPT] in Fahrenheit please"
    assert second["messages"][4]["content"].startswith("Observation from `weather`")
    assert [e.content for e in log.of(Injected)] == ["in Fahrenheit please"]


async def test_json_mode_interrupt_during_a_final_answer_supersedes_it_and_the_loop_goes_on(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    queue = MemoryInterruptQueue()
    release = threading.Event()
    fake_server.script(
        FakeReply.blocked(release, action("final_answer", answer="Hello.", reasoning="Easy.")),
        action("final_answer", answer="Bonjour.", reasoning="In French now."),
        FakeReply.stream(["Bonjour."]),
    )
    log = EventLog()
    run = asyncio.create_task(
        make_agent(make_llm(JSON_ONLY), registry(echo_tool())).run("Greet me.", sink=log, interrupts=queue)
    )
    await fake_server.wait_for_requests_async(1)
    await queue.put("in French")
    release.set()
    await asyncio.wait_for(run, timeout=10)

    assert log.done.iterations == 2
    second = fake_server.requests[1]
    assert json.loads(second["messages"][-2]["content"])["answer"] == "Hello."
    assert second["messages"][-1] == {"role": "user", "content": "[USER INTERRUPT] in French"}
    assert "## Draft answer\nBonjour." in contents(fake_server.requests[2], "user")[0]


async def test_reasoning_content_is_the_reasoning_when_the_json_reasoning_is_empty(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    fake_server.script(
        FakeReply.text(
            json.dumps({"type": "tool_call", "tool_name": "weather", "tool_args": {"city": "Rome"}}),
            reasoning_content="I should look up Rome first.",
        ),
        FakeReply.text(
            json.dumps({"type": "final_answer", "answer": "21", "reasoning": ""}),
            reasoning_content="Rome is 21 degrees, done.",
        ),
        FakeReply.stream(["21."]),
    )
    log = EventLog()

    await make_agent(make_llm(JSON_ONLY), registry(WEATHER)).run("Rome?", sink=log)

    assert [e.reasoning for e in log.of(ThinkingDone)] == [
        "I should look up Rome first.",
        "Rome is 21 degrees, done.",
    ]
