"""An LLM wrapper that records call counts, latency and tokens in the service's metrics, by model."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from app.llm.base import LLM, ChatMessage, ChatResult, StreamEnd, StreamItem, TokenUsage
from app.observability import Metrics


class InstrumentedLLM:
    def __init__(self, inner: LLM, metrics: Metrics, model: str = "default") -> None:
        self._inner = inner
        self._metrics = metrics
        self._model = model
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

    async def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResult:
        started = time.perf_counter()
        outcome = "error"
        try:
            result = await self._inner.chat(messages, **kwargs)
            outcome = "ok"
            self._count(result.usage)
            return result
        finally:
            self._metrics.llm_calls.labels("chat", outcome, self._model).inc()
            self._metrics.llm_latency.labels("chat", self._model).observe(time.perf_counter() - started)

    async def stream_chat(self, messages: Sequence[ChatMessage]) -> AsyncIterator[StreamItem]:
        started = time.perf_counter()
        outcome = "error"
        try:
            async for item in self._inner.stream_chat(messages):
                if isinstance(item, StreamEnd):
                    self._count(item.usage)
                yield item
            outcome = "ok"
        finally:
            self._metrics.llm_calls.labels("stream", outcome, self._model).inc()
            self._metrics.llm_latency.labels("stream", self._model).observe(time.perf_counter() - started)

    async def aclose(self) -> None:
        close = getattr(self._inner, "aclose", None)
        if close is not None:
            await close()
