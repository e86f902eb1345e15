"""JSON mode: tools in the prompt, JSON actions, observations as user messages (E-05, E-08, E-09)."""

from __future__ import annotations

import json

from app.engine.events import IterationDone, IterationStarted, ThinkingDone
from app.engine.prompts import PARSE_FAILURE_REASONING, REFORMAT_INSTRUCTION
from tests.support.scripted import StreamScript, json_final, json_tool, text
from tests.unit.engine.agent_support import (
    JSON_ONLY,
    EventLog,
    MakeLLM,
    add_tool,
    answer,
    make_agent,
    registry,
    roles,
    user_texts,
)


async def test_json_mode_describes_tools_in_system_prompt_and_returns_observations_as_user_messages(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm([json_tool("add", {"a": 2, "b": 40}), json_final("42"), answer()], abilities=JSON_ONLY)
    log = EventLog()

    await make_agent(llm, registry(add_tool())).run("2+40?", sink=log)

    first = llm.calls[0]
    assert "tools" not in first.kwargs
    system = first.messages[0].content or ""
    assert "### add" in system and "Add two integers." in system
    assert '"required": ["a", "b"]' in system
    assert '"type": "tool_call"' in system and '"type": "final_answer"' in system
    second = llm.calls[1].messages
    assert roles(second) == ["system", "user", "assistant", "user"]
    assert second[-1].content == "Observation from `add`:\n42"
    assert log.of(IterationDone)[0].observation == "42"


async def test_json_mode_runs_one_tool_per_iteration(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [json_tool("echo", {"n": 1}), json_tool("echo", {"n": 2}), json_final("done"), answer()],
        abilities=JSON_ONLY,
    )
    log = EventLog()

    await make_agent(llm).run("q", sink=log)

    assert [(e.iteration, e.tool_args) for e in log.of(IterationStarted)] == [(1, {"n": 1}), (2, {"n": 2})]


async def test_json_tool_error_observation_is_labelled_as_error(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([json_tool("missing", {}), json_final("sorry"), answer()], abilities=JSON_ONLY)

    await make_agent(llm).run("q", sink=EventLog())

    observation = user_texts(llm.calls[1].messages)[-1]
    assert observation.startswith("Observation from `missing` (error):\nError: Tool 'missing' not found")


async def test_json_parse_failure_retries_with_reformat_prompt_and_counts_toward_max_iterations(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm([text("I think the answer is 4"), json_final("4"), answer("4")], abilities=JSON_ONLY)
    log = EventLog()

    result = await make_agent(llm, max_iterations=2).run("2+2?", sink=log)

    retry = llm.calls[1].messages
    assert retry[-2].role == "assistant" and retry[-2].content == "I think the answer is 4"
    assert retry[-1].role == "user" and retry[-1].content == REFORMAT_INSTRUCTION
    assert log.of(ThinkingDone)[0].reasoning == PARSE_FAILURE_REASONING
    assert result.iterations == 2 and result.answer == "4"


async def test_an_unparseable_reply_on_the_last_iteration_is_the_answer(scripted_llm: MakeLLM) -> None:
    """No iteration is left for the reformat retry: the raw reply stands as the final answer it was
    parsed as, rather than the limit's fallback, which would throw its text away."""
    # Synthesis fails, so the answer is the loop's own (E-04), which is what is under test here.
    llm = scripted_llm(
        [json_tool("add", {"a": 1, "b": 1}), text("It is 2."), StreamScript([], error=RuntimeError("down"))],
        abilities=JSON_ONLY,
    )

    result = await make_agent(llm, max_iterations=2).run("q", sink=EventLog())

    assert result.iterations == 2
    assert result.answer == "It is 2."


async def test_second_consecutive_parse_failure_makes_the_raw_content_the_answer(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm(
        [text("first mess"), text("Paris, obviously."), StreamScript([], error=RuntimeError("down"))],
        abilities=JSON_ONLY,
    )

    result = await make_agent(llm).run("Capital of France?", sink=EventLog())

    assert result.iterations == 2
    assert result.answer == "Paris, obviously."


async def test_parse_failures_separated_by_a_good_reply_each_get_a_reformat_retry(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm(
        [text("mess 1"), json_tool("echo", {}), text("mess 2"), json_final("ok"), answer()],
        abilities=JSON_ONLY,
    )

    result = await make_agent(llm).run("q", sink=EventLog())

    assert result.iterations == 4
    assert user_texts(llm.calls[3].messages)[-1] == REFORMAT_INSTRUCTION


async def test_reasoning_content_fills_empty_json_reasoning(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [
            text(
                json.dumps({"type": "tool_call", "tool_name": "echo", "tool_args": {}, "reasoning": ""}),
                reasoning_content="I should echo first.",
            ),
            text(
                json.dumps({"type": "final_answer", "answer": "ok", "reasoning": "own reasoning"}),
                reasoning_content="ignored",
            ),
            answer(),
        ],
        abilities=JSON_ONLY,
    )
    log = EventLog()

    await make_agent(llm).run("q", sink=log)

    assert [e.reasoning for e in log.of(ThinkingDone)] == ["I should echo first.", "own reasoning"]


async def test_json_action_embedded_in_prose_is_still_understood(scripted_llm: MakeLLM) -> None:
    reply = 'Sure! ```json\n{"type": "tool_call", "tool_name": "echo", "tool_args": {"k": "v"}}\n```'
    llm = scripted_llm([text(reply), json_final("done"), answer()], abilities=JSON_ONLY)
    log = EventLog()

    await make_agent(llm).run("q", sink=log)

    assert log.of(IterationStarted)[0].tool_args == {"k": "v"}


async def test_json_tool_args_that_are_not_an_object_become_an_error_observation(
    scripted_llm: MakeLLM,
) -> None:
    reply = json.dumps({"type": "tool_call", "tool_name": "echo", "tool_args": "[1, 2]"})
    llm = scripted_llm([text(reply), json_final("done"), answer()], abilities=JSON_ONLY)
    log = EventLog()

    result = await make_agent(llm).run("q", sink=log)

    done = log.of(IterationDone)[0]
    assert done.error is not None and "expected a JSON object" in done.error
    assert result.tools_used == 0
