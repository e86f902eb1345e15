"""Fixtures of the service's API tests: the real app under uvicorn in a thread, driven over httpx.

- ``service(...)``: a factory; each call starts a ``ServerThread`` on this test's database and
  returns a ``Service``; every one is stopped (and its Redis keys deleted) after the test. The
  database is ``migrated_database_url`` on ``database_backend`` (SQLite in the ``test_api_*``
  modules unless a test parametrises it); the bus is in-process unless ``redis_url`` is given.
- ``stack``: one service per module on each of {sqlite, postgres} x {memory, redis}, for the main
  happy paths; ``stack_api`` is a fresh caller on it.
- ``shared_service``: one service per module on SQLite and the in-process bus; ``alice`` and
  ``bob`` are two fresh callers on it. Shared services know many keys, and every test gets owners
  nobody used before, so it sees an empty world however many tests ran on the server before it.
- ``fake_llm``: a started ``FakeOpenAIServer``; ``service(llm=fake_llm)`` replaces the demo model.
- ``Api``: an httpx client acting as one caller, with the calls the tests repeat.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from app.settings import Settings
from app.tools.registry import Tool
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.server import CLIENT_TLS, ServerThread, free_port, wait_until
from tests.support.services import REDIS_URL
from tests.support.sse import SseEvent, iter_sse, read_events

KEYS = "alice:ka,bob:kb"
ALICE_KEY = "ka"
BOB_KEY = "kb"
SHARED_OWNERS = 100
"""How many fresh owners a shared service can hand out."""
SHARED_KEYS = ",".join(f"owner{i}:key-{i:03d}" for i in range(SHARED_OWNERS))


@dataclass
class RunOutcome:
    started: dict[str, Any]
    events: list[SseEvent]

    @property
    def run_id(self) -> str:
        return str(self.started["run_id"])

    @property
    def done(self) -> dict[str, Any]:
        assert self.events, "the stream carried no events"
        last = self.events[-1]
        assert last.event == "done", f"the last event is {last.event}, not done"
        return last.data


class Api:
    """One caller of the service (a key, or none), over one httpx client."""

    def __init__(self, base_url: str, key: str | None) -> None:
        self.key = key
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=15.0, verify=CLIENT_TLS)

    def close(self) -> None:
        self.http.close()

    # -- plain calls ---------------------------------------------------------------------------

    def create_conversation(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = (
            self.http.post("/api/conversations", json=body)
            if body is not None
            else (self.http.post("/api/conversations"))
        )
        assert response.status_code == 201, response.text
        return dict(response.json())

    def conversation(self, conversation_id: str) -> dict[str, Any]:
        response = self.http.get(f"/api/conversations/{conversation_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def start_run(self, conversation_id: str, message: str) -> dict[str, Any]:
        response = self.http.post(f"/api/conversations/{conversation_id}/runs", json={"message": message})
        assert response.status_code == 202, response.text
        return dict(response.json())

    def get_run(self, run_id: str) -> dict[str, Any]:
        response = self.http.get(f"/api/runs/{run_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def run_events(self, run_id: str) -> list[dict[str, Any]]:
        response = self.http.get(f"/api/runs/{run_id}/events")
        assert response.status_code == 200, response.text
        return list(response.json())

    # -- streams -------------------------------------------------------------------------------

    @contextmanager
    def open_stream(self, conversation_id: str, **params: str) -> Iterator[Iterator[SseEvent | str]]:
        """The conversation's stream, read item by item (events, and comments as strings)."""
        with self.http.stream("GET", f"/api/conversations/{conversation_id}/stream", params=params) as resp:
            assert resp.status_code == 200, resp.read().decode(errors="replace")
            assert resp.headers["content-type"].startswith("text/event-stream")
            yield iter_sse(resp)

    def stream(self, conversation_id: str, **params: str) -> list[SseEvent]:
        """Every event the stream sends until the server closes it (after ``done``)."""
        with self.http.stream("GET", f"/api/conversations/{conversation_id}/stream", params=params) as resp:
            assert resp.status_code == 200, resp.read().decode(errors="replace")
            return read_events(resp)

    def run(self, conversation_id: str, message: str) -> RunOutcome:
        """Start a run and follow its stream to ``done``."""
        started = self.start_run(conversation_id, message)
        return RunOutcome(started, self.stream(conversation_id))

    def wait_finished(self, run_id: str, timeout: float = 10.0) -> dict[str, Any]:
        def finished() -> dict[str, Any] | None:
            run = self.get_run(run_id)
            return run if run["status"] not in ("running", "queued") else None

        result: dict[str, Any] = wait_until(finished, timeout=timeout, what=f"run {run_id} to finish")
        return result

    # -- what is stored ------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything this caller can read: conversations (every page) with messages and runs."""
        conversations: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params = {"limit": "100", **({"cursor": cursor} if cursor else {})}
            page = self.http.get("/api/conversations", params=params)
            assert page.status_code == 200, page.text
            body = page.json()
            conversations.extend(body["items"])
            cursor = body["next_cursor"]
            if cursor is None:
                break
        details = {c["id"]: self.conversation(c["id"]) for c in conversations}
        runs = {
            run_id: self.get_run(run_id)
            for detail in details.values()
            for run_id in sorted({m["run_id"] for m in detail["messages"] if m["run_id"]})
        }
        return {"conversations": conversations, "details": details, "runs": runs}


