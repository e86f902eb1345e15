"""An LLM wrapper that records call counts, latency and tokens in the service's metrics, by model,
and, when the service traces, a ``chat`` span around each call (``app.tracing.genai.ChatSpans``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from app.llm.base import LLM, ChatMessage, ChatResult, StreamEnd, StreamItem, TokenUsage
from app.observability import Metrics
from app.tracing.genai import ChatSpans, fail


class InstrumentedLLM:
    def __init__(
        self, inner: LLM, metrics: Metrics, model: str = "default", spans: ChatSpans | None = None
    ) -> None:
        self._inner = inner
        self._metrics = metrics
        self._model = model
        self._spans = spans
        # Children resolved once: a labelled child costs a dict lookup and a lock per call.
        self._prompt_tokens = metrics.llm_tokens.labels(model, "prompt")
        self._completion_tokens = metrics.llm_tokens.labels(model, "completion")

    @property
    def abilities(self) -> Mapping[str, bool]:
        return self._inner.abilities

    @property
    def model_name(self) -> str:
        return self._inner.model_name

    @property
    def inner(self) -> LLM:
        return self._inner

    def _count(self, usage: TokenUsage) -> None:
        if usage.prompt_tokens:
            self._prompt_tokens.inc(usage.prompt_tokens)
        if usage.completion_tokens:
            self._completion_tokens.inc(usage.completion_tokens)

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        response_format: Mapping[str, Any] | None = None,
    ) -> ChatResult:
        started = time.perf_counter()
        outcome = "error"
        spans = self._spans
        span = spans.start(messages, tools, json_output=response_format is not None) if spans else None
        try:
            result = await self._inner.chat(
                messages, tools=tools, tool_choice=tool_choice, response_format=response_format
            )
            outcome = "ok"
            self._count(result.usage)
            if span is not None and spans is not None:
                spans.ended(span, result, result.content, result.tool_calls)
            return result
        except Exception as exc:
            if span is not None:
                fail(span, exc)
            raise
        finally:
            self._metrics.llm_calls.labels("chat", outcome, self._model).inc()
            self._metrics.llm_latency.labels("chat", self._model).observe(time.perf_counter() - started)
            if span is not None:
                span.end()

    async def stream_chat(self, messages: Sequence[ChatMessage]) -> AsyncIterator[StreamItem]:
        started = time.perf_counter()
        outcome = "error"
        spans = self._spans
        span = spans.start(messages, stream=True) if spans else None
        first = span is not None  # the first token's time is only for the span
        text: list[str] | None = [] if spans is not None and spans.capture else None
        stream = self._inner.stream_chat(messages)
        try:
            async for item in stream:
                if isinstance(item, StreamEnd):
                    self._count(item.usage)
                    if span is not None and spans is not None:
                        spans.ended(span, item, "".join(text) if text is not None else None)
                else:
                    if first and span is not None:
                        first = False
                        ChatSpans.first_chunk(span, time.perf_counter() - started)
                    if text is not None:
                        text.append(item.text)
                yield item
            outcome = "ok"
        except Exception as exc:
            if span is not None:
                fail(span, exc)
            raise
        finally:
            # Closed with this generator: a stream abandoned midway frees its connection now.
            close = getattr(stream, "aclose", None)
            try:
                if close is not None:
                    await close()
            finally:
                self._metrics.llm_calls.labels("stream", outcome, self._model).inc()
                self._metrics.llm_latency.labels("stream", self._model).observe(time.perf_counter() - started)
                if span is not None:
                    span.end()

    async def aclose(self) -> None:
        close = getattr(self._inner, "aclose", None)
        if close is not None:
            await close()
