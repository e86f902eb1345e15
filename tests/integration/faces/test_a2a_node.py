"""The A2A face (FACES.md N-08) driven by A2A's official JS client, ``@a2a-js/sdk`` in Node
(``tests/node/cases/a2a_client.mjs``), against a started service on the fake model: a streamed task
to COMPLETED with its artifact (JSON-RPC and HTTP+JSON), an approval then the decision as a
message, a resubscription after the connection is cut, cancel, a follow-up on a working task, and
the errors of A2A 5.4.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.integration.faces.a2a_support import KEYS
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    FakeLLM,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import EchoAgentBehaviour, ToolAgentBehaviour
from tests.support.node import require_node, run_node
from tests.support.server import ServerThread, wait_until

pytestmark = pytest.mark.timeout(60)

APPROVING = {"mode": "json", "tools": ["calculator"], "require_approval": ["calculator"]}


@pytest.fixture
def service(start_service: Callable[..., ServerThread]) -> ServerThread:
    require_node()
    return start_service(redis=False, api_keys=KEYS)


def drive(service: ServerThread, scenario: str, **env: Any) -> dict[str, Any]:
    variables = {"AGENTSTREAM_BASE": service.base_url, "AGENTSTREAM_KEY": "key-alice", "SCENARIO": scenario}
    variables.update({k: json.dumps(v) if k == "AGENT" else str(v) for k, v in env.items()})
    result: dict[str, Any] = run_node("a2a_client.mjs", variables, timeout=50)
    return result


def in_background(fn: Callable[[], dict[str, Any]]) -> Future[dict[str, Any]]:
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
def test_a_streamed_task_completes_with_its_artifact(
    service: ServerThread, gated_llm: FakeLLM, binding: str
) -> None:
    gated_llm.agent.inner = EchoAgentBehaviour(12, delay_s=0.02)
    result = drive(service, "stream", BINDING=binding)
    assert result["kinds"][0] == "task"
    assert result["states"][-1] == "TASK_STATE_COMPLETED"
    assert set(result["states"][:-1]) <= {"TASK_STATE_SUBMITTED", "TASK_STATE_WORKING"}
    assert result["answer"] == gated_llm.agent.answer and result["lastChunks"] == 1
    assert result["get"] == {"state": "TASK_STATE_COMPLETED", "answer": gated_llm.agent.answer}
    assert result["listed"] == [{"id": result["taskId"], "answer": gated_llm.agent.answer}]


def test_an_approval_then_the_decision_as_a_message(service: ServerThread, gated_llm: FakeLLM) -> None:
    gated_llm.agent.inner = ToolAgentBehaviour("calculator", {"expression": "6*7"})
    result = drive(service, "approval", AGENT=APPROVING)
    assert result["first"]["states"][-1] == "TASK_STATE_INPUT_REQUIRED"
    (asked,) = result["asked"]
    assert asked["tool_name"] == "calculator" and asked["approval_id"]
    assert result["sameTask"] and result["rest"]["states"][-1] == "TASK_STATE_COMPLETED"
    assert result["rest"]["answer"] == gated_llm.agent.answer


def test_a_resubscribe_after_the_connection_is_cut(
    service: ServerThread, gated_llm: FakeLLM, tmp_path: Path
) -> None:
    agent = gated_llm.agent
    agent.close_gate()
    marker = tmp_path / "ready"
    future = in_background(lambda: drive(service, "resubscribe", MARKER=marker))
    wait_until(lambda: marker.exists() or future.done(), 30)
    agent.gate.set()
    result = future.result(timeout=40)
    # Not ended yet when the connection was cut (SUBMITTED while its first step has not begun).
    assert result["snapshotState"] in ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING")
    assert result["states"][-1] == "TASK_STATE_COMPLETED"
    assert result["answer"] == agent.answer and result["lastChunks"] == 1


def test_cancel(service: ServerThread, gated_llm: FakeLLM) -> None:
    gated_llm.agent.close_gate()
    result = drive(service, "cancel")
    assert result["sent"] in ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING")
    assert result["cancelled"] == "TASK_STATE_CANCELED"
    assert result["again"] == "JsonRpcTaskNotCancelableError"  # the binding's class of TaskNotCancelable


def test_a_follow_up_on_a_working_task(service: ServerThread, gated_llm: FakeLLM, tmp_path: Path) -> None:
    agent = gated_llm.agent
    agent.close_gate()
    marker = tmp_path / "ready"
    future = in_background(lambda: drive(service, "follow-up", MARKER=marker))
    wait_until(lambda: marker.exists() or future.done(), 30)
    agent.gate.set()
    result = future.result(timeout=40)
    # The follow-up may come before the run's first step (SUBMITTED) or after (WORKING).
    assert result["snapshotTask"] and result["states"][0] in ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING")
    assert result["states"][-1] == "TASK_STATE_COMPLETED" and result["followUpTakenIn"]
    assert agent.saw("and in hex, please")


def test_the_errors_of_a2a_5_4(service: ServerThread) -> None:
    result = drive(service, "errors")
    assert result == {
        "unknownTask": "JsonRpcTaskNotFoundError",
        "terminalMessage": "JsonRpcUnsupportedOperationError",
        "terminalSubscribe": "JsonRpcUnsupportedOperationError",
        "terminalCancel": "JsonRpcTaskNotCancelableError",
        "badVersion": -32009,
    }
