"""Secrets never appear in logs, events, or response bodies.

The service runs as it does in production (``agentstream serve``: uvicorn with its access log, in
a subprocess) with ``API_KEYS`` and ``LLM_API_KEY`` set to distinctive values and ``LOG_LEVEL=DEBUG``,
once with ``LOG_FORMAT=json`` and once with text. The fake model echoes the key it was sent in its
error bodies (some providers do); clients send wrong keys, in the header and as ``?access_token=``,
and the right key as ``?access_token=`` (the browser's way, which puts it in the request line). Then
every byte the service wrote to stdout/stderr, every event and every response body is searched.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer, FakeReply
from tests.support.server import ROOT, free_port, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ALICE_KEY = f"alice-key-{secrets.token_hex(8)}"
BOB_KEY = f"bob-key-{secrets.token_hex(8)}"
LLM_KEY = f"sk-llm-{secrets.token_hex(12)}"
WRONG_KEY = f"wrong-key-{secrets.token_hex(8)}"
SECRETS = (ALICE_KEY, BOB_KEY, LLM_KEY, WRONG_KEY)


class LeakyModel:
    """Answers normally, unless the question names a failure: then it fails with the key it was
    sent in the body, the way a provider that echoes credentials would."""

    def __init__(self, server: FakeOpenAIServer) -> None:
        self.server = server
        self.echo = EchoAgentBehaviour()
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> FakeReply:
        question = next((m["content"] for m in reversed(body["messages"]) if m["role"] == "user"), "")
        # The request being answered is the last one recorded (the handler runs right after).
        sent = self.server.received[-1].headers.get("authorization", "")
        for status in (401, 403, 429, 500):
            if f"fail {status}" in str(question):
                message = f"Incorrect API key provided: {sent}. You sent {sent.removeprefix('Bearer ')}."
                return FakeReply.error(
                    status, {"error": {"message": message, "type": "invalid_request_error"}}
                )
        if "fail plain" in str(question):
            return FakeReply.error(502, f"<html>upstream says: your key {sent} is bad</html>")
        return self.echo(body)


@pytest.fixture
def leaky_model() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer(model="leaky").start()
    server.set_handler(LeakyModel(server))
    try:
        yield server
    finally:
        server.stop()


class Production:
    """``python -m app.cli serve`` (the ``agentstream serve`` of the Dockerfile) in a subprocess."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = cwd / "service.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                cwd=cwd,
                env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_healthy(self.base_url, self._alive)

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the service exited:\n{self.log_path.read_text(errors='replace')}")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.log_path.read_text(errors="replace")


def drive(base_url: str) -> list[str]:
    """Runs that succeed and fail, wrong keys, the stream by token; returns every body received."""
    seen: list[str] = []

    def keep(response: httpx.Response) -> httpx.Response:
        seen.append(f"{response.status_code} {response.headers} {response.text}")
        return response

    alice = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {ALICE_KEY}"}, timeout=30)
    bob = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {BOB_KEY}"}, timeout=30)
    anonymous = httpx.Client(base_url=base_url, timeout=30)
    try:
        conversation = keep(alice.post("/api/conversations", json={"title": "secrets"})).json()["id"]
        stream = f"/api/conversations/{conversation}/stream"
        run_ids = []
        for question in ("What is 2+2?", "fail 401", "fail 403", "fail 429", "fail 500", "fail plain"):
            started = keep(alice.post(f"/api/conversations/{conversation}/runs", json={"message": question}))
            assert started.status_code == 202, started.text
            run_ids.append(started.json()["run_id"])
            # The browser's way: the key in the query string, so in the request line.
            with anonymous.stream("GET", stream, params={"access_token": ALICE_KEY}) as response:
                response.read()
                keep(response)
            assert '"event"' not in response.text and "event: done" in response.text
        for run_id in run_ids:
            keep(alice.get(f"/api/runs/{run_id}"))
            keep(alice.get(f"/api/runs/{run_id}/events"))
        keep(alice.get(f"/api/conversations/{conversation}"))
        failed = [r for r in (alice.get(f"/api/runs/{i}").json() for i in run_ids) if r["status"] == "failed"]
        assert len(failed) == 5, "the failing model did not fail the runs"
        for question in ("What is 3+3?", "fail 401", "fail plain"):
            body = {"model": "m", "messages": [{"role": "user", "content": question}]}
            keep(alice.post("/v1/chat/completions", json=body))
            with alice.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                response.read()
                keep(response)
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {WRONG_KEY}"}) as wrong:
            assert keep(wrong.get("/api/conversations")).status_code == 401
            assert (
                keep(wrong.post("/v1/chat/completions", json={"model": "m", "messages": []})).status_code
                == 401
            )
        assert keep(anonymous.get(stream, params={"access_token": WRONG_KEY})).status_code == 401
        assert keep(bob.get(stream, params={"access_token": ALICE_KEY})).status_code == 404
        assert keep(alice.get("/api/chat")).status_code == 405
        keep(anonymous.get("/metrics"))
        keep(anonymous.get("/readyz"))
    finally:
        for client in (alice, bob, anonymous):
            client.close()
    return seen


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_no_secret_reaches_a_log_an_event_or_a_response(
    log_format: str, leaky_model: FakeOpenAIServer, tmp_path: Path
) -> None:
    env = {
        "API_KEYS": f"alice:{ALICE_KEY},bob:{BOB_KEY}",
        "LLM_API_KEY": LLM_KEY,
        "LLM_BASE_URL": leaky_model.base_url,
        "LLM_MODEL": "leaky",
        "LLM_MAX_RETRIES": "1",
        "DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'agentstream.db'}",
        "LOG_FORMAT": log_format,
        "LOG_LEVEL": "DEBUG",
        "SHUTDOWN_GRACE_S": "2",
    }
    service = Production(env, tmp_path)
    try:
        seen = drive(service.base_url)
    finally:
        log = service.stop()

    assert any(f"Bearer {LLM_KEY}" == r.headers.get("authorization") for r in leaky_model.received)
    assert "run finished" in log and "GET /api/conversations/" in log, log[-2000:]
    assert "stream?access_token=[redacted]" in log  # the access log has the request, without its key
    if log_format == "json":
        lines = [line for line in log.splitlines() if line.startswith("{")]
        assert lines and all(json.loads(line)["msg"] for line in lines)
    everything = "\n".join([log, *seen])
    leaked = {secret: everything.count(secret) for secret in SECRETS if secret in everything}
    context = {s: everything[max(0, everything.find(s) - 300) : everything.find(s) + 100] for s in leaked}
    assert not leaked, context
