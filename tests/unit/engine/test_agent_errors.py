"""Never crash: tool errors, artifacts, LLM failures, usage accounting (E-26, E-27, E-12 wiring)."""

from __future__ import annotations

from app.engine.events import IterationDone, PhaseChanged, ThinkingDone
from app.llm.base import ChatResult, LLMResponseError, LLMUnavailableError, TokenUsage
from app.tools.registry import Artifact, ToolOutput
from tests.support.scripted import StreamScript, json_final, json_tool, native_tools, text
from tests.unit.engine.agent_support import (
    JSON_ONLY,
    NATIVE,
    EventLog,
    MakeLLM,
    answer,
    boom_tool,
    echo_tool,
    make_agent,
    make_tool,
    registry,
    user_texts,
)

# E-26


async def test_unknown_tool_and_tool_exception_become_error_observations_and_the_loop_goes_on(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm(
        [native_tools(("nope", {}), ("boom", {})), text("recovered"), answer("Recovered.")], abilities=NATIVE
    )
    log = EventLog()

    result = await make_agent(llm, registry(boom_tool())).run("q", sink=log)

    not_found, exploded = log.of(IterationDone)
    assert not_found.error is not None and "Tool 'nope' not found" in not_found.error
    assert exploded.error == "RuntimeError: kaboom"
    tool_messages = [m.content for m in llm.calls[1].messages if m.role == "tool"]
    assert tool_messages == [f"Error: {not_found.error}", "Error: RuntimeError: kaboom"]
    assert result.status == "completed" and result.answer == "Recovered."


async def test_artifact_reaches_the_llm_as_a_marker_and_the_event_carries_the_file(
    scripted_llm: MakeLLM,
) -> None:
    body = "<html><body>" + "<p>row</p>" * 500 + "</body></html>"

    async def report(**_: object) -> ToolOutput:
        return ToolOutput(content=body, artifact=Artifact("report.html", "text/html", body))

    llm = scripted_llm([native_tools(("report", {})), text("made it"), answer()], abilities=NATIVE)
    log = EventLog()

    await make_agent(llm, registry(make_tool("report", report))).run("q", sink=log)

    tool_message = next(m for m in llm.calls[1].messages if m.role == "tool")
    assert (tool_message.content or "").startswith(
        "[Artifact generated: report.html] The content is rendered as a preview in the UI"
    )
    assert "<p>row</p>" not in (tool_message.content or "")
    done = log.of(IterationDone)[0]
    assert done.artifact == {"filename": "report.html", "mime_type": "text/html", "content": body}
    assert "<p>row</p>" not in done.observation
    assert "<p>row</p>" not in user_texts(llm.calls[2].messages)[-1]  # nor does synthesis get the body


async def test_artifact_summary_text_is_kept_next_to_the_marker(scripted_llm: MakeLLM) -> None:
    async def chart(**_: object) -> ToolOutput:
        return ToolOutput(
            content="Chart of 12 months.", artifact=Artifact("chart.md", "text/markdown", "# big")
        )

    llm = scripted_llm([native_tools(("chart", {})), text("ok"), answer()], abilities=NATIVE)

    await make_agent(llm, registry(make_tool("chart", chart))).run("q", sink=EventLog())

    tool_message = next(m for m in llm.calls[1].messages if m.role == "tool")
    assert (tool_message.content or "").endswith("\nChart of 12 months.")


# E-27


async def test_llm_unavailable_ends_run_with_failed_done(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [native_tools(("echo", {})), LLMUnavailableError("HTTP 503 after 4 attempts", attempts=4)],
        abilities=NATIVE,
    )
    log = EventLog()

    result = await make_agent(llm).run("q", sink=log)

    assert result.status == "failed"
    assert result.error is not None and "LLM unavailable" in result.error and "503" in result.error
    done = log.done
    assert (done.status, done.error, done.iterations) == ("failed", result.error, 2)
    assert done.usage["llm_calls"] == 5
    assert "answer_start" not in log.kinds
    assert log.kinds[-3:] == ["thinking_start", "thinking_done", "done"]


async def test_malformed_llm_reply_is_retried_on_the_next_iteration(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([LLMResponseError("no choices"), text("fine"), answer()], abilities=NATIVE)
    log = EventLog()

    result = await make_agent(llm).run("q", sink=log)

    assert result.status == "completed" and result.iterations == 2
    assert "no choices" in log.of(ThinkingDone)[0].reasoning


async def test_three_malformed_replies_in_a_row_fail_the_run(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [LLMResponseError("bad 1"), LLMResponseError("bad 2"), LLMResponseError("bad 3")], abilities=NATIVE
    )
    log = EventLog()

    result = await make_agent(llm).run("q", sink=log)

    assert result.status == "failed" and result.iterations == 3
    assert result.error is not None and "3 unusable replies" in result.error and "bad 3" in result.error
    assert log.done.status == "failed"


async def test_malformed_reply_counter_resets_after_a_good_reply(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [
            LLMResponseError("bad"),
            LLMResponseError("bad"),
            native_tools(("echo", {})),
            LLMResponseError("bad"),
            LLMResponseError("bad"),
            text("done"),
            answer(),
        ],
        abilities=NATIVE,
    )

    result = await make_agent(llm).run("q", sink=EventLog())

    assert result.status == "completed" and result.iterations == 6


async def test_malformed_replies_count_toward_max_iterations(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([LLMResponseError("bad"), LLMResponseError("bad"), answer()], abilities=NATIVE)

    result = await make_agent(llm, max_iterations=2).run("q", sink=EventLog())

    assert result.status == "completed" and result.iterations == 2
    assert "I could not finish within 2 steps" in user_texts(llm.calls[-1].messages)[-1]


async def test_usage_sums_selection_loop_checklist_and_synthesis(scripted_llm: MakeLLM) -> None:
    tools = registry(*(echo_tool(f"t{i:02d}") for i in range(13)))

    def reply(content: str, attempts: int = 1) -> ChatResult:
        return ChatResult(content=content, usage=TokenUsage(100, 10, 110), attempts=attempts)

    llm = scripted_llm(
        [
            reply('{"tools": ["t01", "t02", "t03"]}'),  # selection
            reply('{"type": "tool_call", "tool_name": "t01", "tool_args": {}}', attempts=2),
            reply('{"type": "tool_call", "tool_name": "t02", "tool_args": {}}'),
            reply('{"type": "tool_call", "tool_name": "t03", "tool_args": {}}'),
            reply('{"type": "final_answer", "answer": "draft"}'),
            reply('{"type": "final_answer", "answer": "checked"}'),  # after the checklist
            StreamScript(["ok"], usage=TokenUsage(200, 20, 220)),
        ],
        abilities=JSON_ONLY,
    )
    log = EventLog()

    result = await make_agent(llm, tools).run("q", sink=log)

    assert log.of(PhaseChanged) == [PhaseChanged("selecting_tools", 13)]
    expected = {"prompt_tokens": 800, "completion_tokens": 80, "total_tokens": 880, "llm_calls": 8}
    assert log.done.usage == expected
    assert result.usage.as_dict() == expected


async def test_failed_synthesis_call_still_counts_as_an_llm_call(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [text("done"), StreamScript([], error=LLMUnavailableError("down", attempts=3))], abilities=NATIVE
    )
    log = EventLog()

    await make_agent(llm).run("q", sink=log)

    assert log.done.usage["llm_calls"] == 4


# E-12 wiring: the loop sees only the selected tools


async def test_tool_selection_runs_above_threshold_and_the_loop_uses_only_selected_tools(
    scripted_llm: MakeLLM,
) -> None:
    tools = registry(*(echo_tool(f"t{i:02d}") for i in range(13)))
    llm = scripted_llm(
        [text('{"tools": ["t01", "t02"]}'), json_tool("t05", {}), json_final("ok"), answer()],
        abilities=JSON_ONLY,
    )
    log = EventLog()

    await make_agent(llm, tools).run("q", sink=log)

    assert log.events[0] == PhaseChanged("selecting_tools", 13)
    system = llm.calls[1].messages[0].content or ""
    assert "### t01" in system and "### t02" in system and "### t05" not in system
    error = log.of(IterationDone)[0].error
    assert error is not None and "Tool 't05' not found. Available tools: t01, t02" in error


async def test_no_selection_at_or_below_threshold(scripted_llm: MakeLLM) -> None:
    tools = registry(*(echo_tool(f"t{i:02d}") for i in range(12)))
    llm = scripted_llm([json_final("ok"), answer()], abilities=JSON_ONLY)
    log = EventLog()

    await make_agent(llm, tools).run("q", sink=log)

    assert not log.of(PhaseChanged)
    assert "### t11" in (llm.calls[0].messages[0].content or "")


async def test_json_tool_call_for_unknown_tool_in_json_mode_keeps_going(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([json_tool("ghost", {}), json_final("ok"), answer()], abilities=JSON_ONLY)

    result = await make_agent(llm).run("q", sink=EventLog())

    assert result.status == "completed" and result.tools_used == 0
