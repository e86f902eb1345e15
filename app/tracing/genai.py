"""The GenAI spans: ``chat`` around each LLM call, ``execute_tool`` around each tool call, and
``invoke_agent`` around each attempt of a run, with the semantic conventions' attributes.

Message contents (prompts, answers, tool arguments and results) are recorded only with
``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``; keys never: nothing here sees one.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
)

from app.llm.base import (
    ChatMessage,
    ChatResult,
    LLMRequestRejectedError,
    StreamEnd,
    ToolCall,
)
from app.observability import conversation_id_var
from app.tools.registry import Tool, ToolInvocation, ToolObserver, ToolResult

OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
REQUEST_STREAM = "gen_ai.request.stream"
TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CONVERSATION_ID = "gen_ai.conversation.id"
AGENT_NAME = "gen_ai.agent.name"
OUTPUT_TYPE = "gen_ai.output.type"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_TYPE = "gen_ai.tool.type"
TOOL_DESCRIPTION = "gen_ai.tool.description"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"
TOOL_DEFINITIONS = "gen_ai.tool.definitions"
TOOL_ARGUMENTS = "gen_ai.tool.call.arguments"
TOOL_RESULT = "gen_ai.tool.call.result"
ERROR_TYPE = "error.type"

AGENT = "agentstream"
"""``gen_ai.agent.name`` of every run."""

# The provider profiles' names (app.llm.providers) as the conventions' well-known providers; the
# others (self-hosted servers, gateways) are named by their profile, a custom value.
PROVIDER_NAMES = {
    "openai": "openai",
    "azure": "azure.ai.openai",
    "deepseek": "deepseek",
    "gemini": "gcp.gemini",
    "mistral": "mistral_ai",
    "groq": "groq",
    "openai-compatible": "openai_compatible",
}


def provider_name(profile: str | None) -> str:
    """``gen_ai.provider.name`` for a provider profile (None: the offline demo model)."""
    if profile is None:
        return "agentstream.demo"
    return PROVIDER_NAMES.get(profile, profile)


def server_attributes(base_url: str | None) -> dict[str, Any]:
    """``server.address`` and ``server.port`` of a base URL (never its user, password or query)."""
    if not base_url:
        return {}
    parts = urlsplit(base_url)
    if not parts.hostname:
        return {}
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return {"server.address": parts.hostname, "server.port": port}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return raw


def message_parts(message: ChatMessage) -> dict[str, Any]:
    """A message in the conventions' JSON form (``role`` and ``parts``)."""
    parts: list[dict[str, Any]] = []
    if message.role == "tool":
        parts.append({"type": "tool_call_response", "id": message.tool_call_id, "response": message.content})
    elif message.content:
        parts.append({"type": "text", "content": message.content})
    for call in message.tool_calls:
        parts.append(
            {"type": "tool_call", "id": call.id, "name": call.name, "arguments": _arguments(call.arguments)}
        )
    return {"role": message.role, "parts": parts}


def input_attributes(
    messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any]:
    system = [{"type": "text", "content": m.content} for m in messages if m.role == "system" and m.content]
    out: dict[str, Any] = {INPUT_MESSAGES: _json([message_parts(m) for m in messages if m.role != "system"])}
    if system:
        out[SYSTEM_INSTRUCTIONS] = _json(system)
    if tools:
        out[TOOL_DEFINITIONS] = _json([{"type": "function", **dict(t.get("function") or t)} for t in tools])
    return out


def output_attributes(
    content: str | None, calls: Sequence[ToolCall], finish_reason: str | None
) -> dict[str, Any]:
    message = message_parts(ChatMessage("assistant", content, tool_calls=tuple(calls)))
    message["finish_reason"] = finish_reason or "stop"
    return {OUTPUT_MESSAGES: _json([message])}


def error_type(exc: BaseException) -> str:
    """A low-cardinality name for a failed call: the provider's status for a refusal, else the
    exception's class."""
    if isinstance(exc, LLMRequestRejectedError):
        return str(exc.status)
    return type(exc).__name__


def failed(span: trace.Span, kind: str, message: str) -> None:
    """``span`` ended in an error of ``kind`` (``error.type``), ``message`` its status's description."""
    span.set_attribute(ERROR_TYPE, kind)
    span.set_status(Status(StatusCode.ERROR, message[:500]))


def fail(span: trace.Span, exc: BaseException) -> None:
    failed(span, error_type(exc), str(exc))