@dataclass
class Service:
    server: ServerThread
    settings: Settings
    fake_llm: FakeOpenAIServer | None
    _apis: list[Api] = field(default_factory=list)
    _owners_used: int = 0

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def services(self) -> Any:
        """The app's ``Services`` (same process): for setup that has no HTTP route, like a test tool."""
        return self.server.services

    def api(self, key: str | None = None) -> Api:
        api = Api(self.base_url, key)
        self._apis.append(api)
        return api

    def fresh_api(self) -> Api:
        """A caller no test used before (shared services only: they know ``SHARED_KEYS``)."""
        self._owners_used += 1
        assert self._owners_used <= SHARED_OWNERS, "raise SHARED_OWNERS"
        return self.api(f"key-{self._owners_used - 1:03d}")

    def add_tool(self, tool: Tool) -> None:
        self.services.tools.register(tool)

    def stop(self) -> None:
        for api in self._apis:
            api.close()
        self.server.stop()


ServiceFactory = Callable[..., Service]


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The API tests run on SQLite only, unless they parametrise ``database_backend``.

    Limited to the ``test_api_*`` modules: the other tests of this folder keep the database
    matrix of ``tests/integration/conftest.py``.
    """
    if not metafunc.module.__name__.rpartition(".")[2].startswith("test_api_"):
        return
    if "database_backend" not in metafunc.fixturenames:
        return
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        if "database_backend" in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return
    # A marker, not metafunc.parametrize(): the fixture's own params then stand aside.
    metafunc.definition.add_marker(pytest.mark.parametrize("database_backend", ["sqlite"]))


@pytest.fixture
def fake_llm() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer(model="api-test-model").start()
    try:
        yield server
    finally:
        server.stop()


def _delete_keys(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def service(migrated_database_url: str) -> Iterator[ServiceFactory]:
    """``service(api_keys=..., llm=fake_llm, redis_url=..., **settings)`` -> a started ``Service``."""
    started: list[Service] = []
    prefixes: list[str] = []

    def make(
        *,
        api_keys: str | None = None,
        llm: FakeOpenAIServer | None = None,
        redis_url: str | None = None,
        **overrides: Any,
    ) -> Service:
        prefix = f"agentstream-test:api-{secrets.token_hex(6)}"
        if redis_url is not None:
            prefixes.append(prefix)
        values: dict[str, Any] = {
            "database_url": migrated_database_url,
            "redis_url": redis_url,
            "redis_key_prefix": prefix,
            "api_keys": api_keys,
            "llm_base_url": llm.base_url if llm is not None else None,
            "llm_api_key": "sk-api-test" if llm is not None else None,
            "llm_model": "api-test-model",
            "llm_max_retries": 0,
            "demo_delay_s": 0,
            # Stopping the server must not wait for runs a test left blocked.
            "shutdown_grace_s": 0,
            "log_level": "WARNING",
            **overrides,
        }
        settings = Settings(_env_file=None, **values)  # type: ignore[call-arg]
        svc = Service(ServerThread(settings).start(), settings, llm)
        started.append(svc)
        return svc

    try:
        yield make
    finally:
        for svc in reversed(started):
            svc.stop()
        for prefix in prefixes:
            _delete_keys(prefix)


def shared_settings(database_url: str, redis_url: str | None = None) -> Settings:
    return Settings(  # type: ignore[call-arg]
        _env_file=None,
        database_url=database_url,
        redis_url=redis_url,
        redis_key_prefix=f"agentstream-test:api-{secrets.token_hex(6)}",
        api_keys=SHARED_KEYS,
        llm_base_url=None,
        demo_delay_s=0,
        shutdown_grace_s=0,
        log_level="WARNING",
    )


@pytest.fixture(scope="module")
def shared_service(
    sqlite_migrated_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """One service per module: SQLite, in-process bus, demo model, ``SHARED_KEYS``."""
    path = tmp_path_factory.mktemp("shared-service") / "agentstream.db"
    shutil.copyfile(sqlite_migrated_template, path)
    settings = shared_settings(f"sqlite+aiosqlite:///{path}")
    svc = Service(ServerThread(settings).start(), settings, None)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def alice(shared_service: Service) -> Api:
    return shared_service.fresh_api()


@pytest.fixture
def bob(shared_service: Service) -> Api:
    return shared_service.fresh_api()


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("sqlite", "memory"), id="sqlite-memory"),
        pytest.param(("sqlite", "redis"), id="sqlite-redis", marks=pytest.mark.redis),
        pytest.param(("postgres", "memory"), id="postgres-memory", marks=pytest.mark.postgres),
        pytest.param(
            ("postgres", "redis"), id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]
        ),
    ],
)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One service per module and per {sqlite, postgres} x {memory, redis}, with ``SHARED_KEYS``."""
    database, bus_kind = request.param
    if database == "sqlite":
        template: Path = request.getfixturevalue("sqlite_migrated_template")
        path = tmp_path_factory.mktemp("stack") / "agentstream.db"
        shutil.copyfile(template, path)
        url = f"sqlite+aiosqlite:///{path}"
    else:
        # The session's migrated database; tests that use it on their own empty it first.
        server = request.getfixturevalue("postgres_server")
        name = request.getfixturevalue("postgres_migrated_database")
        server.empty_tables(name)
        url = server.async_url(name)
    settings = shared_settings(url, REDIS_URL if bus_kind == "redis" else None)
    svc = Service(ServerThread(settings).start(), settings, None)
    try:
        yield svc
    finally:
        svc.stop()
        if bus_kind == "redis":
            _delete_keys(settings.redis_key_prefix)


@pytest.fixture
def stack_api(stack: Service) -> Api:
    return stack.fresh_api()


@pytest.fixture
def closed_port_url() -> str:
    """A Redis URL on a loopback port nothing listens on."""
    return f"redis://127.0.0.1:{free_port()}/0"


class LogRecorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []
        self._lock_lines = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock_lines:
            self.lines.append(record.getMessage())


@pytest.fixture
def app_logs() -> Iterator[LogRecorder]:
    """Messages logged on the ``app`` logger (which does not propagate, so caplog cannot see them)."""
    recorder = LogRecorder()
    logger = logging.getLogger("app")
    logger.addHandler(recorder)
    try:
        yield recorder
    finally:
        logger.removeHandler(recorder)
