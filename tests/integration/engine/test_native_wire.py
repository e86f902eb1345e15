"""Native function calling over the wire: parallel calls, tool message order, interrupts, bad calls."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from app.engine.events import Injected, IterationDone
from app.engine.interrupts import MemoryInterruptQueue
from app.llm.openai_client import OpenAICompatibleLLM
from tests.integration.engine.wire import (
    EventLog,
    constant_tool,
    index_of,
    make_agent,
    registry,
    roles,
    sent_tool_names,
    tool,
)
from tests.support.fake_openai import FakeOpenAIServer, FakeReply


async def test_parallel_tool_results_follow_their_assistant_message_and_the_interrupt_comes_after_them(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    queue = MemoryInterruptQueue()
    right_finished = asyncio.Event()
    left_started = asyncio.Event()

    async def left(**_: Any) -> str:
        left_started.set()
        # Finishes last, so the tool messages can only be in call order if the engine orders them.
        await right_finished.wait()
        return "left result"

    async def right(**_: Any) -> str:
        # Runs only while `left` is in flight: proves the calls of one reply run in parallel.
        await left_started.wait()
        await queue.put("use metric units")
        await queue.put("and be brief")
        right_finished.set()
        return "right result"

    tools = registry(tool("left", left, timeout_s=2), tool("right", right, timeout_s=2))
    fake_server.script(
        FakeReply.tool_calls([("left", {"side": "L"}), ("right", {"side": "R"})]),
        FakeReply.text("Both sides done."),
        FakeReply.stream(["Done", "."]),
    )
    log = EventLog()

    await make_agent(llm, tools).run("Check both sides.", sink=log, interrupts=queue)

    assert log.done.status == "completed"
    assert [e.error for e in log.of(IterationDone)] == [None, None]
    first, second, synthesis = fake_server.requests
    assert sent_tool_names(first) == ["left", "right"]
    assert roles(second) == ["system", "user", "assistant", "tool", "tool", "user"]
    assistant, left_msg, right_msg, interrupt = second["messages"][2:]
    ids = [call["id"] for call in assistant["tool_calls"]]
    assert [call["function"]["name"] for call in assistant["tool_calls"]] == ["left", "right"]
    assert [left_msg["tool_call_id"], right_msg["tool_call_id"]] == ids
    assert (left_msg["content"], right_msg["content"]) == ("left result", "right result")
    assert interrupt["content"].startswith("[USER INTERRUPT]")
    assert "1. use metric units\n2. and be brief" in interrupt["content"]
    assert [e.content for e in log.of(Injected)] == ["use metric units\nand be brief"]
    assert synthesis["stream"] is True


async def test_interrupt_sent_while_the_llm_call_is_in_flight_waits_for_the_tool_results(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    queue = MemoryInterruptQueue()
    release = threading.Event()
    fake_server.script(
        FakeReply.blocked(release, FakeReply.tool_calls([("lookup", {"q": "x"})])),
        FakeReply.text("Found it."),
        FakeReply.stream(["Found."]),
    )
    run = asyncio.create_task(
        make_agent(llm, registry(constant_tool("lookup", "x is 7"))).run(
            "What is x?", sink=EventLog(), interrupts=queue
        )
    )
    await fake_server.wait_for_requests_async(1)
    await queue.put("also tell me y")
    release.set()
    await asyncio.wait_for(run, timeout=10)

    second = fake_server.requests[1]
    assert roles(second) == ["system", "user", "assistant", "tool", "user"]
    assert second["messages"][-1]["content"] == "[USER INTERRUPT] also tell me y"


async def test_tool_arguments_that_are_not_json_become_an_error_observation_and_the_loop_goes_on(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    calls: list[dict[str, Any]] = []

    async def lookup(**kwargs: Any) -> str:
        calls.append(kwargs)
        return "found"

    fake_server.script(
        FakeReply.tool_calls([("lookup", '{"q": "unterminated')]),
        FakeReply.tool_calls([("lookup", {"q": "fixed"})]),
        FakeReply.text("All good."),
        FakeReply.stream(["Good."]),
    )
    log = EventLog()

    await make_agent(llm, registry(tool("lookup", lookup))).run("Look it up.", sink=log)

    assert log.done.status == "completed"
    assert calls == [{"q": "fixed"}]
    bad, good = log.of(IterationDone)
    assert bad.error is not None and "Invalid arguments for tool 'lookup'" in bad.error
    assert "not valid JSON" in bad.error
    assert good.error is None
    second = fake_server.requests[1]
    tool_msg = second["messages"][index_of(second, lambda m: m["role"] == "tool")]
    assert tool_msg["content"] == f"Error: {bad.error}"
    assert tool_msg["tool_call_id"] == second["messages"][2]["tool_calls"][0]["id"]


async def test_a_call_to_an_unknown_tool_becomes_an_error_observation_naming_the_available_tools(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    fake_server.script(
        FakeReply.tool_calls([("teleport", {"to": "Mars"})]),
        FakeReply.text("Cannot teleport."),
        FakeReply.stream(["No."]),
    )
    log = EventLog()

    await make_agent(llm, registry(constant_tool("lookup", "x"))).run("Go to Mars.", sink=log)

    assert log.done.status == "completed"
    (step,) = log.of(IterationDone)
    assert step.error == "Tool 'teleport' not found. Available tools: lookup"
    second = fake_server.requests[1]
    assert roles(second)[-2:] == ["assistant", "tool"]
    assert second["messages"][-1]["content"] == "Error: Tool 'teleport' not found. Available tools: lookup"


async def test_interrupt_during_a_native_final_answer_supersedes_it_and_reaches_synthesis(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    queue = MemoryInterruptQueue()
    release = threading.Event()
    fake_server.script(
        FakeReply.blocked(release, FakeReply.text("Paris.")),
        FakeReply.text("Paris, France."),
        FakeReply.stream(["Paris, France."]),
    )
    log = EventLog()
    run = asyncio.create_task(
        make_agent(llm, registry(constant_tool("noop", ""))).run(
            "Capital of France?", sink=log, interrupts=queue
        )
    )
    await fake_server.wait_for_requests_async(1)
    await queue.put("name the country too")
    release.set()
    await asyncio.wait_for(run, timeout=10)

    assert log.done.iterations == 2
    second, synthesis = fake_server.requests[1:]
    assert second["messages"][-2:] == [
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "[USER INTERRUPT] name the country too"},
    ]
    user = synthesis["messages"][1]["content"]
    assert "## Follow-up messages from the user\n- name the country too" in user
    assert "## Draft answer\nParis, France." in user


def _completion_with_object_arguments(name: str, arguments: dict[str, Any]) -> bytes:
    # Some OpenAI-compatible servers send the arguments as a JSON object instead of a JSON string.
    call = {"id": "call_obj", "type": "function", "function": {"name": name, "arguments": arguments}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice]}
    return json.dumps(body).encode()


async def test_tool_arguments_sent_as_a_json_object_reach_the_tool_and_go_back_as_a_json_string(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    calls: list[dict[str, Any]] = []

    async def lookup(**kwargs: Any) -> str:
        calls.append(kwargs)
        return "found"

    fake_server.script(
        FakeReply.malformed(_completion_with_object_arguments("lookup", {"q": "x", "limit": 2})),
        FakeReply.text("Found."),
        FakeReply.stream(["Found."]),
    )
    log = EventLog()

    await make_agent(llm, registry(tool("lookup", lookup))).run("Look up x.", sink=log)

    assert calls == [{"q": "x", "limit": 2}]
    assert [e.error for e in log.of(IterationDone)] == [None]
    sent_call = fake_server.requests[1]["messages"][2]["tool_calls"][0]
    assert json.loads(sent_call["function"]["arguments"]) == {"q": "x", "limit": 2}
