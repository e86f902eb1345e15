"""The harness for driving the service with the real Node clients works, without the service.

tests/node/cases/harness_selftest.mjs checks that the installed `ai` and `@ag-ui/*` are the pinned
versions, folds hand-written UI message chunks with the AI SDK (alone, through DefaultChatTransport
and in a Chat), and runs AG-UI's HttpAgent on hand-written SSE bodies through a fake fetch. And
ag_ui_validate, used from Python, finds a tiny valid stream clean and an invalid one wrong.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from ag_ui_validate.pytest_plugin import assert_valid_agui, validate_agui

from tests.support.node import NODE_DIR, run_node

pytestmark = pytest.mark.slow

PINS = {"ai": "7.0.173", "@ag-ui/client": "1.0.0", "@ag-ui/core": "1.0.0", "@a2a-js/sdk": "1.3.0"}


@pytest.fixture(scope="module")
def selftest() -> Any:
    return run_node("harness_selftest.mjs", {}, timeout=60)


def test_package_json_pins_exact_versions() -> None:
    package = json.loads((NODE_DIR / "package.json").read_text())
    assert package["private"] is True
    assert package["type"] == "module"
    assert package["dependencies"] == PINS
    lock = json.loads((NODE_DIR / "package-lock.json").read_text())
    assert lock["packages"][""]["dependencies"] == PINS
    for name, version in PINS.items():
        assert lock["packages"][f"node_modules/{name}"]["version"] == version


def test_installed_clients_are_the_pinned_ones(selftest: Any) -> None:
    assert selftest["pins"] == PINS
    assert selftest["installed"] == PINS


def test_ai_sdk_folds_a_ui_message_stream(selftest: Any) -> None:
    folded = selftest["aisdk"]["fold"]
    assert folded["message"] == {
        "id": "msg-1",
        "role": "assistant",
        "parts": [{"type": "text", "text": "Hello, world", "state": "done"}],
    }
    assert folded["chunkTypes"] == ["start", "text-start", "text-delta", "text-delta", "text-end", "finish"]


def test_ai_sdk_transport_and_chat_read_a_response(selftest: Any) -> None:
    got = selftest["aisdk"]["transport"]
    assistant = {
        "id": "msg-2",
        "role": "assistant",
        "parts": [{"type": "text", "text": "ok", "state": "done"}],
    }
    user = {"id": "id-1", "role": "user", "parts": [{"type": "text", "text": "Hi"}]}
    assert got["readOne"] == {"message": assistant, "chunkCount": 5}
    assert got["chat"] == {"status": "ready", "error": None, "messages": [user, assistant]}
    assert got["requests"] == [
        {
            "url": "http://agentstream.invalid/chat",
            "body": {"id": "chat-1", "messages": [], "trigger": "submit-message"},
        },
        {
            "url": "http://agentstream.invalid/chat",
            "body": {"id": "chat-2", "messages": [user], "trigger": "submit-message"},
        },
    ]


def test_agui_http_agent_reads_an_sse_body(selftest: Any) -> None:
    ok = selftest["agui"]["ok"]
    user = {"id": "u1", "role": "user", "content": "Hello"}
    reply = {"id": "m1", "role": "assistant", "content": "Hi there"}
    assert ok["warnings"] == []
    assert ok["messages"] == [user, reply]
    assert ok["request"] == {
        "url": "http://agentstream.invalid/agui",
        "method": "POST",
        "threadId": "thread-1",
        "runId": "run-1",
        "messages": [user],
    }
    run = ok["run"]
    assert run["events"] == [
        {"type": "RUN_STARTED", "threadId": "thread-1", "runId": "run-1"},
        {"type": "TEXT_MESSAGE_START", "messageId": "m1", "role": "assistant"},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "Hi there"},
        {"type": "TEXT_MESSAGE_END", "messageId": "m1"},
        {"type": "RUN_FINISHED", "threadId": "thread-1", "runId": "run-1"},
    ]
    assert run["outcome"] == "success"
    assert run["newMessages"] == [reply]
    assert (run["interrupts"], run["pendingToolCallIds"], run["result"]) == ([], [], None)
    assert (run["runErrors"], run["failures"], run["consoleErrors"]) == ([], [], [])


def test_agui_recorder_reports_verifier_failures_and_warnings(selftest: Any) -> None:
    verifier = selftest["agui"]["verifier"]
    assert verifier == {
        "eventTypes": [],
        "outcome": None,
        "failures": [{"class": "AGUIError", "name": "Error", "message": "First event must be 'RUN_STARTED'"}],
        "failureLogged": True,
        "warnings": [],
    }
    stripped = selftest["agui"]["stripped"]
    assert stripped["eventTypes"] == ["RUN_STARTED", "RUN_FINISHED"]
    assert (stripped["outcome"], stripped["failures"]) == ("success", [])
    assert len(stripped["warnings"]) == 1
    assert stripped["warnings"][0].startswith("[ag-ui][enforce] Removed unrecognised material at '/extra'")


VALID = [
    {"type": "RUN_STARTED", "threadId": "t1", "runId": "r1", "timestamp": 1},
    {"type": "TEXT_MESSAGE_START", "messageId": "m1", "role": "assistant", "timestamp": 2},
    {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "Hi", "timestamp": 3},
    {"type": "TEXT_MESSAGE_END", "messageId": "m1", "timestamp": 4},
    {"type": "RUN_FINISHED", "threadId": "t1", "runId": "r1", "timestamp": 5},
]


def test_ag_ui_validate_finds_a_valid_stream_clean() -> None:
    report = validate_agui(VALID)
    assert (report.summary.errors, report.summary.warnings, report.summary.info) == (0, 0, 0)
    assert report.diagnostics == []
    assert report.internal_errors == []
    assert report.event_count == len(VALID)
    assert_valid_agui(VALID, max_warnings=0)


def test_ag_ui_validate_reports_a_stream_not_opened_by_run_started() -> None:
    invalid = VALID[1:]
    report = validate_agui(invalid)
    assert report.summary.errors >= 1
    first = report.diagnostics[0]
    assert (first.rule, first.severity, first.event_index) == ("AGUI001", "error", 0)
    with pytest.raises(AssertionError, match="AGUI001"):
        assert_valid_agui(invalid, max_warnings=0)


def test_ag_ui_validate_counts_warnings_only_when_told() -> None:
    empty_delta = [*VALID[:3], {**VALID[2], "delta": "", "timestamp": 3.5}, *VALID[3:]]
    report = validate_agui(empty_delta)
    assert (report.summary.errors, report.summary.warnings) == (0, 1)
    assert [d.rule for d in report.diagnostics] == ["AGUI105"]
    assert_valid_agui(empty_delta)  # errors only
    with pytest.raises(AssertionError, match="AGUI105"):
        assert_valid_agui(empty_delta, max_warnings=0)
