"""Fixtures shared by every test, and how pytest-xdist shares the tests out."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.scheduling import ScopeScheduling
from tests.support.scripted import ScriptedLLM

# FACES.md N-06: no webhook delivery of a test ever leaves this machine. Every service a test starts
# (in this process, or a worker subprocess, which inherits the environment) posts to loopback hosts
# only, unless the test sets WEBHOOK_ALLOWED_HOSTS itself.
os.environ.setdefault("WEBHOOK_ALLOWED_HOSTS", "127.0.0.1,localhost,::1")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> ScopeScheduling | None:
    """``--dist loadscope`` by module, the browser tests as one scope (tests/support/scheduling.py)."""
    return ScopeScheduling(config, log) if config.getoption("dist") == "loadscope" else None


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
