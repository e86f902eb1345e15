"""Drift guards inside a run: self-reflection, cycle detection, completion checklist (E-19 to E-21)."""

from __future__ import annotations

from typing import Any

from app.engine.prompts import REFORMAT_INSTRUCTION, completion_checklist, cycle_warning
from tests.support.scripted import json_final, json_tool, native_tools, text
from tests.unit.engine.agent_support import (
    JSON_ONLY,
    NATIVE,
    EventLog,
    MakeLLM,
    answer,
    make_agent,
    roles,
    user_texts,
)

CYCLE_TEXT = (
    "You have called `echo` with identical arguments 3 times and received the same result. "
    "Please try a different approach or tool."
)


def reflections(texts: list[str]) -> list[str]:
    return [t for t in texts if t.startswith("[Self-reflection]")]


# E-19 self-reflection


async def test_reflection_injected_after_every_interval_of_real_tool_calls(scripted_llm: MakeLLM) -> None:
    replies: list[Any] = [json_tool("echo", {"i": i}) for i in range(4)]
    llm = scripted_llm([*replies, json_final("ok"), answer()], abilities=JSON_ONLY)

    await make_agent(llm, self_reflection_interval=2, completion_check=False).run("my goal", sink=EventLog())

    # after call 2 and call 4, right after the observation
    assert reflections(user_texts(llm.calls[1].messages)) == []
    after_two = llm.calls[2].messages
    assert (after_two[-1].content or "").startswith("[Self-reflection] You have made 2 tool calls")
    assert '"my goal"' in (after_two[-1].content or "")
    assert (after_two[-2].content or "").startswith("Observation from `echo`")
    assert len(reflections(user_texts(llm.calls[4].messages))) == 2


async def test_with_the_defaults_the_first_reflection_follows_the_sixth_tool_call(
    scripted_llm: MakeLLM,
) -> None:
    """E-19's interval is 6 (``REACT_SELF_REFLECTION_INTERVAL``) and E-14's limit 50 by default."""
    replies: list[Any] = [json_tool("echo", {"i": i}) for i in range(6)]
    llm = scripted_llm([*replies, json_final("ok"), answer()], abilities=JSON_ONLY)
    agent = make_agent(llm, completion_check=False)
    assert (agent.config.self_reflection_interval, agent.config.max_iterations) == (6, 50)

    await agent.run("my goal", sink=EventLog())

    assert reflections(user_texts(llm.calls[5].messages)) == []  # after 5 calls
    after_six = user_texts(llm.calls[6].messages)
    assert reflections(after_six) == [after_six[-1]]
    assert after_six[-1].startswith("[Self-reflection] You have made 6 tool calls")


async def test_reflection_not_counted_for_parse_retries(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [
            json_tool("echo", {"i": 1}),
            text("garbage"),
            json_tool("echo", {"i": 2}),
            json_final("ok"),
            answer(),
        ],
        abilities=JSON_ONLY,
    )

    await make_agent(llm, self_reflection_interval=2, completion_check=False).run("q", sink=EventLog())

    texts = user_texts(llm.calls[3].messages)
    assert REFORMAT_INSTRUCTION in texts
    assert len(reflections(texts)) == 1  # two real calls, not three iterations
    assert reflections(user_texts(llm.calls[2].messages)) == []


async def test_reflection_not_counted_for_blocked_or_unknown_tools(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [json_tool("nope", {}), json_tool("echo", {}), json_final("ok"), answer()], abilities=JSON_ONLY
    )

    await make_agent(llm, self_reflection_interval=2, completion_check=False).run("q", sink=EventLog())

    assert reflections(user_texts(llm.calls[2].messages)) == []


async def test_native_reflection_comes_after_all_tool_results_of_the_reply(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [native_tools(("echo", {"i": 1}), ("echo", {"i": 2}), ("echo", {"i": 3})), text("ok"), answer()],
        abilities=NATIVE,
    )

    await make_agent(llm, self_reflection_interval=2, completion_check=False).run("q", sink=EventLog())

    second = llm.calls[1].messages
    assert roles(second)[-5:] == ["assistant", "tool", "tool", "tool", "user"]
    assert (second[-1].content or "").startswith("[Self-reflection] You have made 3 tool calls")
    assert len(reflections(user_texts(second))) == 1


# E-20 cycle detection


async def test_cycle_warning_injected_after_third_identical_call_and_not_emitted_as_event(
    scripted_llm: MakeLLM,
) -> None:
    same = json_tool("echo", {"q": "x", "n": 1})
    reordered = json_tool("echo", {"n": 1, "q": "x"})
    llm = scripted_llm([same, same, reordered, json_final("ok"), answer()], abilities=JSON_ONLY)
    log = EventLog()

    result = await make_agent(llm, completion_check=False).run("q", sink=log)

    assert CYCLE_TEXT not in user_texts(llm.calls[2].messages)
    fourth = llm.calls[3].messages
    assert fourth[-1].role == "user" and fourth[-1].content == CYCLE_TEXT
    assert CYCLE_TEXT == cycle_warning("echo", 3)
    assert all(CYCLE_TEXT not in repr(e) for e in log.events)
    assert all(m.content != CYCLE_TEXT for m in result.messages)


