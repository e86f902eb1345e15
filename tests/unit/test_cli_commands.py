"""``agentstream`` subcommands through ``main()``: output, exit codes, error messages, settings."""

from __future__ import annotations

import functools
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.cli import commands, main
from app.cli.client import ApiClient

Handler = Callable[[httpx.Request], httpx.Response]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No .env of the developer and no variables of the shell may leak into these tests.
    monkeypatch.chdir(tmp_path)
    for name in ("AGENTSTREAM_URL", "AGENTSTREAM_KEY", "REDIS_URL", "DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Callable[[Handler], list[httpx.Request]]:
    """Route the CLI's HTTP calls to ``handler``; returns the list of requests it received."""

    def install(handler: Handler) -> list[httpx.Request]:
        seen: list[httpx.Request] = []

        def recording(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return handler(request)

        monkeypatch.setattr(
            commands, "ApiClient", functools.partial(ApiClient, transport=httpx.MockTransport(recording))
        )
        return seen

    return install


def error(status: int, code: str, message: str) -> Handler:
    return lambda request: httpx.Response(status, json={"error": {"code": code, "message": message}})


def test_interrupt_prints_the_queued_count(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    seen = served(lambda request: httpx.Response(202, json={"queued": 2}))
    assert main(["interrupt", "c1", "also check 18*23"]) == 0
    assert seen[0].method == "POST"
    assert seen[0].url.path == "/api/conversations/c1/interrupt"
    assert json.loads(seen[0].content) == {"content": "also check 18*23"}
    assert capsys.readouterr().out == "queued for the running agent (2 waiting)\n"


def test_interrupt_without_an_active_run_explains_and_exits_1(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    served(error(409, "no_active_run", "no run is active"))
    assert main(["interrupt", "c1", "hello"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(
        "error: no run is active in conversation c1, so there is nothing to interrupt"
    )
    assert "Traceback" not in captured.err


def test_cancel_requests_the_stop(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    seen = served(lambda request: httpx.Response(202, json={}))
    assert main(["cancel", "c1"]) == 0
    assert seen[0].url.path == "/api/conversations/c1/cancel"
    assert capsys.readouterr().out == "cancel requested for conversation c1\n"


def test_cancel_without_an_active_run_exits_1(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    served(error(409, "no_active_run", "no run is active"))
    assert main(["cancel", "c1"]) == 1
    assert "nothing to cancel" in capsys.readouterr().err


def test_server_error_body_is_printed_as_one_line_with_exit_1(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    served(error(404, "not_found", "run not found"))
    assert main(["runs", "nope"]) == 1
    assert capsys.readouterr().err == "error: run not found (not_found, HTTP 404)\n"


def test_framework_validation_errors_are_summarised(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    detail = [{"loc": ["body", "content"], "msg": "String should have at least 1 character"}]
    served(lambda request: httpx.Response(422, json={"detail": detail}))
    assert main(["interrupt", "c1", ""]) == 1
    assert capsys.readouterr().err == (
        "error: content: String should have at least 1 character (http_422, HTTP 422)\n"
    )


def test_ids_are_sent_as_single_path_segments(served: Any) -> None:
    seen = served(lambda request: httpx.Response(202, json={}))
    main(["cancel", "a/b?c"])
    assert seen[0].url.raw_path == b"/api/conversations/a%2Fb%3Fc/cancel"


RUN = {
    "run_id": "r1",
    "conversation_id": "c1",
    "status": "completed",
    "answer": "17*23 = 391",
    "iterations": 1,
    "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120, "llm_calls": 3},
    "elapsed": 0.25,
    "error": None,
    "created_at": "2025-01-01T00:00:00Z",
    "finished_at": "2025-01-01T00:00:01Z",
}


def test_runs_prints_the_run_as_aligned_fields_with_the_answer_last(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = served(lambda request: httpx.Response(200, json=RUN))
    assert main(["runs", "r1"]) == 0
    assert seen[0].url.path == "/api/runs/r1"
    assert capsys.readouterr().out == (
        "run          r1\n"
        "conversation c1\n"
        "status       completed\n"
        "iterations   1\n"
        "tokens       120 (100 in, 20 out) in 3 LLM calls\n"
        "elapsed      0.25s\n"
        "created      2025-01-01T00:00:00Z\n"
        "finished     2025-01-01T00:00:01Z\n"
        "\n"
        "17*23 = 391\n"
    )


def test_runs_json_prints_the_record_unchanged(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    served(lambda request: httpx.Response(200, json=RUN))
    assert main(["runs", "r1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == RUN


STORED_EVENTS = [
    {
        "id": "1-0",
        "event": "step",
        "data": {
            "run_id": "r1",
            "type": "iteration",
            "status": "start",
            "iteration": 1,
            "tool_name": "calculator",
            "tool_args": {"expression": "2+2"},
        },
    },
    {"id": "1-1", "event": "answer", "data": '{"run_id": "r1", "status": "delta", "content": "4"}'},
]


def test_runs_events_renders_the_stored_events(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    seen = served(lambda request: httpx.Response(200, json=STORED_EVENTS))
    assert main(["runs", "r1", "--events"]) == 0
    assert seen[0].url.path == "/api/runs/r1/events"
    assert capsys.readouterr().out == '→ calculator {"expression": "2+2"}\n4\n'


def test_runs_events_json_prints_one_line_per_stored_event(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    served(lambda request: httpx.Response(200, json=STORED_EVENTS))
    assert main(["runs", "r1", "--events", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["id"], line["event"]) for line in lines] == [("1-0", "step"), ("1-1", "answer")]
    assert lines[1]["data"] == {"run_id": "r1", "status": "delta", "content": "4"}


def test_conversations_lists_items_and_how_to_get_more(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    page = {
        "items": [
            {"id": "c2", "title": "Math", "created_at": "2025-01-02", "active_run_id": "r9"},
            {"id": "c1", "title": None, "created_at": "2025-01-01", "active_run_id": None},
        ],
        "next_cursor": "abc",
    }
    seen = served(lambda request: httpx.Response(200, json=page))
    assert main(["conversations", "--limit", "2"]) == 0
    assert seen[0].url.params["limit"] == "2"
    assert capsys.readouterr().out == (
        "c2  2025-01-02  Math  [running r9]\n"
        "c1  2025-01-01  (untitled)\n"
        "more: agentstream conversations --cursor abc\n"
    )


def test_conversations_when_there_are_none(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    served(lambda request: httpx.Response(200, json={"items": [], "next_cursor": None}))
    assert main(["conversations"]) == 0
    assert capsys.readouterr().out == "no conversations\n"


def test_url_and_key_come_from_the_environment_and_flags_override_them(
    served: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = served(error(500, "internal", "boom"))
    monkeypatch.setenv("AGENTSTREAM_URL", "http://from-env:9000")
    monkeypatch.setenv("AGENTSTREAM_KEY", "env-secret")
    main(["cancel", "c1"])
    main(["cancel", "c1", "--url", "http://from-flag:9001", "--key", "flag-secret"])
    assert [str(r.url) for r in seen] == [
        "http://from-env:9000/api/conversations/c1/cancel",
        "http://from-flag:9001/api/conversations/c1/cancel",
    ]
    assert [r.headers["authorization"] for r in seen] == ["Bearer env-secret", "Bearer flag-secret"]
    captured = capsys.readouterr()
    assert "secret" not in captured.out + captured.err


def test_without_url_or_key_the_default_local_server_is_called_without_auth(served: Any) -> None:
    seen = served(lambda request: httpx.Response(202, json={}))
    main(["cancel", "c1"])
    assert str(seen[0].url) == "http://127.0.0.1:8000/api/conversations/c1/cancel"
    assert "authorization" not in seen[0].headers


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_connection_refused_says_the_server_is_not_running(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    assert main(["chat", "hi", "--url", url, "--key", "k-secret"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: cannot connect to the AgentStream server at {url} (connection refused); "
        "is it running? Start one with `agentstream serve`.\n"
    )


def test_url_without_a_scheme_is_rejected_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conversations", "--url", "localhost:8000"]) == 1
    assert "invalid server URL 'localhost:8000'" in capsys.readouterr().err


@pytest.fixture
def uvicorn_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    import uvicorn

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: calls.append((args, kwargs)))
    return calls


def test_serve_runs_uvicorn_on_the_app_factory(
    uvicorn_calls: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--port", "9123"]) == 0
    assert uvicorn_calls == [
        (
            ("app.main:create_app",),
            {"factory": True, "host": "127.0.0.1", "port": 9123, "workers": 1, "reload": False},
        )
    ]
    assert capsys.readouterr().err == ""


def test_serve_with_several_workers_and_no_redis_warns(
    uvicorn_calls: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--workers", "3"]) == 0
    assert uvicorn_calls[0][1]["workers"] == 3
    assert capsys.readouterr().err.startswith("warning: 3 workers without REDIS_URL")


def test_serve_with_several_workers_and_redis_does_not_warn(
    uvicorn_calls: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
    assert main(["serve", "--workers", "2"]) == 0
    assert capsys.readouterr().err == ""


def test_serve_reads_redis_url_from_a_dot_env_file(
    uvicorn_calls: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / ".env").write_text("REDIS_URL=redis://127.0.0.1:6379/0\n")
    assert main(["serve", "--workers", "2"]) == 0
    assert capsys.readouterr().err == ""


def test_serve_refuses_reload_with_several_workers(
    uvicorn_calls: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--reload", "--workers", "2"]) == 1
    assert uvicorn_calls == []
    assert "--reload runs a single process" in capsys.readouterr().err


def test_serve_rejects_zero_workers(uvicorn_calls: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--workers", "0"])
    assert exited.value.code == 2
    assert "must be 1 or more" in capsys.readouterr().err


@pytest.fixture
def migrations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import app.db.migrate

    urls: list[str] = []
    monkeypatch.setattr(app.db.migrate, "upgrade_database", urls.append)
    return urls


def test_migrate_upgrades_the_configured_database(
    migrations: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql+asyncpg://app:pw-secret@db:5432/agentstream")
    assert main(["migrate"]) == 0
    assert migrations == ["postgresql+asyncpg://app:pw-secret@db:5432/agentstream"]
    out = capsys.readouterr().out
    assert out == "database is up to date: postgresql+asyncpg://app:***@db:5432/agentstream\n"


def test_migrate_url_flag_wins(migrations: list[str]) -> None:
    assert main(["migrate", "--url", "sqlite+aiosqlite:///x.db"]) == 0
    assert migrations == ["sqlite+aiosqlite:///x.db"]


def test_migrate_failure_is_one_line_without_the_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import app.db.migrate

    def fail(url: str) -> None:
        raise OSError("could not connect")

    monkeypatch.setattr(app.db.migrate, "upgrade_database", fail)
    assert main(["migrate", "--url", "postgresql+asyncpg://u:pw-secret@db/x"]) == 1
    assert capsys.readouterr().err == (
        "error: migrating postgresql+asyncpg://u:***@db/x failed: OSError: could not connect\n"
    )
