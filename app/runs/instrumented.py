"""An LLM wrapper that records call counts and latency in the service's metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from app.llm.base import LLM, ChatMessage, ChatResult, StreamItem
from app.observability import Metrics


class InstrumentedLLM:
    def __init__(self, inner: LLM, metrics: Metrics) -> None:
        self._inner = inner
        self._metrics = metrics

    @property
    def abilities(self) -> Mapping[str, bool]:
        return self._inner.abilities

    @property
    def model_name(self) -> str:
        return self._inner.model_name

    @property
    def inner(self) -> LLM:
        return self._inner

    async def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResult:
        started = time.perf_counter()
        outcome = "error"
        try:
            result = await self._inner.chat(messages, **kwargs)
            outcome = "ok"
            return result
        finally:
            self._metrics.llm_calls.labels("chat", outcome).inc()
            self._metrics.llm_latency.labels("chat").observe(time.perf_counter() - started)

    async def stream_chat(self, messages: Sequence[ChatMessage]) -> AsyncIterator[StreamItem]:
        started = time.perf_counter()
        outcome = "error"
        try:
            async for item in self._inner.stream_chat(messages):
                yield item
            outcome = "ok"
        finally:
            self._metrics.llm_calls.labels("stream", outcome).inc()
            self._metrics.llm_latency.labels("stream").observe(time.perf_counter() - started)

    async def aclose(self) -> None:
        close = getattr(self._inner, "aclose", None)
        if close is not None:
            await close()
