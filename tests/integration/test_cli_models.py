"""``agentstream models`` and ``agentstream chat --model`` (issue 16) end to end: the CLI as a process
against the real service (in a thread here) serving two models, each a fake provider of its own.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from tests.integration.test_cli import KEY, Server, api, cli, conversation_of, json_events
from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.server import ServerThread

pytestmark = pytest.mark.slow

KEY_A = "sk-cli-model-a-SECRET-3e9d"
KEY_B = "sk-cli-model-b-SECRET-7a21"
ANSWER_A = ["Model ", "A ", "answers."]
ANSWER_B = ["Model ", "B ", "answers."]


@dataclass(frozen=True)
class TwoModels:
    server: Server
    a: FakeOpenAIServer
    b: FakeOpenAIServer


@pytest.fixture(scope="module")
def two_models(
    sqlite_migrated_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoModels]:
    """The service with models ``a`` (the default) and ``b``, each on a fake provider of its own."""
    path = tmp_path_factory.mktemp("cli-models") / "agentstream.db"
    shutil.copyfile(sqlite_migrated_template, path)
    with FakeOpenAIServer() as a, FakeOpenAIServer() as b:
        a.set_handler(EchoAgentBehaviour(ANSWER_A))
        b.set_handler(EchoAgentBehaviour(ANSWER_B))
        models = [
            {"name": "a", "base_url": a.base_url, "api_key": KEY_A, "model": "provider-a", "max_retries": 0},
            {"name": "b", "base_url": b.base_url, "api_key": KEY_B, "model": "provider-b", "max_retries": 0},
        ]
        values: dict[str, Any] = {
            "database_url": f"sqlite+aiosqlite:///{path}",
            "api_keys": f"alice:{KEY}",
            "llm_models": json.dumps(models),
            "shutdown_grace_s": 0,
            "log_level": "WARNING",
        }
        settings = Settings(_env_file=None, **values)  # type: ignore[call-arg]
        service = ServerThread(settings).start()
        try:
            yield TwoModels(Server(service.base_url), a, b)
        finally:
            service.stop()


def conversations(server: Server) -> list[str]:
    return [c["id"] for c in api(server, "/api/conversations")["items"]]


def test_models_lists_each_name_with_its_provider_model_and_marks_the_default(two_models: TwoModels) -> None:
    result = cli(two_models.server, "models")

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "a  provider-a  tool_call,json_mode,streaming  (default)",
        "b  provider-b  tool_call,json_mode,streaming",
    ]
    assert "SECRET" not in result.stdout + result.stderr


def test_models_json_prints_what_the_service_lists(two_models: TwoModels) -> None:
    result = cli(two_models.server, "models", "--json")

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == api(two_models.server, "/api/models")


def test_chat_with_model_b_makes_a_conversation_whose_run_goes_to_b(two_models: TwoModels) -> None:
    a_before, b_before = len(two_models.a.requests), len(two_models.b.requests)

    result = cli(two_models.server, "chat", "What is 17*23?", "--model", "b", "--json")

    assert result.returncode == 0, result.stderr
    conversation = conversation_of(result.stderr)
    done = json_events(result.stdout)[-1]
    assert done["event"] == "done"
    assert (done["data"]["status"], done["data"]["model"]) == ("completed", "b")
    assert done["data"]["answer"] == "".join(ANSWER_B)
    assert api(two_models.server, f"/api/conversations/{conversation}")["agent"]["model"] == "b"
    assert api(two_models.server, f"/api/runs/{done['data']['run_id']}")["model"] == "b"
    b_calls = len(two_models.b.requests) - b_before
    assert b_calls == done["data"]["usage"]["llm_calls"] > 0
    assert len(two_models.a.requests) == a_before


def test_chat_without_model_runs_on_the_default(two_models: TwoModels) -> None:
    b_before = len(two_models.b.requests)

    result = cli(two_models.server, "chat", "What is 2+2?", "--json")

    assert result.returncode == 0, result.stderr
    done = json_events(result.stdout)[-1]["data"]
    assert (done["model"], done["answer"]) == ("a", "".join(ANSWER_A))
    assert len(two_models.b.requests) == b_before


def test_chat_with_an_unknown_model_says_so_and_makes_no_conversation(two_models: TwoModels) -> None:
    before = conversations(two_models.server)
    calls = len(two_models.a.requests) + len(two_models.b.requests)

    result = cli(two_models.server, "chat", "What is 2+2?", "--model", "nope")

    assert result.returncode != 0
    assert "'nope'" in result.stderr and "Traceback" not in result.stderr
    assert conversations(two_models.server) == before
    assert len(two_models.a.requests) + len(two_models.b.requests) == calls
