"""``agentstream approvals`` / ``approve`` / ``deny`` (RUNS.md A-07) end to end: the CLI against a real
uvicorn process whose demo model's calculator calls need approval, while ``agentstream chat``
follows the waiting run in another process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.test_cli import KEY, Server, api, cli, serve
from tests.support.server import ROOT, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serve(tmp_path_factory.mktemp("cli-approvals"), REQUIRE_APPROVAL="calculator")


def chat_in_background(server: Server, question: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONIOENCODING": "utf-8",
        "AGENTSTREAM_URL": server.base_url,
        "AGENTSTREAM_KEY": KEY,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", "chat", question],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def pending(server: Server) -> list[dict[str, Any]]:
    result = cli(server, "approvals", "--json")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def finish(chat: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = chat.communicate(timeout=60)
    return chat.returncode, out + err


def test_chat_shows_the_waiting_call_and_approve_from_a_shell_carries_the_run_on(server: Server) -> None:
    chat = chat_in_background(server, "What is 17*23?")
    try:
        (item,) = wait_until(lambda: pending(server), timeout=30, what="the approval")
        assert item["tool_name"] == "calculator"
        listed = cli(server, "approvals")
        assert item["approval_id"] in listed.stdout and "calculator" in listed.stdout

        approved = cli(server, "approve", item["approval_id"])

        assert approved.returncode == 0, approved.stderr
        assert approved.stdout.startswith("approved: ")
        code, output = finish(chat)
    finally:
        if chat.poll() is None:
            chat.kill()
    assert code == 0, output
    assert "waiting for approval: calculator" in output
    assert f"agentstream approve {item['approval_id']}" in output
    assert "✓ approved" in output and "391" in output
    again = cli(server, "approve", item["approval_id"])
    assert again.returncode != 0 and "no pending approval" in again.stderr


def test_deny_with_a_reason_and_approve_with_edited_arguments(server: Server) -> None:
    chat = chat_in_background(server, "What is 17*23?")
    try:
        (item,) = wait_until(lambda: pending(server), timeout=30, what="the approval")
        bad = cli(server, "approve", item["approval_id"], "--args", "[1]")
        assert bad.returncode != 0 and "JSON object" in bad.stderr
        refused = cli(server, "approve", item["approval_id"], "--args", '{"expression": 5}')
        assert refused.returncode != 0 and "parameters" in refused.stderr

        denied = cli(server, "deny", item["approval_id"], "--reason", "do it in your head")

        assert denied.returncode == 0, denied.stderr
        code, output = finish(chat)
    finally:
        if chat.poll() is None:
            chat.kill()
    assert code == 0, output
    assert "✗ denied: do it in your head" in output
    run = api(server, f"/api/runs/{item['run_id']}")
    assert run["status"] == "completed" and run["pending_approvals"] == []

    second = chat_in_background(server, "What is 17*23?")
    try:
        (item2,) = wait_until(lambda: pending(server), timeout=30, what="the second approval")
        edited = cli(server, "approve", item2["approval_id"], "--args", '{"expression": "2+2"}')
        assert edited.returncode == 0, edited.stderr
        code, output = finish(second)
    finally:
        if second.poll() is None:
            second.kill()
    assert code == 0, output
    assert "2+2 = 4" in output
