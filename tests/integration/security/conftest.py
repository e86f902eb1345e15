"""Fixtures of the security tests: those of the service API tests (a real service under uvicorn in
a thread, the fake OpenAI server, callers with keys), imported so that pytest finds them here."""

from __future__ import annotations

from tests.integration.service.conftest import (  # noqa: F401  (fixtures)
    alice,
    app_logs,
    bob,
    fake_llm,
    service,
    shared_service,
)
