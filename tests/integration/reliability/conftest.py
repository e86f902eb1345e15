"""Fixtures of the fault tests: a service whose log is checked, a model that misbehaves on cue.

- ``service_log``: every record the app, uvicorn and asyncio log while the test runs, formatted
  with its traceback; ``service_log.problems()`` lists the ones that show an unhandled exception.
- ``faulty_llm``: a started ``FakeOpenAIServer`` playing a ``FaultyModel``: scripted faults first
  (loop calls and streamed calls each have their own queue), then a well-behaved echo agent.
- ``start_faulty_service(**settings)``: the real app under uvicorn in a thread, on this test's
  database, talking to ``faulty_llm``; stopped after the test.
- ``figures``: numbers a test measured, printed in the terminal summary (docs/reliability.md
  quotes them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from tests.integration.service.workers_support import service_settings
from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer, FakeReply
from tests.support.server import ServerThread

_FIGURES: list[tuple[str, str]] = []

PROBLEM_MARKERS = ("Traceback", "unhandled", "Exception in ASGI application", "was never retrieved")
"""What in a log line means an exception escaped to where nobody handled it."""


class ServiceLog(logging.Handler):
    """Formatted records (tracebacks included) of the service's loggers, from ``attach()`` on."""

    LOGGERS = ("app", "uvicorn", "uvicorn.error", "asyncio", "")

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)
        with self._guard:
            self.lines.append(text)

    def attach(self) -> None:
        # Again after every server start: uvicorn's dictConfig replaces the handlers of its loggers.
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            if self not in logger.handlers:
                logger.addHandler(self)

    def detach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)

    @property
    def text(self) -> str:
        with self._guard:
            return "\n".join(self.lines)

    def problems(self) -> list[str]:
        with self._guard:
            return [line for line in self.lines if any(marker in line for marker in PROBLEM_MARKERS)]

    def count(self, fragment: str) -> int:
        with self._guard:
            return sum(fragment in line for line in self.lines)


@pytest.fixture
def service_log() -> Iterator[ServiceLog]:
    log = ServiceLog()
    log.attach()
    try:
        yield log
    finally:
        log.detach()


class FaultyModel:
    """A fake OpenAI behaviour: the queued faults first, then an echo agent that answers well.

    ``loop_faults`` answer non-streaming calls (the tool loop), ``stream_faults`` streaming ones
    (synthesis), each in order. ``calls`` records ``(monotonic time, streaming)`` of every request.
    While ``loop_gate`` / ``stream_gate`` is clear, the echo agent's replies to those calls wait
    for the test to set it (the run then lasts exactly as long as the test needs).
    """

    def __init__(self, tokens: Sequence[str] | int = 12) -> None:
        self.agent = EchoAgentBehaviour(tokens)
        self.loop_faults: list[FakeReply] = []
        self.stream_faults: list[FakeReply] = []
        self.calls: list[tuple[float, bool]] = []
        self.loop_gate = threading.Event()
        self.stream_gate = threading.Event()
        self.loop_gate.set()
        self.stream_gate.set()
        self._guard = threading.Lock()

    @property
    def answer(self) -> str:
        return self.agent.answer

    def fail(self, loop: Sequence[FakeReply] = (), stream: Sequence[FakeReply] = ()) -> FaultyModel:
        with self._guard:
            self.loop_faults = list(loop)
            self.stream_faults = list(stream)
            self.calls.clear()
        return self

    def answer_with(self, tokens: Sequence[str] | int, delay_s: float = 0.0) -> FaultyModel:
        """Stream a different answer from now on: ``tokens``, ``delay_s`` apart."""
        with self._guard:
            self.agent = EchoAgentBehaviour(tokens, delay_s=delay_s)
        return self

    @property
    def pending_faults(self) -> int:
        with self._guard:
            return len(self.loop_faults) + len(self.stream_faults)

    def __call__(self, body: dict[str, Any]) -> FakeReply:
        streaming = bool(body.get("stream"))
        with self._guard:
            self.calls.append((time.monotonic(), streaming))
            queue = self.stream_faults if streaming else self.loop_faults
            if queue:
                return queue.pop(0)
            agent = self.agent
        gate = self.stream_gate if streaming else self.loop_gate
        reply = agent(body)
        return reply if gate.is_set() else FakeReply.blocked(gate, reply, timeout_s=60)

    def release(self) -> None:
        """Open both gates (nothing a test left waiting may outlive it)."""
        self.loop_gate.set()
        self.stream_gate.set()


@pytest.fixture
def faulty_llm() -> Iterator[tuple[FakeOpenAIServer, FaultyModel]]:
    model = FaultyModel()
    with FakeOpenAIServer() as server:
        server.set_handler(model)
        try:
            yield server, model
        finally:
            model.release()


@pytest.fixture
def start_faulty_service(
    migrated_database_url: str,
    faulty_llm: tuple[FakeOpenAIServer, FaultyModel],
    service_log: ServiceLog,
) -> Iterator[Callable[..., ServerThread]]:
    """``start_faulty_service(**settings)``: an in-thread server on this test's database (unless
    ``database_url`` says otherwise)."""
    started: list[ServerThread] = []
    server, model = faulty_llm

    def start(**overrides: Any) -> ServerThread:
        database_url = overrides.pop("database_url", migrated_database_url)
        settings = service_settings(database_url, server.base_url, **overrides)
        thread = ServerThread(settings).start()
        started.append(thread)
        service_log.attach()
        return thread

    try:
        yield start
    finally:
        model.release()
        for thread in reversed(started):
            thread.stop()


@pytest.fixture
def figures() -> Callable[[str, str], None]:
    """``figures(name, value)``: a measured number, printed at the end of the session."""

    def record(name: str, value: str) -> None:
        _FIGURES.append((name, value))

    return record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _FIGURES:
        terminalreporter.section("reliability figures")
        for name, value in _FIGURES:
            terminalreporter.write_line(f"{name}: {value}")
