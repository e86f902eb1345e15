"""Tool selection over a compact catalog and its fallbacks to the full registry (E-12, E-13)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from app.engine.events import Usage
from app.engine.selection import TOOL_SELECTION_MAX, select_tools, tool_catalog
from app.llm.base import ChatMessage, ChatResult, LLMUnavailableError, TokenUsage, ToolCall
from app.tools.registry import Tool, ToolRegistry
from tests.support.scripted import ScriptedLLM, text

MakeLLM = Callable[..., ScriptedLLM]
PLAIN = {"tool_call": False, "json_mode": False, "streaming": True}
BOTH = {"tool_call": True, "json_mode": True, "streaming": True}


async def _noop(**_: Any) -> str:
    return ""


def make_registry(count: int = 15) -> ToolRegistry:
    return ToolRegistry.of(
        Tool(
            name=f"tool_{i:02d}",
            description=f"Does thing number {i} for the user.\nSecond line with details nobody needs here.",
            parameters={
                "type": "object",
                "properties": {f"secret_param_{i}": {"type": "string", "description": "very long schema"}},
            },
            func=_noop,
        )
        for i in range(count)
    )


def pick(*names: Any) -> ChatResult:
    return ChatResult(
        content=None,
        tool_calls=(ToolCall(id="c1", name="select_tools", arguments=json.dumps({"tools": list(names)})),),
        usage=TokenUsage(10, 5, 15),
    )


def test_catalog_has_one_short_line_per_tool_and_no_parameter_schemas() -> None:
    registry = make_registry()
    registry.register(Tool(name="wordy", description="x" * 300, parameters={}, func=_noop))

    catalog = tool_catalog(registry)

    lines = catalog.splitlines()
    assert len(lines) == len(registry)
    assert all(len(line) <= 80 for line in lines)
    assert lines[0] == "tool_00: Does thing number 0 for the user."
    assert "secret_param" not in catalog
    assert "Second line" not in catalog
    assert "properties" not in catalog


async def test_selection_keeps_the_valid_names_in_the_order_given(scripted_llm: MakeLLM) -> None:
    registry = make_registry()
    llm = scripted_llm([pick("tool_07", "tool_02", "tool_11")], abilities=BOTH)

    selected = await select_tools(llm, "do 7, 2 and 11", registry, usage=Usage())

    assert selected.names() == ["tool_07", "tool_02", "tool_11"]
    assert selected.get("tool_07") is registry.get("tool_07")


async def test_selection_prompt_carries_the_catalog_and_the_question_without_schemas(
    scripted_llm: MakeLLM,
) -> None:
    registry = make_registry()
    llm = scripted_llm([pick("tool_01")], abilities=BOTH)

    await select_tools(llm, "what is thing one?", registry, usage=Usage())

    call = llm.calls[0]
    prompt = "\n".join(m.content or "" for m in call.messages)
    assert tool_catalog(registry) in prompt
    assert "what is thing one?" in prompt
    assert "secret_param" not in prompt
    assert call.kwargs["tools"][0]["function"]["parameters"] == {
        "type": "object",
        "properties": {"tools": {"type": "array", "items": {"type": "string"}}},
        "required": ["tools"],
    }


async def test_selection_keeps_at_most_max_tools_after_dropping_duplicates_and_unknowns(
    scripted_llm: MakeLLM,
) -> None:
    registry = make_registry()
    names = ["tool_00", "tool_00", "nope", "tool_01", "tool_02", "tool_03", "tool_04", "tool_05", "tool_06"]
    llm = scripted_llm([pick(*names)], abilities=BOTH)

    selected = await select_tools(llm, "q", registry, usage=Usage())

    assert TOOL_SELECTION_MAX == 6
    assert selected.names() == ["tool_00", "tool_01", "tool_02", "tool_03", "tool_04", "tool_05"]


async def test_selection_honours_a_smaller_max_tools(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([pick("tool_03", "tool_04", "tool_05")], abilities=BOTH)

    selected = await select_tools(llm, "q", make_registry(), usage=Usage(), max_tools=2)

    assert selected.names() == ["tool_03", "tool_04"]


async def test_selection_matches_names_whose_case_the_model_changed(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([pick("TOOL_03")], abilities=BOTH)

    selected = await select_tools(llm, "q", make_registry(), usage=Usage())

    assert selected.names() == ["tool_03"]


async def test_selection_adds_its_usage_to_the_run_usage(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([pick("tool_03")], abilities=BOTH)
    usage = Usage(llm_calls=2)

    await select_tools(llm, "q", make_registry(), usage=usage)

    assert usage == Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15, llm_calls=3)


async def test_unparseable_selection_falls_back_to_the_full_registry(scripted_llm: MakeLLM) -> None:
    registry = make_registry()
    llm = scripted_llm([text("I would use the first few."), text("still not json")], abilities=PLAIN)
    usage = Usage()

    selected = await select_tools(llm, "q", registry, usage=usage)

    assert selected is registry
    assert usage.llm_calls == 2


async def test_selection_without_a_tools_list_falls_back_to_the_full_registry(scripted_llm: MakeLLM) -> None:
    registry = make_registry()
    llm = scripted_llm([text('{"tools": "tool_01"}'), text('{"picked": ["tool_01"]}')], abilities=PLAIN)

    assert await select_tools(llm, "q", registry, usage=Usage()) is registry


async def test_selection_with_only_invalid_names_falls_back_to_the_full_registry(
    scripted_llm: MakeLLM,
) -> None:
    registry = make_registry()
    llm = scripted_llm([pick("web_search", "calculator", 42)], abilities=BOTH)

    assert await select_tools(llm, "q", registry, usage=Usage()) is registry


async def test_empty_selection_falls_back_to_the_full_registry(scripted_llm: MakeLLM) -> None:
    registry = make_registry()
    llm = scripted_llm([pick()], abilities=BOTH)

    assert await select_tools(llm, "q", registry, usage=Usage()) is registry


async def test_selection_llm_errors_fall_back_to_the_full_registry(scripted_llm: MakeLLM) -> None:
    registry = make_registry()
    llm = scripted_llm([LLMUnavailableError("down"), LLMUnavailableError("still down")], abilities=PLAIN)

    assert await select_tools(llm, "q", registry, usage=Usage()) is registry


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyError("weird")])
async def test_any_exception_during_selection_falls_back_to_the_full_registry(
    scripted_llm: MakeLLM, error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = make_registry()
    llm = scripted_llm([], abilities=BOTH)

    async def exploding(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr("app.engine.selection.structured_llm_call", exploding)

    assert await select_tools(llm, "q", registry, usage=Usage()) is registry


async def test_selection_does_not_swallow_cancellation(scripted_llm: MakeLLM) -> None:
    def cancelled(messages: list[ChatMessage], kwargs: dict[str, Any]) -> ChatResult:
        raise asyncio.CancelledError

    llm = scripted_llm([cancelled], abilities=BOTH)

    with pytest.raises(asyncio.CancelledError):
        await select_tools(llm, "q", make_registry(), usage=Usage())
