"""Fixtures shared by every test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.scripted import ScriptedLLM


@pytest.fixture
def scripted_llm() -> Iterator[Callable[..., ScriptedLLM]]:
    """``scripted_llm([replies], abilities=...)``: fails the test if not called exactly as scripted."""
    made: list[ScriptedLLM] = []

    def make(replies: Any, **kw: Any) -> ScriptedLLM:
        llm = ScriptedLLM(replies, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.assert_exhausted()
