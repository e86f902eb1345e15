"""The GenAI spans' attributes, read from an in-memory exporter (the OTLP path: the integration
tests). Contents only with the opt-in."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from app.llm.base import (
    LLM,
    ChatMessage,
    ChatResult,
    LLMRequestRejectedError,
    LLMUnavailableError,
    StreamItem,
    TokenUsage,
    ToolCall,
)
from app.llm.models import ModelRegistry, ModelSpec
from app.observability import Metrics
from app.runs.instrumented import InstrumentedLLM
from app.tools.registry import Tool, ToolInvocation, ToolRegistry
from app.tracing import Tracing
from app.tracing.genai import message_parts, provider_name, server_attributes
from tests.support.scripted import ScriptedLLM, StreamScript

MESSAGES = [
    ChatMessage("system", "Be brief."),
    ChatMessage("user", "What is 6*7?"),
    ChatMessage("assistant", None, tool_calls=(ToolCall("call_1", "calculator", '{"expression": "6*7"}'),)),
    ChatMessage("tool", "42", tool_call_id="call_1", name="calculator"),
]
SPEC = ModelSpec(name="cheap", model="gpt-x", base_url="https://api.openai.com/v1", api_key="sk-never-seen")
MODELS = ModelRegistry([SPEC], {})


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.shutdown()


def tracing(exporter: InMemorySpanExporter, *, capture: bool = False) -> Tracing:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, capture_content=capture)


def traced_llm(tracing: Tracing, inner: LLM) -> InstrumentedLLM:
    """The model as the service wraps it: metrics and, tracing, its chat spans."""
    return InstrumentedLLM(inner, Metrics(), "cheap", tracing.chat_spans(SPEC))


def only(exporter: InMemorySpanExporter) -> ReadableSpan:
    (span,) = exporter.get_finished_spans()
    return span


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_a_chat_span_has_the_conventions_attributes_and_no_content_by_default(
    exported: InMemorySpanExporter,
) -> None:
    reply = ChatResult(
        "Done.",
        usage=TokenUsage(120, 7, 127),
        finish_reason="stop",
        response_model="gpt-x-2025",
        response_id="r1",
    )
    llm = traced_llm(tracing(exported), ScriptedLLM([reply]))

    await llm.chat(MESSAGES, tools=[{"type": "function", "function": {"name": "calculator"}}])

    span = only(exported)
    assert span.name == "chat gpt-x"
    assert attrs(span) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-x",
        "gen_ai.response.model": "gpt-x-2025",
        "gen_ai.response.id": "r1",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 120,
        "gen_ai.usage.output_tokens": 7,
        "server.address": "api.openai.com",
        "server.port": 443,
    }
    assert "sk-never-seen" not in str(attrs(span))


async def test_with_the_opt_in_a_chat_span_carries_the_messages_in_the_conventions_form(
    exported: InMemorySpanExporter,
) -> None:
    reply = ChatResult(None, tool_calls=(ToolCall("call_2", "calculator", '{"expression": "2+2"}'),))
    llm = traced_llm(tracing(exported, capture=True), ScriptedLLM([reply]))

    await llm.chat(
        MESSAGES, tools=[{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    )

    got = attrs(only(exported))
    assert json.loads(got["gen_ai.system_instructions"]) == [{"type": "text", "content": "Be brief."}]
    assert json.loads(got["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": "What is 6*7?"}]},
        {
            "role": "assistant",
            "parts": [
                {
                    "type": "tool_call",
                    "id": "call_1",
                    "name": "calculator",
                    "arguments": {"expression": "6*7"},
                }
            ],
        },
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": "42"}]},
    ]
    assert json.loads(got["gen_ai.tool.definitions"]) == [
        {"type": "function", "name": "calculator", "parameters": {}}
    ]
    assert json.loads(got["gen_ai.output.messages"]) == [
        {
            "role": "assistant",
            "parts": [
                {
                    "type": "tool_call",
                    "id": "call_2",
                    "name": "calculator",
                    "arguments": {"expression": "2+2"},
                }
            ],
            "finish_reason": "stop",
        }
    ]


async def test_a_streamed_call_ends_its_span_with_the_streams_usage_and_text(
    exported: InMemorySpanExporter,
) -> None:
    llm = traced_llm(
        tracing(exported, capture=True), ScriptedLLM([StreamScript(["4", "2"], usage=TokenUsage(9, 2, 11))])
    )

    deltas = [item async for item in llm.stream_chat(MESSAGES)]

    assert len(deltas) == 3
    got = attrs(only(exported))
    assert (got["gen_ai.usage.input_tokens"], got["gen_ai.usage.output_tokens"]) == (9, 2)
    assert json.loads(got["gen_ai.output.messages"])[0]["parts"] == [{"type": "text", "content": "42"}]


class ClosingLLM(ScriptedLLM):
    """Says when its stream is closed."""

    closed = False

    async def stream_chat(self, messages: Sequence[ChatMessage]) -> AsyncIterator[StreamItem]:
        try:
            async for item in super().stream_chat(messages):
                yield item
        finally:
            self.closed = True


async def test_a_stream_abandoned_midway_closes_its_inner_stream_and_ends_its_span_without_an_error(
    exported: InMemorySpanExporter,
) -> None:
    inner = ClosingLLM([StreamScript(["a", "b", "c"])])
    stream = traced_llm(tracing(exported), inner).stream_chat(MESSAGES)
    async for _ in stream:
        break
    await stream.aclose()  # type: ignore[attr-defined]

    assert inner.closed, "the provider's stream was left open"
    span = only(exported)
    assert span.status.status_code == StatusCode.UNSET
    assert "gen_ai.usage.input_tokens" not in attrs(span)


@pytest.mark.parametrize(
    ("error", "named"),
    [
        (LLMRequestRejectedError("no such model", status=404), "404"),
        (LLMUnavailableError("HTTP 503 after 3 attempts"), "LLMUnavailableError"),
    ],
)
async def test_a_failed_call_has_an_error_status_and_type(
    exported: InMemorySpanExporter, error: Exception, named: str
) -> None:
    llm = traced_llm(tracing(exported), ScriptedLLM([error]))

    with pytest.raises(type(error)):
        await llm.chat(MESSAGES)

    span = only(exported)
    assert (span.status.status_code, attrs(span)["error.type"]) == (StatusCode.ERROR, named)


async def test_a_tool_span_names_the_call_and_an_error_result_is_an_error(
    exported: InMemorySpanExporter,
) -> None:
    async def broken(**_: Any) -> str:
        raise ValueError("no")

    async def add(a: int, b: int) -> str:
        return str(a + b)

    schema = {"type": "object", "properties": {}}
    base = ToolRegistry.of(
        [Tool("add", "Add two numbers.\nMore.", schema, add), Tool("broken", "Broken.", schema, broken)]
    )
    registry = tracing(exported, capture=True).tools(base).subset(["add", "broken"])  # a run's subset
    call = ToolInvocation("run_1:call_7", run_id="run_1", conversation_id="conv_1", call_id="call_7")

    ok = await registry.execute("add", {"a": 2, "b": 3}, invocation=call)
    failed = await registry.execute("broken", {}, invocation=call)
    missing = await registry.execute("nope", {}, invocation=call)

    assert (ok.content, failed.error_type, missing.error_type) == ("5", "ValueError", "not_found")
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert set(spans) == {"execute_tool add", "execute_tool broken", "execute_tool nope"}
    assert attrs(spans["execute_tool add"]) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "add",
        "gen_ai.tool.type": "function",
        "gen_ai.tool.call.id": "call_7",
        "gen_ai.conversation.id": "conv_1",
        "gen_ai.tool.description": "Add two numbers.",
        "gen_ai.tool.call.arguments": '{"a": 2, "b": 3}',
        "gen_ai.tool.call.result": "5",
    }
    assert spans["execute_tool add"].status.status_code == StatusCode.UNSET
    for name, kind in (("execute_tool broken", "ValueError"), ("execute_tool nope", "not_found")):
        assert (spans[name].status.status_code, attrs(spans[name])["error.type"]) == (StatusCode.ERROR, kind)
    # The plain registry is untouched: no spans from it.
    await base.execute("add", {"a": 1, "b": 1})
    assert len(exported.get_finished_spans()) == 3


def test_run_span_tokens_and_a_failed_run(exported: InMemorySpanExporter) -> None:
    span = tracing(exported).run_span(
        run_id="run_1", conversation_id="c", attempt=2, model="cheap", models=MODELS, traceparent=None
    )
    with span:
        span.event("agentstream.fallback", {"from_model": "cheap", "to_model": "strong"})
        span.outcome("failed", "the LLM refused the request", 30, 4)

    got = only(exported)
    assert (got.name, got.status.status_code, got.status.description) == (
        "invoke_agent agentstream",
        StatusCode.ERROR,
        "the LLM refused the request",
    )
    assert attrs(got)["agentstream.run.attempt"] == 2
    assert (attrs(got)["gen_ai.usage.input_tokens"], attrs(got)["error.type"]) == (30, "run_failed")
    assert [e.name for e in got.events] == ["agentstream.fallback"]


@pytest.mark.parametrize(
    ("profile", "name"),
    [
        ("openai", "openai"),
        ("azure", "azure.ai.openai"),
        ("gemini", "gcp.gemini"),
        ("mistral", "mistral_ai"),
        ("openai-compatible", "openai_compatible"),
        ("vllm", "vllm"),
        (None, "agentstream.demo"),
    ],
)
def test_provider_names_are_the_conventions_well_known_values(profile: str | None, name: str) -> None:
    assert provider_name(profile) == name


def test_server_attributes_never_carry_credentials_or_the_query() -> None:
    assert server_attributes("https://user:pw@host.example:8443/v1?api-key=k") == {
        "server.address": "host.example",
        "server.port": 8443,
    }
    assert server_attributes(None) == {}


def test_a_tool_message_with_content_is_one_response_part() -> None:
    assert message_parts(ChatMessage("tool", "x", tool_call_id="c")) == {
        "role": "tool",
        "parts": [{"type": "tool_call_response", "id": "c", "response": "x"}],
    }
