"""Fixtures of the LLM client's wire tests: the fake server, a sleep that records instead of
waiting, and ``make_llm(model=..., api_key=..., **options)`` clients closed after the test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from app.llm.openai_client import OpenAICompatibleLLM
from tests.integration.llm.provider_wire import ABILITIES, API_KEY, RecordingSleep
from tests.support.fake_openai import FakeOpenAIServer


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as srv:
        yield srv
        srv.assert_done()


@pytest.fixture
def sleep() -> RecordingSleep:
    return RecordingSleep()


@pytest.fixture
async def make_llm(
    server: FakeOpenAIServer, sleep: RecordingSleep
) -> AsyncIterator[Callable[..., OpenAICompatibleLLM]]:
    made: list[OpenAICompatibleLLM] = []

    def make(model: str = "test-model", api_key: str = API_KEY, **options: Any) -> OpenAICompatibleLLM:
        llm = OpenAICompatibleLLM(
            server.base_url,
            api_key,
            model,
            ABILITIES,
            **{"timeout_s": 5.0, "max_retries": 3, "sleep": sleep, **options},
        )
        made.append(llm)
        return llm

    yield make
    for llm in made:
        await llm.aclose()
