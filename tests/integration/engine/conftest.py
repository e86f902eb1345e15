"""Fixtures of the engine integration tests: a started fake OpenAI server and clients pointed at it.

Each test drives ``ReActAgent`` through ``OpenAICompatibleLLM``, the real ``openai`` client and a
socket to ``FakeOpenAIServer``. The server's script is strict: teardown fails the test if a scripted
reply was never requested or a request came that nothing was scripted for.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pytest

from app.llm.openai_client import OpenAICompatibleLLM
from tests.integration.engine.wire import API_KEY, MODEL, NATIVE, MakeLLM, RecordingSleep
from tests.support.fake_openai import FakeOpenAIServer

LLM_TIMEOUT_S = 2.0
"""Short, so a hung call fails fast; the tests that hang on purpose shorten it further."""


@pytest.fixture
def fake_server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server
        server.assert_done()


@pytest.fixture
def retry_sleep() -> RecordingSleep:
    return RecordingSleep()


@pytest.fixture
async def make_llm(fake_server: FakeOpenAIServer, retry_sleep: RecordingSleep) -> AsyncIterator[MakeLLM]:
    """``make_llm(abilities=..., timeout_s=..., max_retries=...)``: a client of the fake server."""
    made: list[OpenAICompatibleLLM] = []

    def make(abilities: Mapping[str, bool] = NATIVE, **options: Any) -> OpenAICompatibleLLM:
        settings: dict[str, Any] = {"timeout_s": LLM_TIMEOUT_S, "max_retries": 2, "sleep": retry_sleep}
        settings.update(options)
        llm = OpenAICompatibleLLM(fake_server.base_url, API_KEY, MODEL, abilities, **settings)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        await llm.aclose()


@pytest.fixture
def llm(make_llm: MakeLLM) -> OpenAICompatibleLLM:
    """A client with native function calling, JSON mode and streaming."""
    return make_llm()
