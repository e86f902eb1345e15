"""MCP tools end to end: a real service (uvicorn in a thread) connected to the test MCP server
over stdio (started by the service from MCP_SERVERS) and over streamable HTTP (a subprocess on a
free port), with the fake OpenAI server playing the model that calls the MCP tools.

One service serves the whole module: starting an MCP server process costs about a second.
"""

from __future__ import annotations

import json
import logging
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.main import create_app
from app.settings import Settings
from app.tools.mcp import MCPConfigError
from tests.support.fake_agents import ToolAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.server import CLIENT_TLS, ROOT, ServerThread, free_port, wait_until

pytestmark = pytest.mark.slow

ENV_PROBE = "AGENTSTREAM_MCP_TEST_PROBE"


class RecordingHandler(logging.Handler):
    """Keeps the log records of one logger, with their structured extras."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def mcp_http_url() -> Iterator[str]:
    """The test MCP server over streamable HTTP, as a subprocess."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.mcp_server", "--http", "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        readable, _, _ = select.select([proc.stdout], [], [], 30)
        assert readable, "the MCP HTTP server printed no URL within 30s"
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), f"unexpected first line {url!r}"
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()


@pytest.fixture(scope="module")
def fake_llm() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer(model="mcp-test-model").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def logs() -> Iterator[dict[str, RecordingHandler]]:
    """Records of the audit hook's logger and of the MCP module's logger."""
    handlers: dict[str, RecordingHandler] = {}
    levels: dict[str, int] = {}
    for name in ("app.audit", "app.tools.mcp"):
        logger = logging.getLogger(name)
        levels[name] = logger.level
        logger.setLevel(logging.INFO)  # the service logs at WARNING; these two are what we check
        handlers[name] = RecordingHandler()
        logger.addHandler(handlers[name])
    try:
        yield handlers
    finally:
        for name, handler in handlers.items():
            logging.getLogger(name).removeHandler(handler)
            logging.getLogger(name).setLevel(levels[name])


def mcp_config(http_url: str) -> list[dict[str, Any]]:
    return [
        {
            "name": "files",
            "transport": "stdio",
            "command": sys.executable,
            "args": ["-m", "tests.support.mcp_server"],
            "env": {ENV_PROBE: "from-the-config"},
            "cwd": str(ROOT),
        },
        {"name": "web", "transport": "http", "url": http_url, "timeout_s": 0.5},
        {"name": "broken", "transport": "stdio", "command": str(ROOT / "no-such-mcp-server")},
        {"name": "gone", "transport": "http", "url": f"http://127.0.0.1:{free_port()}/mcp"},
    ]


@pytest.fixture(scope="module")
def service(
    tmp_path_factory: pytest.TempPathFactory,
    sqlite_migrated_template: Path,
    fake_llm: FakeOpenAIServer,
    mcp_http_url: str,
    logs: dict[str, RecordingHandler],
) -> Iterator[ServerThread]:
    db_path = tmp_path_factory.mktemp("mcp-db") / "agentstream.db"
    shutil.copyfile(sqlite_migrated_template, db_path)
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        database_url=f"sqlite+aiosqlite:///{db_path}",
        llm_base_url=fake_llm.base_url,
        llm_api_key="sk-mcp-test",
        llm_model="mcp-test-model",
        llm_max_retries=0,
        mcp_servers=json.dumps(mcp_config(mcp_http_url)),
        # Built-ins and both servers' tools together pass the default threshold; selection is not
        # what these tests are about.
        tool_selection_threshold=100,
        shutdown_grace_s=0,
        log_level="WARNING",
    )
    server = ServerThread(settings).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def http(service: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.base_url, timeout=15, verify=CLIENT_TLS) as client:
        yield client


def run_to_done(http: httpx.Client, message: str) -> tuple[str, list[dict[str, Any]]]:
    """Start a run in a new conversation; its id and stored events once it finished."""
    conversation = http.post("/api/conversations").json()
    started = http.post(f"/api/conversations/{conversation['id']}/runs", json={"message": message})
    assert started.status_code == 202, started.text
    run_id = str(started.json()["run_id"])

    def stored_to_done() -> list[dict[str, Any]] | None:
        events: list[dict[str, Any]] = http.get(f"/api/runs/{run_id}/events").json()
        return events if events and events[-1]["event"] == "done" else None

    events: list[dict[str, Any]] = wait_until(stored_to_done, timeout=15, what=f"run {run_id} to finish")
    return run_id, events


def tool_done(events: list[dict[str, Any]]) -> dict[str, Any]:
    done = [
        e["data"]
        for e in events
        if e["event"] == "step" and e["data"]["type"] == "iteration" and e["data"]["status"] == "done"
    ]
    assert len(done) == 1, events
    return dict(done[0])


def audit_of(logs: dict[str, RecordingHandler], run_id: str) -> list[tuple[str, str]]:
    return [
        (str(getattr(r, "tool", "")), str(getattr(r, "outcome", "")))
        for r in logs["app.audit"].records
        if getattr(r, "run_id", None) == run_id
    ]


