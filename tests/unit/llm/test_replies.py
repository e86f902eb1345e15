"""Reading replies: ``parse_completion`` on every shape providers send, ``reported_error`` and its
retry decision, ``token_usage``, and ``ThinkTags`` fed the way a stream feeds it.

Each reply shape names, in a comment, the public source whose wire format it copies.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from app.llm.base import LLMResponseError, TokenUsage
from app.llm.providers import PROFILES, profile_for
from app.llm.replies import ProviderReportedError, ThinkTags, parse_completion, reported_error, token_usage

GENERIC = PROFILES["openai-compatible"]
OPENED = replace(GENERIC, opens_thinking=True)  # what a QwQ / DeepSeek-R1 model name gets
NO_TAGS = PROFILES["openai"]
GEMINI = PROFILES["gemini"]


def completion(*choices: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": list(choices), **top}


def choice(message: dict[str, Any], finish_reason: str | None = "stop", index: int = 0) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", **message}, "finish_reason": finish_reason}


def call(name: str = "calculator", arguments: Any = '{"expression":"2+2"}', **fields: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **fields}


# -- text and thinking -----------------------------------------------------------------------


def test_string_content_is_the_text_and_nothing_is_reasoning() -> None:
    # OpenAI API reference, "The chat completion object".
    result = parse_completion(completion(choice({"content": "Hello."})), GENERIC, 1)

    assert (result.content, result.reasoning_content, result.finish_reason) == ("Hello.", None, "stop")


@pytest.mark.parametrize(
    "field",
    [
        # DeepSeek API docs, guides/thinking_mode: message.reasoning_content beside content; also
        # vLLM "Reasoning Outputs" docs before 0.10.
        "reasoning_content",
        # OpenRouter docs "Reasoning Tokens": message.reasoning; Ollama "OpenAI compatibility"
        # (thinking models); vLLM "Reasoning Outputs" docs from 0.11.
        "reasoning",
    ],
)
def test_a_reasoning_field_is_the_reasoning_and_never_the_text(field: str) -> None:
    body = completion(choice({"content": "9.8 is greater.", field: "Compare 9.11 and 9.80."}))

    result = parse_completion(body, GENERIC, 1)

    assert result.content == "9.8 is greater."
    assert result.reasoning_content == "Compare 9.11 and 9.80."


def test_both_reasoning_fields_with_the_same_thinking_are_not_doubled() -> None:
    # vLLM "Reasoning Outputs" docs (0.11): `reasoning`, with `reasoning_content` kept as an alias.
    body = completion(choice({"content": "A", "reasoning": "think", "reasoning_content": "think"}))

    assert parse_completion(body, GENERIC, 1).reasoning_content == "think"


def test_openrouter_reasoning_details_beside_reasoning_are_ignored() -> None:
    # OpenRouter docs "Reasoning Tokens": reasoning_details, a list of typed blocks.
    details = [{"type": "reasoning.text", "text": "think", "signature": None}]
    body = completion(choice({"content": "A", "reasoning": "think", "reasoning_details": details}))

    result = parse_completion(body, GENERIC, 1)

    assert (result.content, result.reasoning_content) == ("A", "think")


def test_think_tags_at_the_start_of_the_content_are_the_reasoning() -> None:
    # vLLM served without --reasoning-parser, llama.cpp server README (--reasoning-format none),
    # Groq docs "Reasoning" (reasoning_format "raw"): the thinking is inline in content.
    body = completion(choice({"content": "\n<think>\nCompare digits.\n</think>\n\n9.8 is greater."}))

    result = parse_completion(body, GENERIC, 1)

    assert result.content == "9.8 is greater."
    assert result.reasoning_content == "Compare digits."


def test_a_draft_json_inside_the_thinking_is_never_the_content() -> None:
    # JSON mode against a raw-format reasoning model (Groq docs "Reasoning", format "raw").
    draft = '{"type": "final_answer", "answer": "draft"}'
    real = '{"type": "final_answer", "answer": "real"}'
    body = completion(choice({"content": f"<think>Maybe {draft}</think>{real}"}))

    result = parse_completion(body, GENERIC, 1)

    assert json.loads(result.content or "") == json.loads(real)
    assert draft in (result.reasoning_content or "")


@pytest.mark.parametrize("profile", [OPENED, GENERIC], ids=["opened", "generic"])
def test_text_before_a_lone_closing_tag_is_the_reasoning(profile: Any) -> None:
    # QwQ-32B and DeepSeek-R1 chat templates open <think> in the prompt, so the reply served
    # without a reasoning parser (vLLM, llama.cpp, Ollama raw) carries only the closing tag.
    body = completion(choice({"content": "Compare digits.\n</think>\n\n9.8 is greater."}))

    result = parse_completion(body, profile, 1)

    assert (result.content, result.reasoning_content) == ("9.8 is greater.", "Compare digits.")


def test_an_opened_profile_without_any_closing_tag_keeps_everything_as_the_answer() -> None:
    body = completion(choice({"content": "Just the answer."}))

    result = parse_completion(body, OPENED, 1)

    assert (result.content, result.reasoning_content) == ("Just the answer.", None)


def test_a_reply_cut_while_thinking_has_no_content() -> None:
    # finish_reason "length" inside the <think> block (vLLM without a parser, max_tokens hit).
    body = completion(choice({"content": "<think>Still comparing the dig"}, finish_reason="length"))

    result = parse_completion(body, GENERIC, 1)

    assert result.content is None
    assert result.reasoning_content == "Still comparing the dig"
    assert result.finish_reason == "length"


def test_a_reasoning_field_and_think_tags_are_both_kept() -> None:
    body = completion(choice({"content": "<think>second</think>answer", "reasoning_content": "first"}))

    result = parse_completion(body, GENERIC, 1)

    assert (result.content, result.reasoning_content) == ("answer", "first\n\nsecond")


def test_a_deepseek_r1_deployment_on_azure_has_its_think_tags_read() -> None:
    # Microsoft Learn, "How to use reasoning models with Azure AI model inference": DeepSeek-R1's
    # reasoning "is included in the response's content within the tags <think> and </think>",
    # served at https://<resource>.services.ai.azure.com/openai/deployments/deepseek-r1/...
    profile = profile_for(
        "https://my-res.services.ai.azure.com/openai/deployments/deepseek-r1", "DeepSeek-R1"
    )
    body = completion(choice({"content": "<think>\nCompare the tenths.\n</think>\n\n9.8 is greater."}))

    result = parse_completion(body, profile, 1)

    assert (result.content, result.reasoning_content) == ("9.8 is greater.", "Compare the tenths.")


def test_a_profile_without_think_tags_leaves_the_content_untouched() -> None:
    text = "<think>literally</think> is how the tag is written."

    result = parse_completion(completion(choice({"content": text})), NO_TAGS, 1)

    assert (result.content, result.reasoning_content) == (text, None)


def test_think_tags_in_the_middle_of_an_answer_are_the_answer() -> None:
    text = "Write <think>...</think> around thoughts."

    assert parse_completion(completion(choice({"content": text})), GENERIC, 1).content == text


def test_content_blocks_text_is_the_text_and_thinking_the_reasoning() -> None:
    # Mistral docs "Reasoning" (Magistral): content is a list of chunks, a "thinking" chunk whose
    # "thinking" is itself a list of text chunks, then "text" chunks.
    content = [
        {
            "type": "thinking",
            "thinking": [{"type": "text", "text": "Compare "}, {"type": "text", "text": "digits."}],
        },
        {"type": "text", "text": "9.8 is "},
        {"type": "text", "text": "greater."},
    ]

    result = parse_completion(completion(choice({"content": content})), GENERIC, 1)

    assert (result.content, result.reasoning_content) == ("9.8 is greater.", "Compare digits.")


def test_content_blocks_of_unknown_kinds_are_ignored() -> None:
    # Gateways that pass provider blocks through (images, citations): only text is the answer.
    content = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "ok"}]

    assert parse_completion(completion(choice({"content": content})), GENERIC, 1).content == "ok"


def test_content_that_is_neither_text_nor_blocks_is_unusable() -> None:
    with pytest.raises(LLMResponseError, match="not text"):
        parse_completion(completion(choice({"content": 42})), GENERIC, 3)


# -- tool calls ------------------------------------------------------------------------------


def test_tool_calls_in_a_lone_choice_with_index_1_are_read() -> None:
    # Gateways that number the choice carrying the calls 1 (issue 15, "Tool calls anywhere").
    body = completion(choice({"content": None, "tool_calls": [call(id="c1")]}, "tool_calls", index=1))

    result = parse_completion(body, GENERIC, 1)

    assert [(c.id, c.name) for c in result.tool_calls] == [("c1", "calculator")]
    assert result.finish_reason == "tool_calls"


def test_text_and_calls_split_across_two_choices_are_one_reply() -> None:
    # Gateways that put the text in choice 0 and the calls in choice 1 (issue 15).
    body = completion(
        choice({"content": "Let me compute."}, "stop", index=0),
        choice({"content": None, "tool_calls": [call(id="c1")]}, "tool_calls", index=1),
    )

    result = parse_completion(body, GENERIC, 1)

    assert result.content == "Let me compute."
    assert [c.id for c in result.tool_calls] == ["c1"]
    assert result.finish_reason == "tool_calls"


def test_choices_are_read_in_index_order() -> None:
    body = completion(choice({"content": "second"}, index=1), choice({"content": "first"}, index=0))

    assert parse_completion(body, GENERIC, 1).content == "first\n\nsecond"


def test_finish_reason_stop_beside_tool_calls_reads_as_tool_calls() -> None:
    # Ollama "OpenAI compatibility" and some vLLM tool parsers answer calls with "stop".
    body = completion(choice({"content": None, "tool_calls": [call(id="c1")]}, "stop"))

    assert parse_completion(body, GENERIC, 1).finish_reason == "tool_calls"


def test_finish_reason_length_beside_tool_calls_is_kept() -> None:
    body = completion(choice({"content": None, "tool_calls": [call(id="c1")]}, "length"))

    assert parse_completion(body, GENERIC, 1).finish_reason == "length"


def test_an_empty_tool_call_list_on_a_final_answer_is_no_calls() -> None:
    # vLLM and LM Studio send "tool_calls": [] on a plain answer when tools were offered.
    body = completion(choice({"content": "Done.", "tool_calls": []}, "stop"))

    result = parse_completion(body, GENERIC, 1)

    assert (result.tool_calls, result.finish_reason, result.content) == ((), "stop", "Done.")


def test_arguments_sent_as_an_object_become_their_json_text() -> None:
    # Ollama's native tool call shape (arguments an object), passed through by some gateways.
    body = completion(choice({"tool_calls": [call(arguments={"city": "Zürich", "days": 2}, id="c1")]}))

    arguments = parse_completion(body, GENERIC, 1).tool_calls[0].arguments

    assert json.loads(arguments) == {"city": "Zürich", "days": 2}
    assert "Zürich" in arguments


def test_arguments_sent_as_text_stay_the_raw_text_even_when_not_json() -> None:
    body = completion(choice({"tool_calls": [call(arguments="{not json", id="c1")]}))

    assert parse_completion(body, GENERIC, 1).tool_calls[0].arguments == "{not json"


def test_missing_arguments_are_empty_text() -> None:
    raw = {"id": "c1", "type": "function", "function": {"name": "now"}}

    assert (
        parse_completion(completion(choice({"tool_calls": [raw]})), GENERIC, 1).tool_calls[0].arguments == ""
    )


@pytest.mark.parametrize(
    "id_field", [{}, {"id": ""}, {"id": "  "}, {"id": None}], ids=["missing", "empty", "blank", "null"]
)
def test_a_call_without_an_id_is_left_for_the_engine_to_name(id_field: dict[str, Any]) -> None:
    # Gemini's OpenAI-compatible endpoint and older Ollama sent calls with empty or no ids; the
    # engine names them, unique within the run (tests/unit/engine/test_agent_resume.py).
    body = completion(choice({"tool_calls": [call(**id_field), call(id="kept")]}))

    assert [c.id for c in parse_completion(body, GENERIC, 1).tool_calls] == ["", "kept"]


def test_gemini_keeps_the_thought_signature_of_a_call() -> None:
    # Gemini docs "OpenAI compatibility" / "Thought signatures": extra_content.google.thought_signature.
    extra = {"google": {"thought_signature": "c2ln"}}
    body = completion(choice({"tool_calls": [call(id="c1", extra_content=extra)]}))

    assert parse_completion(body, GEMINI, 1).tool_calls[0].extra == {"extra_content": extra}
    assert parse_completion(body, GENERIC, 1).tool_calls[0].extra is None


def test_a_call_without_a_function_name_is_unusable() -> None:
    body = completion(choice({"tool_calls": [call(name="", id="c1")]}))

    with pytest.raises(LLMResponseError, match="no function name"):
        parse_completion(body, GENERIC, 1)


def test_tool_calls_that_are_not_a_list_are_unusable() -> None:
    with pytest.raises(LLMResponseError, match="not a list"):
        parse_completion(completion(choice({"tool_calls": {"id": "c1"}})), GENERIC, 1)


# -- usage -----------------------------------------------------------------------------------


def test_usage_is_read_from_usage() -> None:
    # OpenAI API reference, "The chat completion object".
    body = completion(
        choice({"content": "A"}), usage={"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    )

    assert parse_completion(body, GENERIC, 1).usage == TokenUsage(12, 3, 15)


def test_usage_is_read_from_x_groq_when_usage_is_absent() -> None:
    # Groq docs, API reference: x_groq.usage (where Groq's streams report it).
    x_groq = {"id": "req_1", "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}
    body = completion(choice({"content": "A"}), x_groq=x_groq)

    assert parse_completion(body, GENERIC, 1).usage == TokenUsage(7, 2, 9)


@pytest.mark.parametrize("top", [{}, {"usage": None}], ids=["absent", "null"])
def test_no_usage_reported_is_zero_usage(top: dict[str, Any]) -> None:
    # llama.cpp server README and LM Studio omit usage in some modes; some gateways send null.
    assert parse_completion(completion(choice({"content": "A"}), **top), GENERIC, 1).usage == TokenUsage()


def test_a_missing_total_is_the_sum_and_counts_that_are_not_counts_are_zero() -> None:
    reply = {"usage": {"prompt_tokens": 5, "completion_tokens": 4}}
    odd = {"usage": {"prompt_tokens": -1, "completion_tokens": "3", "total_tokens": None}}

    assert token_usage(reply) == TokenUsage(5, 4, 9)
    assert token_usage(odd) == TokenUsage(0, 0, 0)


def test_token_usage_is_none_when_nothing_was_reported() -> None:
    assert token_usage({"x_groq": {"id": "req_1"}}) is None
    assert token_usage({"usage": "n/a"}) is None


# -- unusable replies and errors in a 200 ----------------------------------------------------


def test_an_error_object_in_a_200_body_raises_the_providers_message() -> None:
    # OpenRouter docs "Errors": {"error": {"code", "message", "metadata"}} with HTTP 200 once the
    # model started processing.
    body = {"error": {"code": 429, "message": "Rate limit exceeded: free-models-per-min", "metadata": {}}}

    with pytest.raises(ProviderReportedError) as caught:
        parse_completion(body, GENERIC, 1)

    assert caught.value.message == "Rate limit exceeded: free-models-per-min"
    assert caught.value.retryable is True


def test_an_error_beside_usable_choices_does_not_hide_the_reply() -> None:
    body = completion(choice({"content": "A"}), error={"message": "partial"})

    assert parse_completion(body, GENERIC, 1).content == "A"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (["not", "an", "object"], "not a JSON object"),
        (completion(), "no choices"),
        ({"object": "chat.completion"}, "no choices"),
        (completion({"index": 0, "delta": {"content": "x"}}), "have no message"),
    ],
    ids=["list", "empty-choices", "missing-choices", "no-message"],
)
def test_a_reply_without_a_message_is_unusable_and_says_why(body: Any, reason: str) -> None:
    with pytest.raises(LLMResponseError, match=reason) as caught:
        parse_completion(body, GENERIC, 2)

    assert caught.value.attempts == 2


@pytest.mark.parametrize(
    "error",
    [
        {"code": 429, "message": "Rate limit"},  # OpenRouter docs "Errors"
        {"code": "429", "message": "Rate limit"},
        {"code": 408, "message": "timed out"},
        {"code": 500, "message": "boom", "type": "server_error"},  # llama.cpp server README
        {"code": 502, "message": "Provider returned error"},  # OpenRouter docs "Errors"
        {"code": 503, "message": "No available provider"},
        {"status": 503, "message": "unavailable"},
        {"code": "rate_limit_exceeded", "message": "Slow down", "type": "tokens"},  # Groq docs "Errors"
        {"type": "overloaded_error", "message": "Overloaded"},  # Anthropic models through OpenRouter
        {"code": "server_error", "message": "Provider disconnected"},  # OpenRouter mid-stream error
    ],
)
def test_rate_limits_overloads_and_server_errors_are_retryable(error: dict[str, Any]) -> None:
    reported = reported_error(error)

    assert reported.retryable is True
    assert reported.status is None
    assert reported.message == error["message"]


@pytest.mark.parametrize("code", [400, 401, 404, "400"])
def test_a_numeric_client_error_is_not_retryable_and_keeps_its_status(code: int | str) -> None:
    reported = reported_error({"code": code, "message": "This model's maximum context length is 8192"})

    assert (reported.retryable, reported.status) == (False, int(code))


def test_a_client_error_status_wins_over_retryable_words() -> None:
    reported = reported_error({"code": 400, "message": "rate limit tier does not allow this model"})

    assert (reported.retryable, reported.status) == (False, 400)


@pytest.mark.parametrize(
    "error",
    [{"code": "invalid_prompt", "message": "Invalid prompt"}, "something went wrong", {"message": "nope"}],
)
def test_an_unknown_error_is_not_retryable_and_has_no_status(error: object) -> None:
    reported = reported_error(error)

    assert (reported.retryable, reported.status) == (False, None)


def test_a_bare_string_error_is_the_message() -> None:
    assert reported_error("Model is loading").message == "Model is loading"


@pytest.mark.parametrize("error", [{"code": 500}, {"message": ""}, {"message": 7}, None])
def test_an_error_without_a_message_says_the_provider_reported_one(error: object) -> None:
    assert reported_error(error).message == "the provider reported an error"


@pytest.mark.parametrize("key", ["error", "detail"])
def test_the_message_may_be_under_error_or_detail(key: str) -> None:
    assert reported_error({key: "context too long"}).message == "context too long"


# -- ThinkTags -------------------------------------------------------------------------------

TAGGED = "\n<think>Is 9.11 < 9.8? Compare </thin digits; a<b.</think>\n\n9.8 is greater."
TAGGED_ANSWER = "9.8 is greater."
TAGGED_THINKING = "Is 9.11 < 9.8? Compare </thin digits; a<b."
OPENED_TEXT = "Compare the digits <t> first.</think>\n9.8 is greater."


def run_tags(pieces: list[str], *, opened: bool = False) -> tuple[list[str], ThinkTags]:
    tags = ThinkTags(opened=opened)
    out = [tags.feed(piece) for piece in pieces]
    out.append(tags.finish())
    return out, tags


def splits(text: str) -> list[list[str]]:
    """``text`` cut in three at every pair of positions: each tag is split at each of its places."""
    return [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1) for j in range(i, len(text) + 1)]


def test_fed_character_by_character_no_character_of_the_thinking_is_returned() -> None:
    out, _ = run_tags(list(TAGGED))

    assert "".join(out) == TAGGED_ANSWER


def test_tags_split_at_every_position_never_leak_the_thinking() -> None:
    for pieces in splits(TAGGED):
        out, _ = run_tags(pieces)

        assert "".join(out) == TAGGED_ANSWER, pieces


def test_nothing_is_returned_before_the_closing_tag_has_arrived() -> None:
    tags = ThinkTags()
    close_at = TAGGED.index("</think>") + len("</think>")

    assert [tags.feed(c) for c in TAGGED[:close_at]] == [""] * close_at


def test_opened_mode_splits_at_every_position_never_leak_the_thinking() -> None:
    for pieces in splits(OPENED_TEXT):
        out, _ = run_tags(pieces, opened=True)

        assert "".join(out) == "9.8 is greater.", pieces


def test_opened_mode_holds_everything_until_the_closing_tag() -> None:
    tags = ThinkTags(opened=True)

    assert tags.feed("Compare ") == ""
    assert tags.feed("the digits.") == ""
    assert tags.feed("</think>9.8") == "9.8"
    assert tags.feed(" is greater.") == " is greater."


def test_opened_mode_hands_everything_over_at_finish_when_no_tag_came() -> None:
    text = "A plain answer, no thinking at all."
    out, _ = run_tags(list(text), opened=True)

    assert out[:-1] == [""] * len(text)
    assert out[-1] == text


def test_an_unclosed_think_block_is_never_handed_over() -> None:
    out, _ = run_tags(["<think>cut off while thin", "king"])

    assert "".join(out) == ""


def test_an_opened_reply_cut_at_the_output_limit_hands_nothing_over() -> None:
    tags = ThinkTags(opened=True)
    fed = [tags.feed(piece) for piece in ["Still comparing ", "the digits and"]]

    assert fed == ["", ""]
    assert tags.finish(ended=False) == ""


def test_a_server_that_sends_the_thinking_apart_releases_what_was_held_as_answer() -> None:
    tags = ThinkTags(opened=True)
    assert tags.feed("The answer") == ""

    assert tags.separated() == "The answer"
    assert tags.feed(" is 4.") == " is 4."


def test_a_reply_that_tagged_its_thinking_is_not_released_by_a_reasoning_field() -> None:
    tags = ThinkTags(opened=True)
    assert tags.feed("<think>secret") == ""

    assert tags.separated() == ""
    assert tags.feed(" plan</think>Answer") == "Answer"


def test_text_without_tags_passes_through_at_once() -> None:
    tags = ThinkTags()

    assert tags.feed("Hello") == "Hello"
    assert tags.feed(" world") == " world"


def test_a_start_that_only_looks_like_a_tag_is_handed_over_once_it_is_not_one() -> None:
    tags = ThinkTags()

    assert tags.feed("<th") == ""
    assert tags.feed("ead>") == "<thead>"


def test_a_tag_later_in_the_answer_is_part_of_the_answer() -> None:
    out, _ = run_tags(["<think>t</think>", "Use ", "<think>", " tags."])

    assert "".join(out) == "Use <think> tags."


def test_a_stream_that_ends_on_a_partial_tag_at_the_start_hands_it_over() -> None:
    out, _ = run_tags(["<thi"])

    assert "".join(out) == "<thi"


# -- review fixes ----------------------------------------------------------------------------


def test_an_opened_reply_cut_at_the_output_limit_is_all_thinking() -> None:
    # A QwQ / R1 distill cut while thinking: its draft action must not become the answer.
    draft = 'Maybe {"type": "tool_call", "tool_name": "rm", "tool_args": {}} but first'
    result = parse_completion(completion(choice({"content": draft}, finish_reason="length")), OPENED, 1)

    assert result.content is None
    assert result.reasoning_content == draft


def test_an_opened_reply_that_ended_without_a_tag_is_all_answer() -> None:
    result = parse_completion(completion(choice({"content": "Just 4."})), OPENED, 1)

    assert (result.content, result.reasoning_content) == ("Just 4.", None)


def test_a_server_that_separates_the_thinking_sends_the_answer_as_the_text() -> None:
    # OpenRouter serving deepseek/deepseek-r1: "reasoning" apart, the content is the answer.
    body = completion(choice({"content": "Just 4.", "reasoning": "2+2 is 4."}, finish_reason="length"))
    result = parse_completion(body, OPENED, 1)

    assert (result.content, result.reasoning_content) == ("Just 4.", "2+2 is 4.")


@pytest.mark.parametrize("code", [3230, "3230", 1261, "\u00b2"])
def test_a_code_that_is_no_http_status_is_not_taken_for_one(code: object) -> None:
    error = reported_error({"message": "Unexpected role 'user' after role 'tool'", "code": code})

    assert error.status is None and error.retryable is False


def test_only_the_provider_that_sends_the_reasoning_back_keeps_it() -> None:
    body = completion(choice({"content": "4", "reasoning_content": "2+2"}))

    assert parse_completion(body, PROFILES["deepseek"], 1).kept_reasoning == "2+2"
    assert parse_completion(body, GENERIC, 1).kept_reasoning is None


def test_the_replys_model_and_id_are_kept_for_traces_and_absent_ones_are_none() -> None:
    named = parse_completion(completion(choice({"content": "4"}), model="gpt-x-2025-01"), GENERIC, 1)
    bare = parse_completion({"choices": [choice({"content": "4"})]}, GENERIC, 1)

    assert (named.response_model, named.response_id) == ("gpt-x-2025-01", "chatcmpl-1")
    assert (bare.response_model, bare.response_id) == (None, None)