class ChatSpans:
    """The ``chat`` spans of one configured model: ``InstrumentedLLM`` (app.runs.instrumented)
    opens one around each call, a child of the run's span. In the wrapper that counts the call
    already, not a layer of its own: a streamed token passes one generator less."""

    def __init__(
        self,
        tracer: Tracer,
        *,
        request_model: str,
        provider: str,
        server: Mapping[str, Any],
        capture_content: bool,
    ) -> None:
        self._tracer = tracer
        self.capture = capture_content
        self._name = f"chat {request_model}"
        self._attributes = {OPERATION: "chat", PROVIDER: provider, REQUEST_MODEL: request_model, **server}

    def start(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        stream: bool = False,
        json_output: bool = False,
    ) -> trace.Span:
        attributes = dict(self._attributes)
        conversation_id = conversation_id_var.get()
        if conversation_id is not None:
            attributes[CONVERSATION_ID] = conversation_id
        if stream:
            attributes[REQUEST_STREAM] = True
        if json_output:
            attributes[OUTPUT_TYPE] = "json"
        if self.capture:
            attributes.update(input_attributes(messages, tools))
        return self._tracer.start_span(self._name, kind=SpanKind.CLIENT, attributes=attributes)

    def ended(
        self,
        span: trace.Span,
        reply: ChatResult | StreamEnd,
        content: str | None = None,
        calls: Sequence[ToolCall] = (),
    ) -> None:
        """The reply's usage, model, id and finish reason (and, captured, its ``content`` and
        tool ``calls``) on ``span``; ending it is the caller's."""
        attributes: dict[str, Any] = {
            INPUT_TOKENS: reply.usage.prompt_tokens,
            OUTPUT_TOKENS: reply.usage.completion_tokens,
        }
        if reply.finish_reason:
            attributes[FINISH_REASONS] = [reply.finish_reason]
        if reply.response_model:
            attributes[RESPONSE_MODEL] = reply.response_model
        if reply.response_id:
            attributes[RESPONSE_ID] = reply.response_id
        if self.capture:
            attributes.update(output_attributes(content, calls, reply.finish_reason))
        span.set_attributes(attributes)

    @staticmethod
    def first_chunk(span: trace.Span, seconds: float) -> None:
        """The stream's first token came ``seconds`` after it was asked for."""
        span.set_attribute(TIME_TO_FIRST_CHUNK, seconds)


def tool_observer(tracer: Tracer, capture_content: bool) -> ToolObserver:
    """A ``ToolObserver`` that runs each tool call in an ``execute_tool`` span (the current span
    while the tool works: an MCP server gets its context in ``_meta``)."""

    async def observe(
        tool: Tool | None,
        name: str,
        args: Mapping[str, Any],
        invocation: ToolInvocation | None,
        run: Callable[[], Awaitable[ToolResult]],
    ) -> ToolResult:
        attributes: dict[str, Any] = {OPERATION: "execute_tool", TOOL_NAME: name, TOOL_TYPE: "function"}
        if invocation is not None and invocation.call_id:
            attributes[TOOL_CALL_ID] = invocation.call_id
        if invocation is not None and invocation.conversation_id:
            attributes[CONVERSATION_ID] = invocation.conversation_id
        description = tool.description.strip() if tool is not None else ""
        if description:
            attributes[TOOL_DESCRIPTION] = description.splitlines()[0][:200]
        if capture_content:
            attributes[TOOL_ARGUMENTS] = _json(dict(args))
        span = tracer.start_span(f"execute_tool {name}", kind=SpanKind.INTERNAL, attributes=attributes)
        # Current while the tool works (attach/detach: use_span's context manager costs more).
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            result = await run()
            if result.error is not None:
                failed(span, result.error_type or "tool_error", result.error)
            elif capture_content:
                span.set_attribute(TOOL_RESULT, result.content)
        finally:
            otel_context.detach(token)
            span.end()
        return result

    return observe


def parent_context(traceparent: str | None) -> Context:
    """The context a ``traceparent`` stored with a run names; an empty one (a root span) for none
    or a broken one, never the context the attempt happens to be launched from."""
    parts = (traceparent or "").split("-")
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except (IndexError, ValueError):
        return Context()
    parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
    if not parent.is_valid:
        return Context()
    return trace.set_span_in_context(NonRecordingSpan(parent), Context())


class RunSpan:
    """The ``invoke_agent`` span of one attempt of a run, current while the attempt works."""

    def __init__(self, tracer: Tracer, attributes: Mapping[str, Any], traceparent: str | None) -> None:
        self._span = tracer.start_span(
            f"invoke_agent {AGENT}",
            context=parent_context(traceparent),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
        )
        self._scope: Any = None

    def __enter__(self) -> RunSpan:
        self._scope = trace.use_span(
            self._span, end_on_exit=True, record_exception=False, set_status_on_exception=False
        )
        self._scope.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._scope.__exit__(exc_type, exc, tb)

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        self._span.add_event(name, dict(attributes))

    def outcome(self, status: str, error: str | None, input_tokens: int, output_tokens: int) -> None:
        """How the attempt ended: the run's status, or ``handed_over``, ``waiting``, ``lost``."""
        span = self._span
        span.set_attribute("agentstream.run.outcome", status)
        span.set_attribute(INPUT_TOKENS, input_tokens)
        span.set_attribute(OUTPUT_TOKENS, output_tokens)
        if status == "failed":
            failed(span, "run_failed", error or "the run failed")


class NoRunSpan:
    """What an attempt gets when tracing is off: every method does nothing."""

    def __enter__(self) -> NoRunSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        return None

    def outcome(self, status: str, error: str | None, input_tokens: int, output_tokens: int) -> None:
        return None


NO_RUN_SPAN = NoRunSpan()
