"""What ``OpenAICompatibleLLM`` sends each provider, seen by the fake server: DeepSeek's reasoning
and Gemini's thought signatures sent back, Mistral's role order and 9-character ids, old Azure
versions that refuse ``stream_options``; and that the generic profile does none of it.

The first reply of each tool loop comes off the wire too, so what is sent back is what the
provider sent. Each shape names the public source it copies.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from app.llm.base import ChatMessage, ChatResult, LLMRequestRejectedError, TextDelta
from app.llm.openai_client import OpenAICompatibleLLM
from app.llm.providers import ASSISTANT_BRIDGE, PROFILES
from tests.integration.llm.provider_wire import ABILITIES, RecordingSleep
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.fake_replies import FakeReply

QUESTION = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="what is 2+2?")]
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
SIGNATURE = {"google": {"thought_signature": "CiQB0e2Kb7qNw1ExampleSignature=="}}


def tool_call_reply(**message: Any) -> FakeReply:
    """A 200 completion whose assistant message calls the calculator with id ``call_abc123def456``."""
    raw_call = {
        "id": "call_abc123def456",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression":"2+2"}'},
    }
    raw_call.update(message.pop("call_fields", {}))
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": [raw_call], **message},
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }
    return FakeReply.malformed(orjson.dumps(body))


def history_after(first: ChatResult, *, then_user: str | None = None) -> list[ChatMessage]:
    """The engine's history after ``first``: its call, the tool's result, maybe a user message."""
    history = [
        *QUESTION,
        ChatMessage(
            role="assistant",
            content=first.content,
            tool_calls=first.tool_calls,
            reasoning=first.kept_reasoning,  # what the engine keeps (loop_native)
        ),
        ChatMessage(role="tool", content="4", tool_call_id=first.tool_calls[0].id),
    ]
    if then_user is not None:
        history.append(ChatMessage(role="user", content=then_user))
    return history


async def tool_loop(
    server: FakeOpenAIServer, llm: OpenAICompatibleLLM, then_user: str | None = None
) -> list[dict[str, Any]]:
    """Run one call and its follow-up; the messages the follow-up sent."""
    first = await llm.chat(QUESTION, tools=TOOLS)
    await llm.chat(history_after(first, then_user=then_user), tools=TOOLS)
    return list(server.requests[1]["messages"])


# -- DeepSeek --------------------------------------------------------------------------------


async def test_deepseek_gets_the_reasoning_back_on_the_tool_calling_message(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # DeepSeek API docs, guides/thinking_mode "Tool Calls": reasoning_content must be passed back.
    server.script(
        tool_call_reply(reasoning_content="The user wants 2+2; use the calculator."), FakeReply.text("4")
    )

    sent = await tool_loop(server, make_llm(profile=PROFILES["deepseek"]))

    assert sent[2]["role"] == "assistant"
    assert sent[2]["reasoning_content"] == "The user wants 2+2; use the calculator."
    assert sent[2]["tool_calls"][0]["id"] == "call_abc123def456"


async def test_the_deepseek_profile_is_chosen_by_its_host() -> None:
    llm = OpenAICompatibleLLM("https://api.deepseek.com", "sk-test", "deepseek-reasoner", ABILITIES)
    await llm.aclose()

    assert llm.profile.reasoning_back is True


# -- Gemini ----------------------------------------------------------------------------------


async def test_gemini_gets_the_thought_signature_back_on_its_tool_call(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # Gemini docs "OpenAI compatibility" / "Thought signatures": extra_content on the tool call.
    server.script(tool_call_reply(call_fields={"extra_content": SIGNATURE}), FakeReply.text("4"))

    sent = await tool_loop(server, make_llm(profile=PROFILES["gemini"]))

    assert sent[2]["tool_calls"][0]["extra_content"] == SIGNATURE
    assert "reasoning_content" not in sent[2]


# -- Mistral ---------------------------------------------------------------------------------


async def test_mistral_gets_a_bridge_between_a_tool_result_and_a_user_message(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # Mistral API: "Unexpected role 'user' after role 'tool'" (code 3230).
    server.script(tool_call_reply(), FakeReply.text("4"))

    sent = await tool_loop(server, make_llm(profile=PROFILES["mistral"]), then_user="Reflect on the result.")

    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert sent[4] == {"role": "assistant", "content": ASSISTANT_BRIDGE}
    assert sent[5] == {"role": "user", "content": "Reflect on the result."}


async def test_mistral_gets_nine_character_ids_that_pair_the_call_with_its_result(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    # Mistral API: tool call ids must be 9 characters of [a-zA-Z0-9].
    server.script(tool_call_reply(), FakeReply.text("4"), FakeReply.text("again"))
    llm = make_llm(profile=PROFILES["mistral"])
    first = await llm.chat(QUESTION, tools=TOOLS)
    history = history_after(first)

    await llm.chat(history, tools=TOOLS)
    await llm.chat([*history, ChatMessage(role="assistant", content="4")], tools=TOOLS)

    ids = [
        (r["messages"][2]["tool_calls"][0]["id"], r["messages"][3]["tool_call_id"])
        for r in server.requests[1:]
    ]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", ids[0][0])
    assert ids == [(ids[0][0], ids[0][0])] * 2  # the same in both requests, call and result alike
    assert first.tool_calls[0].id == "call_abc123def456"  # the engine keeps the provider's own id


async def test_a_mistral_model_on_a_gateway_gets_mistrals_rules(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    server.script(tool_call_reply(), FakeReply.text("4"))

    sent = await tool_loop(server, make_llm(model="mistralai/mistral-large-2411"), then_user="go on")

    assert sent[4] == {"role": "assistant", "content": ASSISTANT_BRIDGE}
    assert re.fullmatch(r"[A-Za-z0-9]{9}", sent[3]["tool_call_id"])


# -- the generic profile ---------------------------------------------------------------------


async def test_the_generic_profile_sends_the_history_as_kept(server: FakeOpenAIServer, make_llm: Any) -> None:
    """No reasoning_content, no extra_content, no bridge, ids as they came."""
    server.script(
        tool_call_reply(reasoning_content="thinking", call_fields={"extra_content": SIGNATURE}),
        FakeReply.text("4"),
    )
    llm = make_llm()

    sent = await tool_loop(server, llm, then_user="Reflect on the result.")

    assert llm.profile.name not in ("deepseek", "gemini", "mistral")
    assert sent == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 2+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc123def456",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression":"2+2"}'},
                }
            ],
        },
        {"role": "tool", "content": "4", "tool_call_id": "call_abc123def456"},
        {"role": "user", "content": "Reflect on the result."},
    ]


# -- Azure's old API versions and stream_options ---------------------------------------------

AZURE_REFUSAL = {
    # Azure OpenAI before api-version 2024-09-01-preview (Azure OpenAI REST reference).
    "error": {
        "message": "Unrecognized request argument supplied: stream_options",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
}


async def test_a_refused_stream_options_is_asked_again_without_it_and_never_sent_again(
    server: FakeOpenAIServer, make_llm: Any, sleep: RecordingSleep
) -> None:
    server.script(
        FakeReply.error(400, AZURE_REFUSAL), FakeReply.stream(["Hel", "lo"]), FakeReply.stream(["again"])
    )
    llm = make_llm()

    first = [item async for item in llm.stream_chat(QUESTION)]
    second = [item async for item in llm.stream_chat(QUESTION)]

    assert [i.text for i in first if isinstance(i, TextDelta)] == ["Hel", "lo"]
    assert [i.text for i in second if isinstance(i, TextDelta)] == ["again"]
    sent = server.requests
    assert sent[0]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in sent[1] and "stream_options" not in sent[2]
    assert all(r["stream"] is True for r in sent)
    assert sleep.delays == []


async def test_another_400_on_a_stream_is_still_a_rejection(server: FakeOpenAIServer, make_llm: Any) -> None:
    refusal = {"error": {"message": "Invalid value for 'messages'", "type": "invalid_request_error"}}
    server.script(FakeReply.error(400, refusal))

    with pytest.raises(LLMRequestRejectedError, match="Invalid value for 'messages'"):
        [item async for item in make_llm().stream_chat(QUESTION)]

    assert len(server.requests) == 1


async def test_azure_gets_its_api_version_on_every_request_and_the_key_as_an_api_key_header(
    server: FakeOpenAIServer,
) -> None:
    # Azure OpenAI REST reference: a deployment URL takes ?api-version= and the key in "api-key".
    server.script(FakeReply.text("4"), FakeReply.stream(["4"]))
    base = f"{server.base_url}/openai/deployments/gpt4o?api-version=2024-06-01"
    llm = OpenAICompatibleLLM(base, "azure-key-123", "gpt4o", ABILITIES, timeout_s=5.0)
    try:
        assert llm.profile.name == "azure"
        await llm.chat(QUESTION)
        [item async for item in llm.stream_chat(QUESTION)]
    finally:
        await llm.aclose()

    for received in server.received:
        assert received.path == "/v1/openai/deployments/gpt4o/chat/completions"
        assert received.query == "api-version=2024-06-01"
        assert received.headers["api-key"] == "azure-key-123"


async def test_only_azure_gets_the_api_key_header(server: FakeOpenAIServer, make_llm: Any) -> None:
    server.script(FakeReply.text("4"))
    await make_llm().chat(QUESTION)
    assert "api-key" not in server.received[0].headers


async def test_the_reasoning_is_kept_for_sending_back_only_where_the_provider_wants_it(
    server: FakeOpenAIServer, make_llm: Any
) -> None:
    thinking = {"reasoning_content": "The user wants 2+2."}
    server.script(tool_call_reply(**thinking), tool_call_reply(**thinking))

    deepseek = await make_llm(profile=PROFILES["deepseek"]).chat(QUESTION, tools=TOOLS)
    generic = await make_llm().chat(QUESTION, tools=TOOLS)

    assert deepseek.kept_reasoning == deepseek.reasoning_content == "The user wants 2+2."
    assert generic.reasoning_content == "The user wants 2+2." and generic.kept_reasoning is None
