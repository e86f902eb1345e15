"""Shared pieces of the stream and many-workers tests: a gated fake model, an API client, servers.

- ``GatedAgent``: a fake OpenAI behaviour whose loop calls wait for a gate the test opens, so a run
  lasts exactly as long as the test needs, with no sleeps.
- ``Api``: a small sync client of one service (REST calls and SSE streams through httpx);
  ``Stream``: one open SSE response read bit by bit (events, ``: ping`` comments, its end).
- ``STACKS``, ``BUSES``: the databases x buses a stream test runs on.
- fixtures: ``gated_llm`` (a started fake server playing a ``GatedAgent``), ``redis_prefix`` (a
  unique key prefix whose keys are deleted afterwards), ``clients`` (makes ``Api``s, closed after
  the test), ``start_service`` (in-thread servers on this test's database, stopped after it).
- ``Cluster``: uvicorn worker subprocesses on one database and Redis, for the many-workers tests;
  ``start_stream_interrupt_and_cancel_across_workers``: the scenario both database modules run.

Named apart from the fixtures of this folder's conftest.py, which the API tests own.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from app.db.repositories import RunRepo
from app.db.session import Database
from app.settings import Settings
from app.streaming.bus import StoredEvent
from tests.integration.conftest import run_in_own_loop
from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer, FakeReply
from tests.support.server import CLIENT_TLS, ServerProcess, ServerThread, wait_until
from tests.support.services import REDIS_URL
from tests.support.sse import SseEvent, iter_sse

STACKS = pytest.mark.parametrize(
    ("database_backend", "redis_bus"),
    [
        pytest.param("sqlite", False, id="sqlite-memory"),
        pytest.param("sqlite", True, id="sqlite-redis", marks=pytest.mark.redis),
        pytest.param("postgres", True, id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
    ],
)
"""Database and bus of a single-worker stream test (the bus decides; the database is the fallback)."""

BUSES = pytest.mark.parametrize(
    ("database_backend", "redis_bus"),
    [
        pytest.param("sqlite", False, id="sqlite-memory"),
        pytest.param("sqlite", True, id="sqlite-redis", marks=pytest.mark.redis),
    ],
)
"""Both buses, on SQLite: for the stream tests whose database only keeps what the bus carried."""

READ_TIMEOUT_S = 10.0
"""Longest silence a test client accepts on a stream (pings come far more often)."""


class GatedAgent:
    """Echo agent: loop calls are held until ``gate`` is set, then the answer streams token by token.

    ``loop_calls`` counts the loop requests that arrived; ``requests`` keeps every request body, so
    a test can see what the engine sent (an interrupt's text, for instance).
    """

    def __init__(self, tokens: Sequence[str] | int = 40, delay_s: float = 0.0) -> None:
        self.inner = EchoAgentBehaviour(tokens, delay_s=delay_s)
        self.gate = threading.Event()
        self.gate.set()
        self.loop_calls = 0
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    @property
    def answer(self) -> str:
        return self.inner.answer

    def close_gate(self) -> None:
        self.gate.clear()

    def __call__(self, body: dict[str, Any]) -> FakeReply:
        with self._lock:
            self.requests.append(body)
            if not body.get("stream"):
                self.loop_calls += 1
        reply = self.inner(body)
        if body.get("stream") or self.gate.is_set():
            return reply
        return FakeReply.blocked(self.gate, reply, timeout_s=60)

    def saw(self, text: str) -> bool:
        """Whether any request the engine sent carries ``text`` in a message."""
        with self._lock:
            bodies = list(self.requests)
        return any(text in str(message.get("content")) for b in bodies for message in b.get("messages", ()))


class FakeLLM:
    """The started fake server and the behaviour it plays (replace ``agent`` to change it)."""

    def __init__(self, server: FakeOpenAIServer) -> None:
        self.server = server
        self.agent = GatedAgent()
        server.set_handler(lambda body: self.agent(body))

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def play(self, agent: GatedAgent) -> GatedAgent:
        self.agent = agent
        return agent


@pytest.fixture(name="gated_llm")
def gated_llm_fixture() -> Iterator[FakeLLM]:
    with fake_llm_serving() as fake:
        yield fake


@pytest.fixture(name="redis_prefix")
def redis_prefix_fixture() -> Iterator[str]:
    with redis_keys(new_redis_prefix()) as prefix:
        yield prefix


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL, decode_responses=True)


def service_settings(database_url: str, llm_base_url: str, **overrides: Any) -> Settings:
    """Settings of a test service: the fake model, no keys, quick pings; nothing read from .env."""
    values: dict[str, Any] = {
        "database_url": database_url,
        "llm_base_url": llm_base_url,
        "llm_api_key": "test-key",
        "llm_model": "fake-model",
        "llm_timeout_s": 30.0,
        "llm_max_retries": 0,
        "redis_url": None,
        "api_keys": None,
        "sse_ping_seconds": 0.2,
        "shutdown_grace_s": 5.0,
        "log_level": "WARNING",
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.fixture(name="start_service")
def start_service_fixture(
    migrated_database_url: str, gated_llm: FakeLLM, redis_prefix: str
) -> Iterator[Callable[..., ServerThread]]:
    """``start_service(redis=True, **settings)``: an in-thread server on this test's database.

    With ``redis`` the bus is the real Redis under ``redis_prefix``; otherwise the in-process bus.
    """
    started: list[ServerThread] = []

    def start(*, redis: bool = True, **overrides: Any) -> ServerThread:
        overrides.setdefault("redis_url", REDIS_URL if redis else None)
        overrides.setdefault("redis_key_prefix", redis_prefix)
        settings = service_settings(migrated_database_url, gated_llm.base_url, **overrides)
        server = ServerThread(settings).start()
        started.append(server)
        return server

    try:
        yield start
    finally:
        gated_llm.agent.gate.set()
        for server in reversed(started):
            server.stop()


def worker_env(database_url: str, llm_base_url: str, **overrides: str) -> dict[str, str]:
    """Environment of a uvicorn worker subprocess, like ``service_settings``."""
    env = {
        "DATABASE_URL": database_url,
        "LLM_BASE_URL": llm_base_url,
        "LLM_API_KEY": "test-key",
        "LLM_MODEL": "fake-model",
        "LLM_TIMEOUT_S": "30",
        "LLM_MAX_RETRIES": "0",
        "REDIS_URL": "",
        "REDIS_KEY_PREFIX": "agentstream-test:unused",
        "API_KEYS": "",
        "SSE_PING_SECONDS": "0.2",
        "SHUTDOWN_GRACE_S": "5",
        "RUN_LEASE_S": "2",
        "LOG_LEVEL": "WARNING",
    }
    env.update(overrides)
    return env


class Cluster:
    """uvicorn worker processes sharing one database, one Redis key prefix and the fake model.

    ``start()`` launches workers (in parallel: each imports the whole app); ``close()`` kills every
    one still running. The model behaviour is ``llm.agent``; tests swap it with ``llm.play()``.
    """

    def __init__(self, database_url: str, llm: FakeLLM, redis_prefix: str | None, log_dir: Path) -> None:
        self.database_url = database_url
        self.llm = llm
        self.redis_prefix = redis_prefix
        self.log_dir = log_dir
        self.workers: list[ServerProcess] = []
        self._lock = threading.Lock()
        self.roles: dict[str, ServerProcess] = {}
        self._pending: dict[str, Future[list[ServerProcess]]] = {}
        # One start at a time: on a busy machine the worker needed first is then up soonest.
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-start")

    def env(self, **overrides: str) -> dict[str, str]:
        redis: dict[str, str] = {}
        if self.redis_prefix is not None:
            redis = {"REDIS_URL": REDIS_URL, "REDIS_KEY_PREFIX": self.redis_prefix}
        return worker_env(self.database_url, self.llm.base_url, **redis, **overrides)

    def start(self, count: int = 1, **overrides: str) -> list[ServerProcess]:
        return self._start_all([self.env(**overrides) for _ in range(count)])

    def start_roles(self, roles: dict[str, dict[str, str]]) -> None:
        """One worker per role, each with its own settings, all started at once; ``role()`` has them."""
        started = self._start_all([self.env(**overrides) for overrides in roles.values()])
        self.roles.update(zip(roles, started, strict=True))

    def start_roles_in_background(self, roles: dict[str, dict[str, str]]) -> None:
        """Like ``start_roles`` but returns at once: the workers start, in order, while tests run."""
        for name, overrides in roles.items():
            self._pending[name] = self._background.submit(self.start, 1, **overrides)

    def role(self, name: str) -> ServerProcess:
        """The worker started for ``name``, once it is up."""
        if name not in self.roles:
            (self.roles[name],) = self._pending.pop(name).result()
        return self.roles[name]

    def _start_all(self, envs: list[dict[str, str]]) -> list[ServerProcess]:
        started = [ServerProcess(env) for env in envs]
        with self._lock:
            first = len(self.workers)
            self.workers += started
        with ThreadPoolExecutor(max_workers=len(started)) as pool:
            futures = [
                pool.submit(worker.start, self.log_dir / f"worker-{first + i}.log")
                for i, worker in enumerate(started)
            ]
            errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            raise AssertionError(f"a worker did not start: {failed}")
        return started

    def close(self) -> None:
        self.llm.agent.gate.set()
        self._background.shutdown(wait=True, cancel_futures=True)
        for worker in self.workers:
            worker.kill()


@contextmanager
def fake_llm_serving() -> Iterator[FakeLLM]:
    """A started fake model (for fixtures of any scope)."""
    with FakeOpenAIServer() as server:
        fake = FakeLLM(server)
        try:
            yield fake
        finally:
            fake.agent.gate.set()


@contextmanager
def redis_keys(prefix: str) -> Iterator[str]:
    """``prefix``; every Redis key under it is deleted afterwards."""
    try:
        yield prefix
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        try:
            keys = list(client.scan_iter(f"{prefix}:*", count=1000))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


def new_redis_prefix() -> str:
    return f"agentstream-test:{secrets.token_hex(6)}"


class Api:
    """A sync client of one service over a real socket."""

    def __init__(self, base_url: str, *, receive_buffer: int | None = None) -> None:
        """``receive_buffer``: SO_RCVBUF of its sockets in bytes, to play a client that reads slowly."""
        self.base_url = base_url
        options = [(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)] if receive_buffer else None
        self.http = httpx.Client(
            base_url=base_url,
            timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S),
            transport=httpx.HTTPTransport(verify=CLIENT_TLS, socket_options=options),
        )

    def close(self) -> None:
        self.http.close()

    def create_conversation(self, **agent: Any) -> str:
        body = {"agent": agent} if agent else {}
        response = self.http.post("/api/conversations", json=body)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def start_run(self, conversation_id: str, message: str = "hello") -> str:
        response = self.http.post(f"/api/conversations/{conversation_id}/runs", json={"message": message})
        assert response.status_code == 202, response.text
        return str(response.json()["run_id"])

    def run(self, run_id: str) -> dict[str, Any]:
        response = self.http.get(f"/api/runs/{run_id}")
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def events(self, run_id: str) -> list[dict[str, Any]]:
        response = self.http.get(f"/api/runs/{run_id}/events")
        assert response.status_code == 200, response.text
        result: list[dict[str, Any]] = response.json()
        return result

    def interrupt(self, conversation_id: str, content: str) -> httpx.Response:
        return self.http.post(f"/api/conversations/{conversation_id}/interrupt", json={"content": content})

    def cancel(self, conversation_id: str) -> httpx.Response:
        return self.http.post(f"/api/conversations/{conversation_id}/cancel")

    def wait_finished(self, run_id: str, timeout: float = 15.0) -> dict[str, Any]:
        run: dict[str, Any] = wait_until(
            lambda: (r := self.run(run_id))["status"] not in ("running", "queued") and r,
            timeout=timeout,
            interval=0.05,
            what=f"run {run_id} to finish",
        )
        return run

    def wait_stored(self, run_id: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The run's stored events once its ``done`` is stored too."""
        events: list[dict[str, Any]] = wait_until(
            lambda: (e := self.events(run_id)) and e[-1]["event"] == "done" and e,
            timeout=timeout,
            interval=0.05,
            what=f"the done event of run {run_id} in the database",
        )
        return events

    @contextmanager
    def stream(
        self,
        conversation_id: str,
        *,
        last_event_id: str | None = None,
        after: str | None = None,
    ) -> Iterator[Stream]:
        headers = {"Last-Event-ID": last_event_id} if last_event_id is not None else {}
        params = {"after": after} if after is not None else {}
        with self.http.stream(
            "GET", f"/api/conversations/{conversation_id}/stream", headers=headers, params=params
        ) as response:
            yield Stream(response)


@pytest.fixture(name="clients")
def clients_fixture() -> Iterator[Callable[..., Api]]:
    made: list[Api] = []

    def make(base_url: str, **options: Any) -> Api:
        api = Api(base_url, **options)
        made.append(api)
        return api

    yield make
    for api in made:
        api.close()


class Stream:
    """One open SSE response, read bit by bit: ``read()`` may be called again and goes on."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.comments: list[str] = []
        self._items = iter_sse(response) if response.status_code == 200 else iter(())

    @property
    def status_code(self) -> int:
        return self.response.status_code

    def read(
        self, count: int | None = None, until: Callable[[SseEvent], bool] | None = None
    ) -> list[SseEvent]:
        """Events until ``count`` were read, ``until(event)`` holds, or the server ends the stream."""
        assert self.status_code == 200, self.response.read()
        out: list[SseEvent] = []
        if count == 0:
            return out
        for item in self._items:
            if isinstance(item, str):
                self.comments.append(item)
                continue
            out.append(item)
            if (count is not None and len(out) >= count) or (until is not None and until(item)):
                break
        return out

    def read_comments(self, count: int) -> list[str]:
        """Read on until ``count`` comment lines came (events met meanwhile are returned by ``read``)."""
        seen = len(self.comments)
        for item in self._items:
            if isinstance(item, str):
                self.comments.append(item)
                if len(self.comments) - seen >= count:
                    break
            else:
                raise AssertionError(f"an event came while the run should be quiet: {item}")
        return self.comments[seen:]

    def ends_within(self, seconds: float) -> bool:
        """Whether the server closes the stream within ``seconds`` without sending another event."""
        deadline = time.monotonic() + seconds
        for item in self._items:
            if isinstance(item, SseEvent):
                raise AssertionError(f"an event after the stream should have ended: {item}")
            if time.monotonic() > deadline:
                return False
        return True


def as_stored(events: list[SseEvent]) -> list[dict[str, Any]]:
    """Streamed events in the shape of ``GET /api/runs/{id}/events``."""
    return [{"id": e.id, "event": e.event, "data": e.data} for e in events]


def answer_of(events: list[dict[str, Any]]) -> str:
    """The concatenation of the answer deltas of events shaped like ``as_stored``'s."""
    return "".join(
        e["data"]["content"] for e in events if e["event"] == "answer" and e["data"].get("status") == "delta"
    )


def thinking(event: SseEvent) -> bool:
    """The engine asked the model (a ``thinking`` step started)."""
    return event.event == "step" and event.data.get("type") == "thinking"


def start_stream_interrupt_and_cancel_across_workers(llm: FakeLLM, a: Api, b: Api) -> None:
    """Runs start through ``a``; ``b`` streams them, interrupts one and cancels another."""
    agent = llm.play(GatedAgent(tokens=30, delay_s=0.002))
    conv = a.create_conversation()

    # Interrupt through B while A's engine waits on the model.
    agent.close_gate()
    first_id = a.start_run(conv, "first question")
    follow_up = f"also mention {secrets.token_hex(4)}"
    with b.stream(conv) as stream:
        received = stream.read(until=thinking)
        response = b.interrupt(conv, follow_up)
        assert response.status_code == 202, response.text
        assert response.json() == {"queued": 1}
        agent.gate.set()
        received += stream.read()
    injects = [e for e in received if e.event == "inject"]
    assert [e.data["content"] for e in injects] == [follow_up]
    assert agent.saw(follow_up), "the engine on A never sent the follow-up to the model"
    assert received[-1].data["status"] == "completed"
    assert as_stored(received) == b.wait_stored(first_id) == a.wait_stored(first_id)

    # Cancel through B: A stops the run and its done says so, promptly.
    agent.close_gate()
    second_id = a.start_run(conv, "second question")
    with b.stream(conv) as stream:
        received = stream.read(until=thinking)
        asked = time.monotonic()
        response = b.cancel(conv)
        assert response.status_code == 202, response.text
        received += stream.read()
        took = time.monotonic() - asked
    assert received[-1].event == "done"
    assert received[-1].data["status"] == "cancelled"
    assert took < 3.0, f"cancel took {took:.1f}s"
    assert a.run(second_id)["status"] == "cancelled"
    assert as_stored(received) == b.wait_stored(second_id)


def close_run_elsewhere(
    database_url: str,
    run_id: str,
    error: str,
    *,
    conversation_id: str | None = None,
    done: StoredEvent | None = None,
) -> bool:
    """Close ``run_id`` as ``failed`` the way another worker (a reaper) does, from a database
    handle of its own; with ``done``, stored with the close. Whether this close was the one."""

    async def close() -> bool:
        db = Database(database_url)
        try:
            return await RunRepo(db.sessionmaker).finish(
                run_id,
                status="failed",
                answer="",
                iterations=1,
                usage={},
                elapsed=1.0,
                error=error,
                pending_injections=[],
                conversation_id=conversation_id,
                done=done,
            )
        finally:
            await db.dispose()

    return run_in_own_loop(close)