async def test_different_arguments_do_not_count_as_a_cycle(scripted_llm: MakeLLM) -> None:
    replies: list[Any] = [json_tool("echo", {"n": i}) for i in range(3)]
    llm = scripted_llm([*replies, json_final("ok"), answer()], abilities=JSON_ONLY)

    await make_agent(llm, completion_check=False).run("q", sink=EventLog())

    assert not any("identical arguments" in t for t in user_texts(llm.calls[3].messages))


async def test_cycle_detection_counts_parallel_native_calls(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [native_tools(("echo", {}), ("echo", {}), ("echo", {})), text("ok"), answer()], abilities=NATIVE
    )

    await make_agent(llm, completion_check=False).run("q", sink=EventLog())

    second = llm.calls[1].messages
    assert roles(second)[-5:] == ["assistant", "tool", "tool", "tool", "user"]
    assert second[-1].content == cycle_warning("echo", 3)


async def test_cycle_tracker_resets_between_runs(scripted_llm: MakeLLM) -> None:
    call = json_tool("echo", {"same": True})
    llm = scripted_llm(
        [call, call, json_final("a"), answer(), call, call, json_final("b"), answer()], abilities=JSON_ONLY
    )
    agent = make_agent(llm, completion_check=False)

    await agent.run("first", sink=EventLog())
    await agent.run("second", sink=EventLog())

    assert not any("identical arguments" in t for t in user_texts(llm.calls[-2].messages))


# E-21 completion checklist


async def test_checklist_fires_once_per_run(scripted_llm: MakeLLM) -> None:
    replies: list[Any] = [json_tool("echo", {"i": i}) for i in range(3)]
    llm = scripted_llm(
        [*replies, json_final("draft"), json_final("verified"), answer()],
        abilities=JSON_ONLY,
    )

    result = await make_agent(llm).run("q", sink=EventLog())

    checklist = completion_checklist(json_mode=True)
    after_draft = llm.calls[4].messages
    assert after_draft[-1].content == checklist
    assert [c.kind for c in llm.calls].count("chat") == 5  # one extra call, then "verified" is accepted
    assert result.iterations == 5
    assert "## Draft answer\nverified" in (llm.calls[5].messages[-1].content or "")
    assert all(m.content != checklist for m in result.messages)


async def test_model_may_go_back_to_tools_after_the_checklist(scripted_llm: MakeLLM) -> None:
    replies: list[Any] = [native_tools(("echo", {"i": i})) for i in range(3)]
    llm = scripted_llm(
        [*replies, text("draft"), native_tools(("echo", {"i": 9})), text("final"), answer()],
        abilities=NATIVE,
    )

    result = await make_agent(llm).run("q", sink=EventLog())

    # the second "done" is accepted without a second checklist
    assert result.iterations == 6 and result.tools_used == 4
    assert user_texts(llm.calls[5].messages).count(completion_checklist(json_mode=False)) == 1


async def test_checklist_needs_the_minimum_number_of_tools(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [json_tool("echo", {"i": 1}), json_tool("echo", {"i": 2}), json_final("ok"), answer()],
        abilities=JSON_ONLY,
    )

    result = await make_agent(llm, completion_check_min_tools=3).run("q", sink=EventLog())

    assert result.iterations == 3


async def test_checklist_never_fires_for_runs_without_tools(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([text("hello"), answer()], abilities=NATIVE)

    result = await make_agent(llm, completion_check_min_tools=1).run("hi", sink=EventLog())

    assert result.iterations == 1


async def test_checklist_can_be_switched_off(scripted_llm: MakeLLM) -> None:
    replies: list[Any] = [native_tools(("echo", {"i": i})) for i in range(3)]
    llm = scripted_llm([*replies, text("done"), answer()], abilities=NATIVE)

    result = await make_agent(llm, completion_check=False).run("q", sink=EventLog())

    assert result.iterations == 4


async def test_checklist_is_skipped_when_no_iteration_is_left(scripted_llm: MakeLLM) -> None:
    replies: list[Any] = [native_tools(("echo", {"i": i})) for i in range(3)]
    llm = scripted_llm([*replies, text("done"), answer()], abilities=NATIVE)

    result = await make_agent(llm, max_iterations=4).run("q", sink=EventLog())

    assert result.iterations == 4
    assert "## Draft answer\ndone" in (llm.calls[4].messages[-1].content or "")
