"""Drift guards as the model receives them: cycle warning, self-reflection, completion checklist."""

from __future__ import annotations

from app.engine import prompts
from app.llm.openai_client import OpenAICompatibleLLM
from tests.integration.engine.wire import (
    EventLog,
    contents,
    echo_tool,
    make_agent,
    non_stream,
    registry,
    roles,
)
from tests.support.fake_openai import FakeOpenAIServer, FakeReply

CYCLE_WARNING = (
    "You have called `echo` with identical arguments 3 times and received the same result. "
    "Please try a different approach or tool."
)


async def test_third_identical_call_injects_the_cycle_warning_without_an_event(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    same = FakeReply.tool_calls([("echo", {"text": "again"})])
    fake_server.script(same, same, same, FakeReply.text("Giving up."), FakeReply.stream(["Stopped."]))
    log = EventLog()

    await make_agent(llm, registry(echo_tool()), completion_check=False).run("Loop.", sink=log)

    loop_requests = non_stream(fake_server.requests)
    assert len(loop_requests) == 4
    for body in loop_requests[:3]:
        assert not any("identical arguments" in c for c in contents(body, "user"))
    fourth = loop_requests[3]
    assert roles(fourth)[-3:] == ["assistant", "tool", "user"]
    assert fourth["messages"][-1]["content"] == CYCLE_WARNING
    assert "identical arguments" not in log.wire_text()
    assert log.done.status == "completed"


async def test_self_reflection_comes_after_all_tool_results_once_six_real_calls_were_made(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    fake_server.script(
        FakeReply.tool_calls([("echo", {"n": n}) for n in range(4)]),
        FakeReply.tool_calls([("echo", {"n": n}) for n in range(4, 7)]),
        FakeReply.text("Seven echoes."),
        FakeReply.stream(["Seven."]),
    )
    log = EventLog()

    await make_agent(llm, registry(echo_tool()), completion_check=False).run("Echo seven times.", sink=log)

    second, third = non_stream(fake_server.requests)[1:]
    assert not any(c.startswith("[Self-reflection]") for c in contents(second, "user"))
    assert roles(third)[-5:] == ["assistant", "tool", "tool", "tool", "user"]
    assert third["messages"][-1]["content"] == prompts.self_reflection(7, "Echo seven times.")
    assert third["messages"][-1]["content"].startswith("[Self-reflection] You have made 7 tool calls")
    assert "[Self-reflection]" not in log.wire_text()


async def test_completion_checklist_is_sent_once_after_three_tools_even_when_the_model_goes_back_to_tools(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    checklist = prompts.completion_checklist(json_mode=False)
    fake_server.script(
        FakeReply.tool_calls([("echo", {"n": 1}), ("echo", {"n": 2}), ("echo", {"n": 3})]),
        FakeReply.text("Draft: 1, 2, 3."),
        FakeReply.tool_calls([("echo", {"n": 4})]),
        FakeReply.text("Final: 1, 2, 3, 4."),
        FakeReply.stream(["1, 2, 3, 4."]),
    )
    log = EventLog()

    await make_agent(llm, registry(echo_tool())).run("Count.", sink=log)

    loop_requests = non_stream(fake_server.requests)
    assert len(loop_requests) == 4
    third = loop_requests[2]
    assert third["messages"][-2:] == [
        {"role": "assistant", "content": "Draft: 1, 2, 3."},
        {"role": "user", "content": checklist},
    ]
    assert contents(loop_requests[3], "user").count(checklist) == 1
    assert log.done.iterations == 4
    assert "## Draft answer\nFinal: 1, 2, 3, 4." in contents(fake_server.requests[-1], "user")[0]


async def test_no_completion_checklist_when_fewer_than_three_tools_were_used(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    fake_server.script(
        FakeReply.tool_calls([("echo", {"n": 1}), ("echo", {"n": 2})]),
        FakeReply.text("1 and 2."),
        FakeReply.stream(["1 and 2."]),
    )
    log = EventLog()

    await make_agent(llm, registry(echo_tool())).run("Count to two.", sink=log)

    assert log.done.iterations == 2
    assert len(non_stream(fake_server.requests)) == 2
