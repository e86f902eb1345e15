"""The run as a whole: two phases, one LLM, mode choice, iteration limit, events, result messages.

E-01, E-02, E-07, E-14, E-15, E-28.
"""

from __future__ import annotations

import asyncio

import pytest

from app.engine.agent import AgentConfig, ReActAgent
from app.engine.events import (
    AnswerDelta,
    Compacted,
    IterationDone,
    IterationStarted,
    RunDone,
    ThinkingDone,
    ThinkingStarted,
)
from app.engine.prompts import max_iterations_answer
from app.llm.base import ChatMessage
from app.tools.registry import Tool
from tests.support.scripted import StreamScript, json_final, json_tool, native_tools, text
from tests.unit.engine.agent_support import (
    JSON_ONLY,
    NATIVE,
    EventLog,
    MakeLLM,
    add_tool,
    answer,
    boom_tool,
    echo_tool,
    make_agent,
    make_tool,
    registry,
    user_texts,
)


async def test_loop_calls_are_non_streaming_and_synthesis_is_one_streaming_call(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm(
        [native_tools(("add", {"a": 2, "b": 3})), text("5"), StreamScript(["The sum ", "is **5**."])],
        abilities=NATIVE,
    )
    log = EventLog()

    result = await make_agent(llm, registry(add_tool())).run("What is 2+3?", sink=log)

    assert [c.kind for c in llm.calls] == ["chat", "chat", "stream"]
    synthesis_user = user_texts(llm.calls[2].messages)[-1]
    assert "What is 2+3?" in synthesis_user
    assert "`add`" in synthesis_user and "5" in synthesis_user
    assert result.answer == "The sum is **5**."
    assert "".join(d.content for d in log.of(AnswerDelta)) == result.answer
    assert log.done.answer == result.answer and log.done.status == "completed"


async def test_synthesis_trace_truncates_each_tool_result(scripted_llm: MakeLLM) -> None:
    async def big(**_: object) -> str:
        return "x" * 5000

    llm = scripted_llm([native_tools(("big", {})), text("done"), answer()], abilities=NATIVE)

    await make_agent(llm, registry(make_tool("big", big)), synthesis_result_chars=2000).run(
        "q", sink=EventLog()
    )

    synthesis_user = user_texts(llm.calls[2].messages)[-1]
    assert "x" * 2000 in synthesis_user
    assert "x" * 2001 not in synthesis_user
    assert "truncated 3000 characters" in synthesis_user
    # The loop's own LLM saw the whole result.
    tool_message = next(m for m in llm.calls[1].messages if m.role == "tool")
    assert tool_message.content == "x" * 5000


async def test_every_call_of_a_run_goes_to_the_one_llm_instance(scripted_llm: MakeLLM) -> None:
    tools = registry(*(echo_tool(f"t{i:02d}") for i in range(13)))
    llm = scripted_llm(
        [text('{"tools": ["t01"]}'), json_tool("t01", {}), json_final("ok"), answer()],
        abilities=JSON_ONLY,
    )

    await make_agent(llm, tools).run("q", sink=EventLog())

    # selection, two loop calls and synthesis: all recorded by this one scripted model
    assert [c.kind for c in llm.calls] == ["chat", "chat", "chat", "stream"]


@pytest.mark.parametrize(
    ("use_native", "abilities", "native"),
    [
        (True, {"tool_call": True, "streaming": True}, True),
        (False, {"tool_call": True, "streaming": True}, False),
        (True, {"tool_call": False, "streaming": True}, False),
        (True, {"streaming": True}, False),
    ],
)
async def test_native_mode_only_with_flag_and_tool_call_ability(
    scripted_llm: MakeLLM, use_native: bool, abilities: dict[str, bool], native: bool
) -> None:
    reply = text("plain answer") if native else json_final("plain answer")
    llm = scripted_llm([reply, answer()], abilities=abilities)
    agent = make_agent(llm, registry(echo_tool()), use_native_tools=use_native)

    await agent.run("q", sink=EventLog())

    assert agent.native_mode_active is native
    loop_call = llm.calls[0]
    assert (loop_call.kwargs.get("tools") is not None) is native
    system = loop_call.messages[0].content or ""
    assert ("Parameters (JSON Schema)" in system) is not native


async def test_max_iterations_yields_fallback_summary_and_synthesis_still_runs(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [json_tool("echo", {"n": 1}), json_tool("boom", {}), StreamScript(["Partial ", "results."])],
        abilities=JSON_ONLY,
    )
    log = EventLog()

    result = await make_agent(llm, registry(echo_tool(), boom_tool()), max_iterations=2).run("q", sink=log)

    assert result.status == "completed" and result.error is None
    assert result.iterations == 2
    assert result.answer == "Partial results."
    fallback = max_iterations_answer(2, [("echo", None), ("boom", "RuntimeError: kaboom")])
    assert "## Draft answer\n" + fallback in user_texts(llm.calls[2].messages)[-1]
    assert "`echo`: succeeded" in fallback and "`boom`: failed" in fallback
    assert log.kinds[-7:] == [
        "iteration_done",
        "answer_signal",
        "answer_start",
        "answer_delta",
        "answer_delta",
        "answer_done",
        "done",
    ]


async def test_max_iterations_fallback_is_the_answer_when_synthesis_fails(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [
            native_tools(("echo", {"n": 1})),
            native_tools(("boom", {})),
            StreamScript([], error=RuntimeError("down")),
        ],
        abilities=NATIVE,
    )
    log = EventLog()

    result = await make_agent(llm, registry(echo_tool(), boom_tool()), max_iterations=2).run("q", sink=log)

    assert result.status == "completed"
    assert result.answer.startswith("I could not finish within 2 steps")
    assert "- `echo`: succeeded" in result.answer
    assert "- `boom`: failed (RuntimeError: kaboom)" in result.answer
    assert log.done.answer == result.answer


async def test_event_order_of_a_run_with_one_tool_call(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([native_tools(("echo", {"x": 1})), text("done"), answer("A", "B")], abilities=NATIVE)
    log = EventLog()

    await make_agent(llm).run("q", sink=log)

    assert log.kinds == [
        "thinking_start",
        "thinking_done",
        "iteration_start",
        "iteration_done",
        "thinking_start",
        "thinking_done",
        "answer_signal",
        "answer_start",
        "answer_delta",
        "answer_delta",
        "answer_done",
        "done",
    ]
    assert [e.iteration for e in log.of(ThinkingStarted)] == [1, 2]
    started = log.of(IterationStarted)[0]
    assert (started.iteration, started.tool_name, started.tool_args) == (1, "echo", {"x": 1})
    finished = log.of(IterationDone)[0]
    assert finished.observation == 'echo {"x": 1}' and finished.error is None and finished.iter_elapsed >= 0
    done = log.done
    assert done.iterations == 2 and done.elapsed > 0
    assert done.usage == {"prompt_tokens": 30, "completion_tokens": 15, "total_tokens": 45, "llm_calls": 3}


async def test_thinking_done_carries_the_models_narration_in_native_mode(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [native_tools(("echo", {}), content="Let me check."), text("done"), answer()], abilities=NATIVE
    )
    log = EventLog()

    await make_agent(llm).run("q", sink=log)

    assert log.of(ThinkingDone)[0].reasoning == "Let me check."


async def test_iteration_done_observation_is_capped_but_the_llm_sees_all_of_it(scripted_llm: MakeLLM) -> None:
    async def huge(**_: object) -> str:
        return "y" * 20_000

    llm = scripted_llm([native_tools(("huge", {})), text("done"), answer()], abilities=NATIVE)
    log = EventLog()

    await make_agent(llm, registry(make_tool("huge", huge))).run("q", sink=log)

    shown = log.of(IterationDone)[0].observation
    assert len(shown) < 8200 and shown.startswith("y" * 8000) and "truncated 12000 characters" in shown
    tool_message = next(m for m in llm.calls[1].messages if m.role == "tool")
    assert tool_message.content == "y" * 20_000


async def test_context_guard_compacts_before_a_loop_call_and_emits_compact_event(
    scripted_llm: MakeLLM,
) -> None:
    async def big(**_: object) -> str:
        return "z" * 8000

    llm = scripted_llm(
        [
            json_tool("big", {"n": 1}),
            json_tool("big", {"n": 2}),
            text("summary of earlier work"),  # the compaction call
            json_final("done"),
            answer(),
        ],
        abilities=JSON_ONLY,
    )
    log = EventLog()

    await make_agent(llm, registry(make_tool("big", big)), context_token_budget=3000).run("q", sink=log)

    compacted = log.of(Compacted)
    assert len(compacted) == 1
    index = log.events.index(compacted[0])
    assert log.events[index + 1] == ThinkingStarted(3)
    loop_call = llm.calls[3].messages
    assert len(loop_call) == compacted[0].kept_messages
    assert any("summary of earlier work" in (m.content or "") for m in loop_call)
    assert loop_call[1].content == "q"  # the pinned question survived


async def test_history_precedes_the_question_and_result_messages_are_the_new_ones(
    scripted_llm: MakeLLM,
) -> None:
    history = [ChatMessage(role="user", content="earlier"), ChatMessage(role="assistant", content="reply")]
    llm = scripted_llm([native_tools(("echo", {})), text("draft"), answer("Final.")], abilities=NATIVE)

    result = await make_agent(llm).run("now?", sink=EventLog(), history=history)

    first = llm.calls[0].messages
    assert [m.content for m in first[1:]] == ["earlier", "reply", "now?"]
    assert [m.role for m in result.messages] == ["user", "assistant", "tool", "assistant"]
    assert result.messages[0].content == "now?" and result.messages[0].pinned
    assert result.messages[1].tool_calls
    assert result.messages[-1].content == "Final."
    assert result.tools_used == 1


async def test_configured_system_prompt_is_prepended_to_the_loop_prompt(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([text("hi"), answer()], abilities=NATIVE)

    await make_agent(llm, system_prompt="Always answer like a pirate.").run("q", sink=EventLog())

    system = llm.calls[0].messages[0]
    assert system.role == "system"
    assert (system.content or "").startswith("Always answer like a pirate.")
    assert "Always answer like a pirate." in (llm.calls[1].messages[0].content or "")


async def test_run_without_tools_answers_directly(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([text("Hello!"), answer("Hello there!")], abilities=NATIVE)
    log = EventLog()

    result = await ReActAgent(llm, registry()).run("hi", sink=log)

    assert llm.calls[0].kwargs.get("tools") is None  # an empty tools list is not sent
    assert result.answer == "Hello there!" and result.tools_used == 0
    assert log.done.status == "completed"


async def test_a_failing_sink_still_ends_the_run_without_raising(scripted_llm: MakeLLM) -> None:
    seen: list[str] = []

    async def sink(event: object) -> None:
        seen.append(type(event).__name__)
        if type(event).__name__ == "IterationStarted":
            raise ConnectionError("bus down")

    llm = scripted_llm([native_tools(("echo", {}))], abilities=NATIVE)

    result = await make_agent(llm).run("q", sink=sink)

    assert result.status == "failed"
    assert result.error is not None and "bus down" in result.error
    assert seen[-1] == "RunDone"


async def test_cancellation_propagates_out_of_run(scripted_llm: MakeLLM) -> None:
    entered = asyncio.Event()

    async def hang(**_: object) -> str:
        entered.set()
        await asyncio.Event().wait()
        return "never"

    llm = scripted_llm([native_tools(("hang", {}))], abilities=NATIVE)
    log = EventLog()
    agent = ReActAgent(llm, registry(Tool("hang", "hangs", {}, hang, timeout_s=30)), AgentConfig())
    task = asyncio.create_task(agent.run("q", sink=log))
    await asyncio.wait_for(entered.wait(), 5)

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not log.of(RunDone)
