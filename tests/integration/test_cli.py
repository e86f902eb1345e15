"""``python -m app.cli`` end to end against a real uvicorn process running the built-in demo model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import ROOT, free_port, wait_healthy

pytestmark = pytest.mark.slow

KEY = "cli-test-key-7f3a"


@dataclass(frozen=True)
class Server:
    base_url: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``python -m uvicorn app.main:create_app --factory`` on a free port, stopped after the module."""
    yield from serve(tmp_path_factory.mktemp("cli-server"))


def serve(tmp: Path, **settings: str) -> Iterator[Server]:
    """The demo service on a free port with ``settings`` as environment variables."""
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/db.sqlite",
        # Empty means unset: the demo model answers and the in-process bus carries events.
        "LLM_BASE_URL": "",
        "REDIS_URL": "",
        "API_KEYS": f"alice:{KEY}",
        **settings,
    }
    command = [sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory", "--host", "127.0.0.1"]
    log_path = tmp / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([*command, "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=log)
    base_url = f"http://127.0.0.1:{port}"

    def alive() -> None:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{log_path.read_text(errors='replace')}")

    try:
        wait_healthy(base_url, alive)
        yield Server(base_url)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def cli(server: Server, *args: str, key: str | None = KEY) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "AGENTSTREAM_URL": server.base_url}
    env.pop("AGENTSTREAM_KEY", None)
    if key is not None:
        env["AGENTSTREAM_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def api(server: Server, path: str) -> Any:
    response = httpx.get(f"{server.base_url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    response.raise_for_status()
    return response.json()


@pytest.fixture(scope="module")
def human_chat(server: Server) -> subprocess.CompletedProcess[str]:
    """One finished ``chat`` in readable form; tests that only read it share it to stay fast."""
    return cli(server, "chat", "What is 17*23?", "--url", server.base_url)


@pytest.fixture(scope="module")
def json_chat(server: Server) -> subprocess.CompletedProcess[str]:
    """One finished ``chat --json``, shared like ``human_chat``."""
    return cli(server, "chat", "What is 17*23?", "--json")


def conversation_of(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("conversation: "):
            return line.removeprefix("conversation: ")
    raise AssertionError(f"no conversation id printed:\n{output}")


def json_events(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.strip()]


def test_chat_prints_the_tool_step_the_streamed_answer_and_the_footer(
    human_chat: subprocess.CompletedProcess[str],
) -> None:
    result = human_chat
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Traceback" not in result.stderr
    assert '→ calculator {"expression": ' in out
    observation = next(line for line in out.splitlines() if line.startswith("  ← "))
    assert "391" in observation
    assert "── completed · " in out
    assert "391" in out.split(observation, 1)[1]  # the streamed answer, after the tool step
    conversation = conversation_of(out)
    assert f'continue with: agentstream chat "..." --conversation {conversation}' in out
    assert KEY not in out + result.stderr


def test_chat_json_streams_every_event_of_the_run_with_increasing_cursors(
    server: Server, json_chat: subprocess.CompletedProcess[str]
) -> None:
    result = json_chat
    assert result.returncode == 0, result.stderr
    events = json_events(result.stdout)
    ids = [tuple(int(part) for part in e["id"].split("-")) for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert events[-1]["event"] == "done"
    done = events[-1]["data"]
    assert done["status"] == "completed"
    deltas = [
        e["data"]["content"] for e in events if e["event"] == "answer" and e["data"]["status"] == "delta"
    ]
    assert "".join(deltas) == done["answer"]
    assert {e["data"]["run_id"] for e in events} == {done["run_id"]}
    assert result.stderr.startswith("conversation: ")

    # The stored record and stored events match what was streamed.
    run = api(server, f"/api/runs/{done['run_id']}")
    assert run["answer"] == done["answer"]
    stored = [(e["id"], e["event"]) for e in api(server, f"/api/runs/{done['run_id']}/events")]
    assert stored == [(e["id"], e["event"]) for e in events]


def test_chat_with_conversation_continues_the_same_conversation(
    server: Server, human_chat: subprocess.CompletedProcess[str]
) -> None:
    assert human_chat.returncode == 0, human_chat.stderr
    conversation = conversation_of(human_chat.stdout)

    second = cli(server, "chat", "And what is 2+2?", "--conversation", conversation, "--json")
    assert second.returncode == 0, second.stderr
    assert conversation_of(second.stderr) == conversation
    done = json_events(second.stdout)[-1]
    assert done["event"] == "done"
    assert done["data"]["status"] == "completed"
    assert api(server, f"/api/runs/{done['data']['run_id']}")["conversation_id"] == conversation


def test_interrupt_without_an_active_run_is_a_clear_error(
    server: Server, human_chat: subprocess.CompletedProcess[str]
) -> None:
    conversation = conversation_of(human_chat.stdout)
    result = cli(server, "interrupt", conversation, "hurry up")
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: no run is active in conversation {conversation}")
    assert "Traceback" not in result.stderr


def test_runs_shows_the_run_and_its_stored_events(
    server: Server, json_chat: subprocess.CompletedProcess[str]
) -> None:
    done = json_events(json_chat.stdout)[-1]["data"]

    shown = cli(server, "runs", done["run_id"])
    assert shown.returncode == 0, shown.stderr
    assert f"run          {done['run_id']}\n" in shown.stdout
    assert "status       completed\n" in shown.stdout
    assert shown.stdout.rstrip("\n").endswith(done["answer"].rstrip("\n"))

    events = cli(server, "runs", done["run_id"], "--events")
    assert events.returncode == 0, events.stderr
    assert "→ calculator" in events.stdout
    assert "── completed · " in events.stdout


def test_runs_of_an_unknown_id_prints_the_servers_error(server: Server) -> None:
    result = cli(server, "runs", "no-such-run")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ")
    assert "HTTP 404)" in result.stderr
    assert "Traceback" not in result.stderr


def test_watch_replays_the_latest_run_and_stops_at_its_done(
    server: Server, json_chat: subprocess.CompletedProcess[str]
) -> None:
    events = json_events(json_chat.stdout)
    conversation = conversation_of(json_chat.stderr)

    watched = cli(server, "watch", conversation, "--json")
    assert watched.returncode == 0, watched.stderr
    assert [e["id"] for e in json_events(watched.stdout)] == [e["id"] for e in events]

    finished = cli(server, "watch", conversation, "--after", events[-1]["id"])
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.startswith("no run to follow in this conversation\n")


def test_conversations_lists_the_callers_conversations(
    server: Server, human_chat: subprocess.CompletedProcess[str]
) -> None:
    conversation = conversation_of(human_chat.stdout)
    listed = cli(server, "conversations")
    assert listed.returncode == 0, listed.stderr
    assert any(line.startswith(f"{conversation}  ") for line in listed.stdout.splitlines())


def test_a_wrong_key_is_refused_cleanly_and_never_echoed(server: Server) -> None:
    result = cli(server, "conversations", key="wrong-key-c0ffee")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ")
    assert "HTTP 401)" in result.stderr
    assert "wrong-key-c0ffee" not in result.stdout + result.stderr


def test_python_dash_m_app_cli_shows_the_subcommands(server: Server) -> None:
    result = cli(server, "--help")
    assert result.returncode == 0
    assert "chat" in result.stdout and "serve" in result.stdout
