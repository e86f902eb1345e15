"""Providers' real reply shapes through ``OpenAICompatibleLLM``: the real openai client over a
socket against the fake server, which serves each shape byte for byte. Thinking wherever providers
put it, tool calls in any choice, usage wherever it is reported.

Each shape names, in a comment, the public source whose wire format it copies. Errors and streams
that end badly are in ``test_provider_errors.py``; what the client sends each provider is in
``test_provider_requests.py``.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from app.llm.base import (
    TokenUsage,
)
from app.llm.providers import profile_for
from tests.integration.llm.provider_wire import (
    QUESTION,
    call,
    choice,
    chunk,
    collect,
    end,
    reply,
    sse,
    texts,
    usage,
)
from tests.support.fake_openai import FakeOpenAIServer

# -- thinking --------------------------------------------------------------------------------


async def test_think_tags_in_a_reply_are_reasoning_and_never_content(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # vLLM without --reasoning-parser; Groq docs "Reasoning", reasoning_format "raw".
    server.script(reply(choice({"content": "<think>\n9.11 has fewer tenths.\n</think>\n\n9.8 is greater."})))

    result = await make_llm().chat(QUESTION)

    assert result.content == "9.8 is greater."
    assert result.reasoning_content == "9.11 has fewer tenths."


async def test_think_tags_split_across_stream_chunks_are_never_streamed(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # Same servers, streamed: the tags arrive cut at token boundaries.
    server.script(
        sse(
            chunk({"role": "assistant", "content": ""}),
            chunk({"content": "<th"}),
            chunk({"content": "ink>9.11 has fewer"}),
            chunk({"content": " tenths.</"}),
            chunk({"content": "think>\n\n9.8"}),
            chunk({"content": " is greater."}),
            chunk({}, finish="stop"),
        )
    )

    items = await collect(make_llm().stream_chat(QUESTION))

    assert texts(items) == ["9.8", " is greater."]


async def test_an_r1_distills_closing_only_tag_keeps_the_thinking_out_of_a_reply(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # DeepSeek-R1 distills' chat template opens <think> in the prompt (vLLM, llama.cpp, Ollama).
    server.script(reply(choice({"content": "9.11 has fewer tenths.\n</think>\n\n9.8 is greater."})))

    result = await make_llm(model="deepseek-r1-distill-qwen-7b").chat(QUESTION)

    assert (result.content, result.reasoning_content) == ("9.8 is greater.", "9.11 has fewer tenths.")


async def test_an_r1_distills_closing_only_tag_keeps_the_thinking_out_of_a_stream(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(
        sse(
            chunk({"role": "assistant", "content": ""}),
            chunk({"content": "9.11 has"}),
            chunk({"content": " fewer tenths.</th"}),
            chunk({"content": "ink>"}),
            chunk({"content": "\n\n9.8 is greater."}),
            chunk({}, finish="stop"),
        )
    )

    items = await collect(make_llm(model="deepseek-r1-distill-qwen-7b").stream_chat(QUESTION))

    assert "".join(texts(items)) == "9.8 is greater."


async def test_an_r1_distill_that_never_closes_the_tag_streams_its_answer_at_the_end(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(
        sse(chunk({"content": "9.8 is"}), chunk({"content": " greater."}), chunk({}, finish="stop"))
    )

    items = await collect(make_llm(model="deepseek-r1-distill-qwen-7b").stream_chat(QUESTION))

    assert "".join(texts(items)) == "9.8 is greater."


async def test_a_deepseek_r1_deployment_on_azure_never_streams_its_thinking(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # Microsoft Learn, "How to use reasoning models with Azure AI model inference": DeepSeek-R1 on
    # <resource>.services.ai.azure.com puts its reasoning in content between <think> and </think>.
    azure = profile_for("https://my-res.services.ai.azure.com/openai/deployments/deepseek-r1", "DeepSeek-R1")
    server.script(
        sse(
            chunk({"role": "assistant", "content": ""}),
            chunk({"content": "<think>"}),
            chunk({"content": "\nCompare the tenths.\n"}),
            chunk({"content": "</think>\n\n9.8 is greater."}),
            chunk({}, finish="stop"),
        )
    )

    items = await collect(make_llm(model="DeepSeek-R1", profile=azure).stream_chat(QUESTION))

    assert "".join(texts(items)) == "9.8 is greater."


@pytest.mark.parametrize(
    "field",
    [
        "reasoning_content",  # DeepSeek API docs, guides/thinking_mode; vLLM < 0.11 "Reasoning Outputs"
        "reasoning",  # OpenRouter docs "Reasoning Tokens"; Ollama OpenAI compatibility; vLLM >= 0.11
    ],
)
async def test_a_reasoning_field_in_a_reply_is_the_reasoning(
    field: str, server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(reply(choice({"content": "9.8 is greater.", field: "Compare tenths."})))

    result = await make_llm().chat(QUESTION)

    assert (result.content, result.reasoning_content) == ("9.8 is greater.", "Compare tenths.")


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_reasoning_deltas_with_null_content_are_never_streamed(
    field: str, server: FakeOpenAIServer, make_llm: Any
) -> None:
    # DeepSeek API docs, thinking_mode streaming; OpenRouter "Reasoning Tokens"; vLLM streaming example.
    server.script(
        sse(
            chunk({"role": "assistant", "content": None, field: ""}),
            chunk({"content": None, field: "Compare"}),
            chunk({"content": None, field: " tenths."}),
            chunk({"content": "9.8", field: None}),
            chunk({"content": " is greater."}),
            chunk({}, finish="stop"),
        )
    )

    items = await collect(make_llm().stream_chat(QUESTION))

    assert texts(items) == ["9.8", " is greater."]


async def test_content_blocks_in_a_reply_give_text_and_reasoning(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # Mistral docs "Reasoning" (Magistral): a thinking chunk, then text chunks.
    content = [
        {"type": "thinking", "thinking": [{"type": "text", "text": "Compare tenths."}]},
        {"type": "text", "text": "9.8 is greater."},
    ]
    server.script(reply(choice({"content": content})))

    result = await make_llm().chat(QUESTION)

    assert (result.content, result.reasoning_content) == ("9.8 is greater.", "Compare tenths.")


async def test_content_blocks_in_a_stream_give_only_their_text(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    thinking = [{"type": "thinking", "thinking": [{"type": "text", "text": "Compare tenths."}]}]
    server.script(
        sse(
            chunk({"role": "assistant", "content": thinking}),
            chunk({"content": [{"type": "text", "text": "9.8 is"}]}),
            chunk({"content": [{"type": "text", "text": " greater."}]}),
            chunk({}, finish="stop"),
        )
    )

    items = await collect(make_llm().stream_chat(QUESTION))

    assert texts(items) == ["9.8 is", " greater."]


# -- tool calls ------------------------------------------------------------------------------


async def test_tool_calls_in_a_lone_choice_with_index_1_are_read(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # Gateways that number the choice carrying the calls 1 (issue 15, "Tool calls anywhere").
    server.script(reply(choice({"content": None, "tool_calls": [call("c1")]}, "tool_calls", index=1)))

    result = await make_llm().chat(QUESTION)

    assert [(c.id, c.name, c.arguments) for c in result.tool_calls] == [
        ("c1", "calculator", '{"expression":"2+2"}')
    ]


async def test_text_and_calls_split_across_choices_are_one_reply(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # Gateways that put the text and the calls in two choices (issue 15).
    server.script(
        reply(
            choice({"content": "Let me compute."}, "stop", index=0),
            choice({"content": None, "tool_calls": [call("c1")]}, "tool_calls", index=1),
        )
    )

    result = await make_llm().chat(QUESTION)

    assert result.content == "Let me compute."
    assert [c.id for c in result.tool_calls] == ["c1"]
    assert result.finish_reason == "tool_calls"


async def test_stop_beside_tool_calls_reads_as_tool_calls(server: FakeOpenAIServer, make_llm: Any) -> None:
    # Ollama "OpenAI compatibility": finish_reason "stop" with tool_calls.
    server.script(reply(choice({"content": "", "tool_calls": [call("c1")]}, "stop")))

    result = await make_llm().chat(QUESTION)

    assert (len(result.tool_calls), result.finish_reason) == (1, "tool_calls")


async def test_empty_and_missing_call_ids_reach_the_engine_empty_for_it_to_name(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # Gemini's OpenAI-compatible endpoint and older Ollama sent empty or no call ids. The engine
    # names such calls, unique within the run (tests/unit/engine/test_agent_resume.py, and the
    # service runs of tests/integration/service/test_providers_service.py).
    server.script(reply(choice({"tool_calls": [call(""), call(None), call("c9")]}, "tool_calls")))

    calls = (await make_llm().chat(QUESTION)).tool_calls

    assert [c.id for c in calls] == ["", "", "c9"]


async def test_arguments_as_an_object_arrive_as_their_json_text(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # Ollama's native tool call shape (arguments an object), passed through by some gateways.
    server.script(reply(choice({"tool_calls": [call("c1", arguments={"expression": "6*7"})]}, "tool_calls")))

    result = await make_llm().chat(QUESTION)

    assert orjson.loads(result.tool_calls[0].arguments) == {"expression": "6*7"}


# -- usage -----------------------------------------------------------------------------------

USAGE_SHAPES = {
    # llama.cpp server README: no usage in the stream at all.
    "absent": ([chunk({"content": "a"}), chunk({}, finish="stop")], TokenUsage()),
    # OpenAI API reference, include_usage, from a server that never fills it in.
    "null": ([chunk({"content": "a"}, usage=None), chunk({}, finish="stop", usage=None)], TokenUsage()),
    # vLLM docs, continuous_usage_stats: cumulative on every chunk, then again on a usage chunk.
    "cumulative": (
        [
            chunk({"content": "a"}, usage=usage(10, 1)),
            chunk({"content": "b"}, usage=usage(10, 2)),
            chunk({}, finish="stop", usage=usage(10, 2)),
            chunk(None, usage=usage(10, 2)),
        ],
        TokenUsage(10, 2, 12),
    ),
    # Gemini's OpenAI-compatible endpoint, Together: usage on the finish chunk.
    "finish-chunk": (
        [chunk({"content": "a"}), chunk({}, finish="stop", usage=usage(8, 1))],
        TokenUsage(8, 1, 9),
    ),
    # Groq docs: usage only in the last chunk's x_groq.
    "x_groq": (
        [
            chunk({"content": "a"}, x_groq={"id": "req_1"}),
            chunk({}, finish="stop", x_groq={"id": "req_1", "usage": {"queue_time": 0.02, **usage(6, 1)}}),
        ],
        TokenUsage(6, 1, 7),
    ),
}


@pytest.mark.parametrize("shape", list(USAGE_SHAPES))
async def test_stream_usage_is_what_the_provider_reported_counted_once(
    shape: str, server: FakeOpenAIServer, make_llm: Any
) -> None:
    chunks, expected = USAGE_SHAPES[shape]
    server.script(sse(*chunks))

    items = await collect(make_llm().stream_chat(QUESTION))

    assert texts(items) == ["a"] + (["b"] if shape == "cumulative" else [])
    assert end(items).usage == expected


async def test_a_model_whose_reply_closes_an_unopened_tag_has_its_later_streams_held_back(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # DeepSeek-V3.1 with thinking on / MiniMax-M2 on vLLM without a reasoning parser: the template
    # opens <think>, so only "</think>" is in the text, and the name says nothing about it.
    server.script(
        reply(choice({"content": "Check the digits.</think>\n\n9.8"})),
        sse(
            chunk({"content": "The trace says 9.8 wins"}),
            chunk({"content": " here.</thi"}),
            chunk({"content": "nk>\n\n9.8 is greater."}, finish="stop"),
        ),
    )
    llm = make_llm(model="house-model-v2")

    first = await llm.chat(QUESTION)
    streamed = await collect(llm.stream_chat(QUESTION))

    assert (first.content, first.reasoning_content) == ("9.8", "Check the digits.")
    assert "".join(texts(streamed)) == "9.8 is greater."