def test_mcp_tools_of_stdio_and_http_servers_are_listed_next_to_builtins(http: httpx.Client) -> None:
    tools = {t["name"]: t for t in http.get("/api/tools").json()}

    for server in ("files", "web"):
        for tool in ("add", "shout", "fail", "wait", "echo_env"):
            assert f"{server}__{tool}" in tools
    assert "calculator" in tools
    add = tools["files__add"]
    assert add["description"] == "Add two integers and return the sum."
    assert add["parameters"]["type"] == "object"
    assert set(add["parameters"]["properties"]) == {"a", "b"}
    assert add["parameters"]["properties"]["a"]["type"] == "integer"
    assert sorted(add["parameters"]["required"]) == ["a", "b"]


def test_run_calling_a_stdio_mcp_tool_gets_its_result_as_the_observation_and_audit_sees_it(
    http: httpx.Client, fake_llm: FakeOpenAIServer, logs: dict[str, RecordingHandler]
) -> None:
    fake_llm.set_handler(ToolAgentBehaviour("files__add", {"a": 2, "b": 3}))
    before = len(fake_llm.requests)

    run_id, events = run_to_done(http, "what is 2 plus 3?")

    step = tool_done(events)
    assert step["tool_name"] == "files__add"
    assert step["observation"] == "5"
    assert step["error"] is None
    assert events[-1]["event"] == "done" and events[-1]["data"]["status"] == "completed"
    # The model was shown the MCP result as the tool message of its call.
    tool_messages = [
        m for body in fake_llm.requests[before:] for m in body["messages"] if m.get("role") == "tool"
    ]
    assert tool_messages and tool_messages[0]["content"] == "5"
    assert ("files__add", "ok") in audit_of(logs, run_id)


def test_run_calling_an_http_mcp_tool_gets_its_result_as_the_observation(
    http: httpx.Client, fake_llm: FakeOpenAIServer, logs: dict[str, RecordingHandler]
) -> None:
    fake_llm.set_handler(ToolAgentBehaviour("web__shout", {"text": "hello"}))

    run_id, events = run_to_done(http, "shout hello")

    step = tool_done(events)
    assert (step["tool_name"], step["observation"], step["error"]) == ("web__shout", "HELLO!", None)
    assert ("web__shout", "ok") in audit_of(logs, run_id)


def test_stdio_mcp_server_runs_with_the_env_of_its_config(
    http: httpx.Client, fake_llm: FakeOpenAIServer
) -> None:
    fake_llm.set_handler(ToolAgentBehaviour("files__echo_env", {"name": ENV_PROBE}))

    _, events = run_to_done(http, "which probe value?")

    assert tool_done(events)["observation"] == "from-the-config"


def test_mcp_error_result_becomes_an_error_observation(
    http: httpx.Client, fake_llm: FakeOpenAIServer, logs: dict[str, RecordingHandler]
) -> None:
    fake_llm.set_handler(ToolAgentBehaviour("files__fail", {"message": "disk on fire"}))

    run_id, events = run_to_done(http, "try the failing tool")

    step = tool_done(events)
    assert step["error"] is not None and "disk on fire" in step["error"]
    assert "MCPToolError" in step["error"]
    assert events[-1]["data"]["status"] == "completed"
    assert ("files__fail", "error") in audit_of(logs, run_id)


def test_mcp_tool_slower_than_its_timeout_becomes_an_error_observation(
    http: httpx.Client, fake_llm: FakeOpenAIServer
) -> None:
    fake_llm.set_handler(ToolAgentBehaviour("web__wait", {"seconds": 5}))
    started = time.monotonic()

    _, events = run_to_done(http, "wait a while")

    step = tool_done(events)
    assert step["error"] == "Tool 'web__wait' timed out after 0.5s"
    assert time.monotonic() - started < 4


def test_mcp_servers_that_fail_to_start_are_skipped_and_the_service_is_ready(
    http: httpx.Client, logs: dict[str, RecordingHandler]
) -> None:
    names = [t["name"] for t in http.get("/api/tools").json()]
    assert not [n for n in names if n.startswith(("broken__", "gone__"))]
    ready = http.get("/readyz")
    assert ready.status_code == 200, ready.text
    failed = {
        getattr(r, "mcp_server", None): str(getattr(r, "error", ""))
        for r in logs["app.tools.mcp"].records
        if r.levelno >= logging.ERROR
    }
    assert set(failed) == {"broken", "gone"}
    assert "no-such-mcp-server" in failed["broken"]


async def test_invalid_mcp_servers_config_stops_start_up_with_a_clear_error(tmp_path: Path) -> None:
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'agentstream.db'}",
        mcp_servers=json.dumps([{"name": "files", "transport": "stdio", "args": ["-m", "x"]}]),
        log_level="WARNING",
    )
    app = create_app(settings)

    with pytest.raises(MCPConfigError, match=r"entry 0 \('files'\): command: Field required"):
        async with app.router.lifespan_context(app):
            pass
