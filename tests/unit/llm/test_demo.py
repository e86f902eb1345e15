"""DemoLLM on its own: planning, native and JSON-mode replies, structured calls, summaries, streaming.

The prompts come from the engine's own modules, so a wording change there that the demo no longer
understands fails here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import pytest

from app.engine import prompts
from app.engine.context import SUMMARY_SYSTEM_PROMPT
from app.engine.events import Usage
from app.engine.interrupts import merge_interrupts
from app.engine.selection import select_tools
from app.engine.synthesis import TraceStep, synthesis_messages
from app.llm.base import LLM, ChatMessage, ChatResult, StreamEnd, StreamItem, TextDelta
from app.llm.demo import CAPABILITIES, DEMO_NOTE, DemoLLM, math_expression, plan
from app.tools.builtins import default_registry
from app.tools.registry import Tool, ToolRegistry

REGISTRY = default_registry()
TOOLS = REGISTRY.openai_schemas()


def native_start(question: str) -> list[ChatMessage]:
    return [
        ChatMessage(role="system", content=prompts.native_system_prompt()),
        ChatMessage(role="user", content=question, pinned=True),
    ]


def json_start(question: str, registry: ToolRegistry = REGISTRY) -> list[ChatMessage]:
    return [
        ChatMessage(role="system", content=prompts.json_system_prompt(registry)),
        ChatMessage(role="user", content=question, pinned=True),
    ]


def with_native_results(messages: list[ChatMessage], reply: ChatResult, results: Sequence[str]) -> None:
    messages.append(ChatMessage(role="assistant", content=reply.content, tool_calls=reply.tool_calls))
    for call, result in zip(reply.tool_calls, results, strict=True):
        messages.append(ChatMessage(role="tool", content=result, tool_call_id=call.id, name=call.name))


def with_json_result(
    messages: list[ChatMessage], reply: ChatResult, result: str, *, failed: bool = False
) -> None:
    action = json.loads(reply.content or "")
    messages.append(ChatMessage(role="assistant", content=reply.content))
    observation = prompts.json_observation(action["tool_name"], result, failed=failed)
    messages.append(ChatMessage(role="user", content=observation))


def calls_of(reply: ChatResult) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


async def collect(llm: DemoLLM, messages: list[ChatMessage]) -> list[StreamItem]:
    return [item async for item in llm.stream_chat(messages)]


# -- planning --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("What is 17*23?", [("calculator", {"expression": "17*23"})]),
        ("what time is it in Tokyo", [("current_time", {"timezone": "Asia/Tokyo"})]),
        ("What time is it in America/New_York?", [("current_time", {"timezone": "America/New_York"})]),
        ("what time is it?", [("current_time", {"timezone": "UTC"})]),
        ("what is 2 to the power of 10", [("calculator", {"expression": "2**10"})]),
        ("square root of 16 plus 3", [("calculator", {"expression": "sqrt(16)+3"})]),
        ("What is 12 x 7?", [("calculator", {"expression": "12*7"})]),
        ("Convert 5 km to miles", [("unit_convert", {"value": 5, "from_unit": "km", "to_unit": "miles"})]),
        ("How many words in 'to be or not to be'?", [("word_count", {"text": "to be or not to be"})]),
        ("save a note: buy milk", [("save_note", {"title": "buy milk", "content": "buy milk"})]),
        ("list my notes", [("list_notes", {})]),
        ("Tell me a joke", []),
        ("What happened on 2024-01-15", []),
    ],
)
def test_plans_the_tool_call_a_question_needs(
    question: str, expected: list[tuple[str, dict[str, Any]]]
) -> None:
    assert [(c.tool, c.args) for c in plan(question)] == expected


def test_plans_one_call_per_sub_question() -> None:
    question = "What is 2**10 and what time is it in Paris? Convert 100 celsius to fahrenheit; list my notes"

    assert [c.tool for c in plan(question)] == ["calculator", "current_time", "unit_convert", "list_notes"]


def test_and_inside_one_request_does_not_split_it() -> None:
    calls = plan("Write a report about cats and dogs")

    assert [c.tool for c in calls] == ["write_report"]
    assert calls[0].args["title"] == "Report on cats and dogs"


def test_repeated_sub_questions_are_planned_once() -> None:
    assert len(plan("What is 2+2? what is 2+2?")) == 1


@pytest.mark.parametrize("text", ["see " * 8000, "count how many " * 3000, '"' * 30000, "1+" * 16000])
def test_planning_a_huge_question_stays_fast(text: str) -> None:
    started = time.perf_counter()

    plan(text)

    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize(
    ("text", "expression"),
    [
        ("compute (3+4)*2, please", "(3+4)*2"),
        ("what is sqrt(2)*pi", "sqrt(2)*pi"),
        ("in 2024,", None),
        ("hi", None),
    ],
)
def test_math_expression_finds_the_arithmetic_in_a_sentence(text: str, expression: str | None) -> None:
    assert math_expression(text) == expression


# -- native mode -----------------------------------------------------------------------------


async def test_native_mode_asks_for_every_sub_question_in_one_reply() -> None:
    reply = await DemoLLM(delay_s=0).chat(
        native_start("What is 17*23 and what time is it in Tokyo?"), tools=TOOLS
    )

    assert calls_of(reply) == [
        ("calculator", {"expression": "17*23"}),
        ("current_time", {"timezone": "Asia/Tokyo"}),
    ]
    assert reply.finish_reason == "tool_calls"
    assert len({c.id for c in reply.tool_calls}) == 2
    assert reply.content  # the reasoning the UI shows as "thinking"


async def test_native_mode_answers_from_the_tool_results_once_they_are_in() -> None:
    llm = DemoLLM(delay_s=0)
    messages = native_start("What is 17*23?")
    first = await llm.chat(messages, tools=TOOLS)
    with_native_results(messages, first, ["17*23 = 391"])

    final = await llm.chat(messages, tools=TOOLS)

    assert final.tool_calls == ()
    assert final.content == "17*23 = 391"


async def test_native_mode_only_uses_the_tools_it_was_given() -> None:
    calculator_only = [t for t in TOOLS if t["function"]["name"] == "calculator"]

    reply = await DemoLLM(delay_s=0).chat(
        native_start("What is 1+1 and what time is it in Tokyo?"), tools=calculator_only
    )

    assert [name for name, _ in calls_of(reply)] == ["calculator"]


async def test_completion_checklist_and_reflection_get_the_final_answer_again() -> None:
    llm = DemoLLM(delay_s=0)
    messages = native_start("What is 1+1?")
    with_native_results(messages, await llm.chat(messages, tools=TOOLS), ["1+1 = 2"])
    messages.append(ChatMessage(role="assistant", content="1+1 = 2"))
    messages.append(ChatMessage(role="user", content=prompts.completion_checklist(json_mode=False)))
    messages.append(ChatMessage(role="user", content=prompts.self_reflection(6, "What is 1+1?")))

    reply = await llm.chat(messages, tools=TOOLS)

    assert (reply.content, reply.tool_calls) == ("1+1 = 2", ())


async def test_a_follow_up_interrupt_is_planned_too() -> None:
    llm = DemoLLM(delay_s=0)
    messages = native_start("What is 1+1?")
    first = await llm.chat(messages, tools=TOOLS)
    with_native_results(messages, first, ["1+1 = 2"])
    messages.append(
        ChatMessage(role="user", content=merge_interrupts(["also what time is it in London"]), pinned=True)
    )

    reply = await llm.chat(messages, tools=TOOLS)

    assert calls_of(reply) == [("current_time", {"timezone": "Europe/London"})]
    assert reply.tool_calls[0].id != first.tool_calls[0].id


async def test_history_before_the_question_is_not_replanned() -> None:
    history = [
        ChatMessage(role="user", content="What is 5*5?"),
        ChatMessage(role="assistant", content="25"),
    ]
    messages = [
        native_start("what time is it in Sydney")[0],
        *history,
        native_start("what time is it in Sydney")[1],
    ]

    reply = await DemoLLM(delay_s=0).chat(messages, tools=TOOLS)

    assert calls_of(reply) == [("current_time", {"timezone": "Australia/Sydney"})]


async def test_a_question_it_cannot_plan_gets_a_friendly_final_answer() -> None:
    reply = await DemoLLM(delay_s=0).chat(native_start("Tell me a joke"), tools=TOOLS)

    assert reply.tool_calls == ()
    assert reply.content == CAPABILITIES
    assert "demo model" in CAPABILITIES


async def test_it_stops_even_if_the_conversation_hides_what_it_already_did() -> None:
    llm = DemoLLM(delay_s=0)
    messages = native_start("What is 1+1?")
    for i in range(3):  # calls with rewritten arguments it cannot match to its plan
        call_reply = await llm.chat(native_start("What is 9+9?"), tools=TOOLS)
        call = call_reply.tool_calls[0]
        messages.append(
            ChatMessage(role="assistant", tool_calls=(type(call)(f"x{i}", call.name, call.arguments),))
        )
        messages.append(ChatMessage(role="tool", content="9+9 = 18", tool_call_id=f"x{i}"))

    reply = await llm.chat(messages, tools=TOOLS)

    assert reply.tool_calls == ()


# -- JSON mode -------------------------------------------------------------------------------


async def test_json_mode_makes_one_tool_call_per_reply_then_a_final_answer() -> None:
    llm = DemoLLM(delay_s=0)
    messages = json_start("What is 17*23 and what time is it in Tokyo?")

    first = await llm.chat(messages)
    with_json_result(messages, first, "17*23 = 391")
    second = await llm.chat(messages)
    with_json_result(messages, second, "2026-01-15 21:30:00 JST")
    final = await llm.chat(messages)

    assert json.loads(first.content or "") == {
        "type": "tool_call",
        "tool_name": "calculator",
        "tool_args": {"expression": "17*23"},
        "reasoning": "Calculate 17*23.",
    }
    assert json.loads(second.content or "")["tool_args"] == {"timezone": "Asia/Tokyo"}
    action = json.loads(final.content or "")
    assert action["type"] == "final_answer"
    assert action["answer"] == "17*23 = 391\n2026-01-15 21:30:00 JST"
    assert action["reasoning"]
    assert first.tool_calls == second.tool_calls == final.tool_calls == ()


async def test_json_mode_uses_only_the_tools_the_prompt_lists() -> None:
    only_time = REGISTRY.subset(["current_time"])

    reply = await DemoLLM(delay_s=0).chat(json_start("What is 1+1 and what time is it in Rome?", only_time))

    assert json.loads(reply.content or "")["tool_name"] == "current_time"


async def test_json_mode_without_tools_answers_at_once() -> None:
    reply = await DemoLLM(delay_s=0).chat(json_start("What is 1+1?", ToolRegistry()))

    assert json.loads(reply.content or "")["type"] == "final_answer"


async def test_json_mode_reports_a_failed_tool_in_its_answer() -> None:
    llm = DemoLLM(delay_s=0)
    messages = json_start("What is 1/0?")
    with_json_result(messages, await llm.chat(messages), "Error: division by zero", failed=True)

    action = json.loads((await llm.chat(messages)).content or "")

    assert action == {
        "type": "final_answer",
        "answer": "Error: division by zero",
        "reasoning": "The tool results answer the question.",
    }


# -- structured calls and summaries ----------------------------------------------------------


async def unrelated_tool() -> str:
    return "nothing"


async def test_tool_selection_picks_the_tools_the_question_needs() -> None:
    extra = [
        Tool(
            f"extra_{i}",
            f"Unrelated tool number {i}.",
            {"type": "object", "properties": {}},
            unrelated_tool,
        )
        for i in range(10)
    ]
    big = ToolRegistry.of([*REGISTRY, *extra])

    selected = await select_tools(
        DemoLLM(delay_s=0), "What is 3*3 and the time in Tokyo?", big, usage=Usage()
    )

    assert selected.names() == ["calculator", "current_time"]


async def test_forced_function_call_returns_arguments_that_fit_the_schema() -> None:
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "count": {"type": "integer"},
            "labels": {"type": "array", "items": {"type": "string"}},
            "mood": {"type": "string", "enum": ["calm", "busy"]},
            "note": {"type": "string"},
        },
    }
    tool = {"type": "function", "function": {"name": "respond", "parameters": schema}}

    reply = await DemoLLM(delay_s=0).chat(
        native_start("hi"), tools=[tool], tool_choice={"type": "function", "function": {"name": "respond"}}
    )

    assert [c.name for c in reply.tool_calls] == ["respond"]
    args = json.loads(reply.tool_calls[0].arguments)
    assert args["ok"] is False and args["count"] == 0 and args["labels"] == [] and args["mood"] == "calm"
    assert isinstance(args["note"], str)


async def test_json_object_calls_get_an_object_with_the_schema_keys() -> None:
    instruction = (
        "Respond with a single JSON object (verdict) that conforms to this JSON schema:\n"
        '{"type": "object", "properties": {"done": {"type": "boolean"}}}\nReply with the JSON object only.'
    )
    messages = [
        ChatMessage(role="user", content="Is it done?"),
        ChatMessage(role="user", content=instruction),
    ]

    reply = await DemoLLM(delay_s=0).chat(messages, response_format={"type": "json_object"})

    assert json.loads(reply.content or "") == {"done": False}


async def test_compaction_prompt_gets_a_short_summary_keeping_goal_and_tools() -> None:
    request = (
        "The user's goal:\nWhat is 2+2 and the time in Paris?\n\n"
        "Conversation excerpt to summarise (3 messages, oldest first):\n"
        '[assistant called calculator] {"expression": "2+2"}\n[tool result: calculator] 2+2 = 4'
    )
    messages = [
        ChatMessage(role="system", content=SUMMARY_SYSTEM_PROMPT.format(max_tokens=200)),
        ChatMessage(role="user", content=request),
    ]

    reply = await DemoLLM(delay_s=0).chat(messages)

    assert reply.content is not None
    assert "What is 2+2 and the time in Paris?" in reply.content
    assert "calculator" in reply.content and "2+2 = 4" in reply.content
    assert len(reply.content) < 600


# -- streaming synthesis ---------------------------------------------------------------------


def synthesis_prompt(
    steps: Sequence[TraceStep], question: str = "What is 17*23?", draft: str = ""
) -> list[ChatMessage]:
    return synthesis_messages(question, steps, draft, result_chars=2000)


async def test_stream_synthesises_a_markdown_answer_from_the_trace() -> None:
    steps = [
        TraceStep("calculator", {"expression": "17*23"}, "17*23 = 391", None),
        TraceStep(
            "current_time",
            {"timezone": "Asia/Tokyo"},
            "2026-01-15 21:30:00 JST (UTC+09:00), Thursday, in Asia/Tokyo",
            None,
        ),
    ]

    items = await collect(DemoLLM(delay_s=0), synthesis_prompt(steps))

    deltas = [i.text for i in items if isinstance(i, TextDelta)]
    answer = "".join(deltas)
    assert "`17*23` = **391**" in answer
    assert "**Asia/Tokyo**: 2026-01-15 21:30:00 JST" in answer
    assert answer.startswith("### What is 17*23?")
    assert DEMO_NOTE in answer
    assert len(deltas) > 10  # word by word
    assert all(isinstance(i, TextDelta) for i in items[:-1])
    end = items[-1]
    assert isinstance(end, StreamEnd)
    assert end.usage.prompt_tokens > 0 and end.usage.completion_tokens > 0
    assert end.usage.total_tokens == end.usage.prompt_tokens + end.usage.completion_tokens


async def test_stream_mentions_errors_and_artifacts_without_pasting_them() -> None:
    steps = [
        TraceStep("calculator", {"expression": "1/0"}, "Error: division by zero", "division by zero"),
        TraceStep("write_report", {"title": "T"}, prompts.artifact_observation("t.md"), None),
    ]

    answer = "".join(
        i.text for i in await collect(DemoLLM(delay_s=0), synthesis_prompt(steps)) if isinstance(i, TextDelta)
    )

    assert "`calculator` could not answer: division by zero" in answer
    assert "**t.md**" in answer


async def test_stream_without_tools_uses_the_draft_answer() -> None:
    items = await collect(DemoLLM(delay_s=0), synthesis_prompt([], "hi", draft=CAPABILITIES))

    answer = "".join(i.text for i in items if isinstance(i, TextDelta))
    assert answer.startswith(CAPABILITIES)
    assert "Write the reply" not in answer


async def test_the_demo_is_deterministic() -> None:
    steps = [TraceStep("calculator", {"expression": "2+2"}, "2+2 = 4", None)]
    first, second = DemoLLM(delay_s=0), DemoLLM(delay_s=0)

    assert await collect(first, synthesis_prompt(steps)) == await collect(second, synthesis_prompt(steps))
    question = native_start("What is 2+2 and the time in Berlin?")
    assert await first.chat(question, tools=TOOLS) == await second.chat(question, tools=TOOLS)


async def test_stream_waits_delay_s_between_words(monkeypatch: pytest.MonkeyPatch) -> None:
    pauses: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        pauses.append(seconds)

    monkeypatch.setattr("app.llm.demo.asyncio.sleep", fake_sleep)
    items = await collect(DemoLLM(delay_s=0.05), synthesis_prompt([]))

    words = sum(1 for i in items if isinstance(i, TextDelta))
    assert pauses == [0.05] * (words - 1)


# -- protocol --------------------------------------------------------------------------------


async def test_demo_implements_the_llm_protocol_with_every_ability() -> None:
    llm = DemoLLM()

    assert isinstance(llm, LLM)
    assert llm.abilities == {"tool_call": True, "json_mode": True, "streaming": True}
    assert llm.model_name == "demo"
    await llm.aclose()


async def test_usage_grows_with_the_prompt() -> None:
    llm = DemoLLM(delay_s=0)

    short = await llm.chat(native_start("hi"), tools=TOOLS)
    long = await llm.chat(native_start("hi " + "word " * 400), tools=TOOLS)

    assert 0 < short.usage.prompt_tokens < long.usage.prompt_tokens
    assert short.usage.completion_tokens > 0
