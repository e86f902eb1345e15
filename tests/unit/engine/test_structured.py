"""structured_llm_call levels, retries, fallbacks and usage; extract_json on free text (E-10, E-11)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from app.engine.events import Usage
from app.engine.structured import (
    REFORMAT_PROMPT,
    StructuredOutputError,
    extract_json,
    structured_llm_call,
)
from app.llm.base import ChatMessage, ChatResult, LLMResponseError, LLMUnavailableError, TokenUsage, ToolCall
from tests.support.scripted import ScriptedLLM, text

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
QUESTION = [ChatMessage(role="user", content="Plan a trip to Lisbon")]

BOTH = {"tool_call": True, "json_mode": True, "streaming": True}
JSON_ONLY = {"tool_call": False, "json_mode": True, "streaming": True}
PLAIN = {"tool_call": False, "json_mode": False, "streaming": True}
TOOLS_ONLY = {"tool_call": True, "json_mode": False, "streaming": True}

MakeLLM = Callable[..., ScriptedLLM]


def fc(arguments: str, name: str = "respond") -> ChatResult:
    return ChatResult(
        content=None,
        tool_calls=(ToolCall(id="call_1", name=name, arguments=arguments),),
        usage=TokenUsage(10, 5, 15),
    )


def garbage() -> ChatResult:
    return text("I am not sure what you mean.")


# --- extract_json -------------------------------------------------------------------------------


def test_extract_json_reads_a_bare_object() -> None:
    assert extract_json('{"a": 1}') == {"a": 1}


def test_extract_json_reads_a_fenced_block_surrounded_by_prose() -> None:
    reply = 'Sure! Here it is:\n```json\n{"city": "Lisbon", "days": 3}\n```\nHope that helps.'
    assert extract_json(reply) == {"city": "Lisbon", "days": 3}


def test_extract_json_reads_an_unlabelled_fence() -> None:
    assert extract_json('```\n{"ok": true}\n```') == {"ok": True}


def test_extract_json_finds_the_first_balanced_object_in_prose() -> None:
    reply = 'The answer is {"a": {"b": [1, 2]}} and then {"c": 3}.'
    assert extract_json(reply) == {"a": {"b": [1, 2]}}


def test_extract_json_ignores_braces_inside_strings() -> None:
    reply = 'Result: {"text": "a } tricky { string \\" with quote", "n": 1} done'
    assert extract_json(reply) == {"text": 'a } tricky { string " with quote', "n": 1}


def test_extract_json_skips_a_brace_span_that_is_not_json() -> None:
    reply = 'In code we write {x = 1} but the data is {"x": 1}'
    assert extract_json(reply) == {"x": 1}


@pytest.mark.parametrize("reply", ["", "no json here", "[1, 2, 3]", '{"unterminated": ', "{not: json}"])
def test_extract_json_returns_none_when_no_object_parses(reply: str) -> None:
    assert extract_json(reply) is None


# --- levels and exact call counts ---------------------------------------------------------------


async def test_level_1_forces_the_schema_function_and_parses_its_arguments(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([fc('{"city": "Lisbon", "days": 3}', name="trip")], abilities=BOTH)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA, schema_name="trip")

    assert (result.value, result.level) == ({"city": "Lisbon", "days": 3}, 1)
    kwargs = llm.calls[0].kwargs
    assert kwargs["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "trip",
                "description": kwargs["tools"][0]["function"]["description"],
                "parameters": SCHEMA,
            },
        }
    ]
    assert kwargs["tool_choice"] == {"type": "function", "function": {"name": "trip"}}
    assert llm.calls[0].messages == QUESTION


async def test_level_2_uses_json_object_response_format_and_describes_the_schema(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm([text('{"city": "Porto"}')], abilities=JSON_ONLY)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    assert (result.value, result.level) == ({"city": "Porto"}, 2)
    call = llm.calls[0]
    assert call.kwargs["response_format"] == {"type": "json_object"}
    assert "tools" not in call.kwargs or call.kwargs["tools"] is None
    instruction = call.messages[-1].content or ""
    assert '"city"' in instruction and "JSON" in instruction


async def test_level_3_plain_text_sends_no_format_constraint(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([text('Here you go: {"city": "Faro"}')], abilities=PLAIN)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    assert (result.value, result.level) == ({"city": "Faro"}, 3)
    assert llm.calls[0].kwargs.get("response_format") is None
    assert llm.calls[0].kwargs.get("tools") is None


@pytest.mark.parametrize(
    ("abilities", "calls", "levels"),
    [
        (BOTH, 5, ["native", "json", "json", "plain", "plain"]),
        (JSON_ONLY, 4, ["json", "json", "plain", "plain"]),
        (PLAIN, 2, ["plain", "plain"]),
        (TOOLS_ONLY, 3, ["native", "plain", "plain"]),
    ],
)
async def test_worst_case_call_count_per_ability_combination(
    scripted_llm: MakeLLM, abilities: dict[str, bool], calls: int, levels: list[str]
) -> None:
    llm = scripted_llm([garbage() for _ in range(calls)], abilities=abilities)

    with pytest.raises(StructuredOutputError):
        await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    assert len(llm.calls) == calls
    seen = []
    for call in llm.calls:
        if call.kwargs.get("tools"):
            seen.append("native")
        elif call.kwargs.get("response_format") == {"type": "json_object"}:
            seen.append("json")
        else:
            seen.append("plain")
    assert seen == levels


async def test_level_1_failure_degrades_to_level_2_without_retrying_level_1(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([fc("not json"), text('{"city": "Braga"}')], abilities=BOTH)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    assert (result.value, result.level) == ({"city": "Braga"}, 2)
    assert len(llm.calls) == 2


async def test_level_1_reply_without_a_tool_call_degrades(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([text('{"city": "ignored at level 1"}'), text('{"city": "Evora"}')], abilities=BOTH)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    assert result.level == 2
    assert result.value == {"city": "Evora"}


async def test_level_1_arguments_that_are_a_json_array_degrade(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([fc("[1, 2]"), text('{"city": "Sintra"}')], abilities=BOTH)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    assert result.level == 2


async def test_level_1_llm_error_degrades_to_the_next_level(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([LLMResponseError("no choices"), text('{"city": "Tavira"}')], abilities=TOOLS_ONLY)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    assert (result.value, result.level) == ({"city": "Tavira"}, 3)


async def test_level_2_retry_appends_the_raw_reply_and_the_reformat_prompt(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [text("Lisbon, three days"), text('{"city": "Lisbon", "days": 3}')], abilities=JSON_ONLY
    )

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    assert (result.value, result.level) == ({"city": "Lisbon", "days": 3}, 2)
    retry = llm.calls[1].messages
    assert retry[: len(llm.calls[0].messages)] == llm.calls[0].messages
    assert retry[-2] == ChatMessage(role="assistant", content="Lisbon, three days")
    assert retry[-1].role == "user"
    assert (retry[-1].content or "").startswith(REFORMAT_PROMPT)
    assert llm.calls[1].kwargs["response_format"] == {"type": "json_object"}


def test_reformat_prompt_says_the_reply_was_not_valid_json() -> None:
    assert REFORMAT_PROMPT.startswith("Your previous response could not be parsed as valid JSON")


async def test_level_3_retry_uses_the_reformat_prompt(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([garbage(), text('```json\n{"city": "Lagos"}\n```')], abilities=PLAIN)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    assert (result.value, result.level) == ({"city": "Lagos"}, 3)
    assert (llm.calls[1].messages[-1].content or "").startswith(REFORMAT_PROMPT)
    assert llm.calls[1].messages[-2].content == garbage().content


async def test_level_2_transport_error_retries_the_same_request(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([LLMUnavailableError("503"), text('{"city": "Aveiro"}')], abilities=JSON_ONLY)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    assert result.level == 2
    assert llm.calls[1].messages == llm.calls[0].messages


async def test_regex_fallback_rescues_plain_text_without_json(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([text("City: Coimbra")], abilities=PLAIN)

    def city_regex(raw: str) -> dict[str, Any] | None:
        match = re.search(r"City: (\w+)", raw)
        return {"city": match.group(1)} if match else None

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA, regex_fallback=city_regex)

    assert (result.value, result.raw, result.level) == ({"city": "Coimbra"}, {"city": "Coimbra"}, 3)


async def test_regex_fallback_is_not_used_at_level_2(scripted_llm: MakeLLM) -> None:
    seen: list[str] = []

    def spy(raw: str) -> dict[str, Any] | None:
        seen.append(raw)
        return {"city": "from regex"}

    llm = scripted_llm([garbage(), garbage(), text("City: Beja")], abilities=JSON_ONLY)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA, regex_fallback=spy)

    assert result.level == 3
    assert seen == ["City: Beja"]


async def test_parse_fn_maps_the_raw_dict_to_a_domain_value(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([fc('{"city": "Lisbon", "days": 3}')], abilities=BOTH)

    result = await structured_llm_call(
        llm, QUESTION, schema=SCHEMA, parse_fn=lambda raw: (raw["city"].upper(), raw["days"])
    )

    assert result.value == ("LISBON", 3)
    assert result.raw == {"city": "Lisbon", "days": 3}


async def test_parse_fn_exception_counts_as_a_failed_attempt(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([fc('{"days": 3}'), text('{"days": 2}'), text('{"city": "Porto"}')], abilities=BOTH)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA, parse_fn=lambda raw: str(raw["city"]))

    assert (result.value, result.level) == ("Porto", 2)
    assert len(llm.calls) == 3
    assert (llm.calls[2].messages[-1].content or "").startswith(REFORMAT_PROMPT)


async def test_total_failure_returns_default_value_at_level_0(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([garbage(), garbage()], abilities=PLAIN)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA, default_value={"city": "nowhere"})

    assert (result.value, result.raw, result.level) == ({"city": "nowhere"}, {}, 0)
    assert result.usage.llm_calls == 2


async def test_none_is_a_valid_default_value(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([garbage(), garbage()], abilities=PLAIN)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA, parse_fn=str, default_value=None)

    assert result.value is None
    assert result.level == 0


async def test_total_failure_without_default_raises_saying_what_was_tried(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm(
        [fc("{bad"), garbage(), garbage(), garbage(), LLMUnavailableError("down")], abilities=BOTH
    )

    with pytest.raises(StructuredOutputError) as info:
        await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    message = str(info.value)
    for fragment in ("level 1 native", "level 2 json mode", "level 3 plain text", "LLMUnavailableError"):
        assert fragment in message
    assert len(info.value.failures) == 5


async def test_usage_accumulates_tokens_and_attempts_over_all_calls(scripted_llm: MakeLLM) -> None:
    first = fc("oops")
    first.attempts = 3
    llm = scripted_llm(
        [
            first,
            LLMUnavailableError("rate limited", attempts=4),
            text('{"city": "Lisbon"}', usage=TokenUsage(100, 20, 120)),
        ],
        abilities=BOTH,
    )
    run_usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2, llm_calls=1)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA, usage=run_usage)

    assert result.usage == Usage(prompt_tokens=110, completion_tokens=25, total_tokens=135, llm_calls=8)
    assert run_usage == Usage(prompt_tokens=111, completion_tokens=26, total_tokens=137, llm_calls=9)


async def test_usage_is_counted_when_everything_fails(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([garbage(), garbage()], abilities=PLAIN)
    run_usage = Usage()

    with pytest.raises(StructuredOutputError):
        await structured_llm_call(llm, QUESTION, schema=SCHEMA, usage=run_usage)

    assert run_usage == Usage(prompt_tokens=20, completion_tokens=10, total_tokens=30, llm_calls=2)


async def test_cancellation_is_not_swallowed_as_a_failed_attempt(scripted_llm: MakeLLM) -> None:
    def cancelled(messages: list[ChatMessage], kwargs: dict[str, Any]) -> ChatResult:
        raise asyncio.CancelledError

    llm = scripted_llm([cancelled], abilities=BOTH)

    with pytest.raises(asyncio.CancelledError):
        await structured_llm_call(llm, QUESTION, schema=SCHEMA, default_value={})

    assert len(llm.calls) == 1


async def test_double_encoded_tool_arguments_are_accepted(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([fc(json.dumps(json.dumps({"city": "Lisbon"})))], abilities=BOTH)

    result = await structured_llm_call(llm, QUESTION, schema=SCHEMA)

    assert result.value == {"city": "Lisbon"}
