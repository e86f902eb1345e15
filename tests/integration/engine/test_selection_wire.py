"""Tool selection over the wire: forced tool choice over a compact catalog, fallback to every tool."""

from __future__ import annotations

from app.engine.events import PhaseChanged
from app.engine.selection import SELECTION_SCHEMA
from app.llm.openai_client import OpenAICompatibleLLM
from app.tools.registry import Tool, ToolRegistry
from tests.integration.engine.wire import (
    JSON_ONLY,
    EventLog,
    MakeLLM,
    make_agent,
    registry,
    roles,
    sent_tool_names,
    tool,
)
from tests.support.fake_openai import FakeOpenAIServer, FakeReply

TOOL_COUNT = 13
PARAMETER_MARKER = "zz_private_parameter"


def _catalog_tool(n: int) -> Tool:
    async def run(**_: object) -> str:
        return f"result of tool_{n:02d}"

    return tool(
        f"tool_{n:02d}",
        run,
        description=(
            f"Tool number {n} does one very specific job that this sentence describes at great length, "
            "far beyond what a catalog line should carry.\nA second line that must not reach the catalog."
        ),
        parameters={"type": "object", "properties": {PARAMETER_MARKER: {"type": "string"}}},
    )


def _many_tools() -> ToolRegistry:
    return registry(*(_catalog_tool(n) for n in range(TOOL_COUNT)))


async def test_selection_forces_the_tools_schema_over_a_compact_catalog_and_the_loop_gets_only_the_pick(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    fake_server.script(
        FakeReply.tool_calls([("select_tools", {"tools": ["tool_07", "tool_03", "no_such_tool"]})]),
        FakeReply.tool_calls([("tool_03", {})]),
        FakeReply.text("Done with tool 3."),
        FakeReply.stream(["Done."]),
    )
    log = EventLog()

    await make_agent(llm, _many_tools()).run("Use tool three.", sink=log)

    selection, first_loop, second_loop, _ = fake_server.requests
    assert selection["tool_choice"] == {"type": "function", "function": {"name": "select_tools"}}
    (select_fn,) = selection["tools"]
    assert select_fn["function"]["name"] == "select_tools"
    assert select_fn["function"]["parameters"] == SELECTION_SCHEMA
    catalog_prompt = "\n".join(m["content"] for m in selection["messages"])
    assert PARAMETER_MARKER not in str(selection)
    assert "second line" not in catalog_prompt
    catalog_lines = [line for line in catalog_prompt.splitlines() if line.startswith("tool_")]
    assert len(catalog_lines) == TOOL_COUNT
    assert all(len(line) <= 80 for line in catalog_lines)
    assert selection["messages"][-1] == {"role": "user", "content": "Use tool three."}

    assert sent_tool_names(first_loop) == ["tool_07", "tool_03"]
    assert sent_tool_names(second_loop) == ["tool_07", "tool_03"]
    assert "tool_choice" not in first_loop
    assert log.of(PhaseChanged) == [PhaseChanged("selecting_tools", TOOL_COUNT)]
    assert log.events.index(log.of(PhaseChanged)[0]) == 0


async def test_garbage_selection_at_every_level_falls_back_to_the_full_tool_set(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    fake_server.script(
        FakeReply.tool_calls([("select_tools", "tools: tool_01, tool_02")]),  # level 1: not JSON
        FakeReply.text("tool_01 and tool_02"),  # level 2, and its reformat retry
        FakeReply.text("I would pick tool_01."),
        FakeReply.text("no JSON here"),  # level 3, and its reformat retry
        FakeReply.text('{"tools": "tool_01"}'),
        FakeReply.text("Nothing needed."),
        FakeReply.stream(["Nothing needed."]),
    )
    log = EventLog()

    await make_agent(llm, _many_tools()).run("Anything?", sink=log)

    requests = fake_server.requests
    assert requests[1]["response_format"] == {"type": "json_object"}
    assert "response_format" not in requests[3]
    loop = requests[5]
    assert sent_tool_names(loop) == [f"tool_{n:02d}" for n in range(TOOL_COUNT)]
    assert log.done.status == "completed"
    assert log.done.usage["llm_calls"] == 7


async def test_selection_of_only_unknown_names_falls_back_to_the_full_tool_set(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    fake_server.script(
        FakeReply.tool_calls([("select_tools", {"tools": ["web_search", "python"]})]),
        FakeReply.text("Nothing needed."),
        FakeReply.stream(["Nothing needed."]),
    )

    await make_agent(llm, _many_tools()).run("Anything?", sink=EventLog())

    assert len(sent_tool_names(fake_server.requests[1])) == TOOL_COUNT


async def test_json_only_model_selects_from_plain_text_and_the_loop_prompt_describes_only_the_pick(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    fake_server.script(
        FakeReply.text('Here you go: {"tools": ["tool_05"]}'),
        FakeReply.text('{"type": "final_answer", "answer": "Nothing to do.", "reasoning": "Trivial."}'),
        FakeReply.stream(["Nothing to do."]),
    )
    log = EventLog()

    await make_agent(make_llm(JSON_ONLY), _many_tools()).run("Anything for tool five?", sink=log)

    selection, loop, _ = fake_server.requests
    assert "tools" not in selection and "tool_choice" not in selection and "response_format" not in selection
    assert roles(selection) == ["system", "user", "user"]
    assert '"tools"' in selection["messages"][-1]["content"]
    system = loop["messages"][0]["content"]
    assert "### tool_05" in system
    assert [line for line in system.splitlines() if line.startswith("### tool_")] == ["### tool_05"]
    assert log.of(PhaseChanged) == [PhaseChanged("selecting_tools", TOOL_COUNT)]
