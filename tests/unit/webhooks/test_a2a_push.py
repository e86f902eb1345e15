"""A2A push notifications (FACES.md N-04, N-06): each body parses as an a2a-sdk ``StreamResponse``
with the task's state, and the push config's credentials go where the SDK's own sender puts them."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import orjson
import pytest
from a2a.types import StreamResponse, TaskState
from google.protobuf.json_format import ParseDict

from app.db.repositories.approvals import ApprovalRecord
from app.db.repositories.push_configs import PushConfigRecord
from app.db.repositories.rows import RunRecord
from app.webhooks.a2a_push import notifications, push_headers

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
RUN = RunRecord(
    id="run_1",
    conversation_id="conv_1",
    owner="alice",
    status="running",
    message="q",
    answer=None,
    iterations=1,
    usage={},
    elapsed=None,
    error=None,
    pending_injections=[],
    start_cursor="0-0",
    worker_id=None,
    lease_expires_at=None,
    created_at=NOW,
    finished_at=None,
)


def parsed(body: str) -> StreamResponse:
    return ParseDict(orjson.loads(body), StreamResponse())


@pytest.mark.parametrize(
    ("status", "state"),
    [
        ("queued", TaskState.TASK_STATE_SUBMITTED),
        ("running", TaskState.TASK_STATE_WORKING),
        ("waiting", TaskState.TASK_STATE_INPUT_REQUIRED),
        ("completed", TaskState.TASK_STATE_COMPLETED),
        ("failed", TaskState.TASK_STATE_FAILED),
        ("cancelled", TaskState.TASK_STATE_CANCELED),
    ],
)
def test_each_run_status_is_its_task_state(status: str, state: int) -> None:
    run = replace(RUN, status=status, answer="4", finished_at=NOW)

    last = parsed(notifications(run, "ctx-1", [])[-1])

    assert last.WhichOneof("payload") == "status_update"
    assert (last.status_update.task_id, last.status_update.context_id) == ("run_1", "ctx-1")
    assert last.status_update.status.state == state


def test_a_completed_task_sends_its_answer_as_a_finished_artifact_first() -> None:
    answer, status = notifications(
        replace(RUN, status="completed", answer="It is 42.", finished_at=NOW), "c", []
    )

    artifact = parsed(answer).artifact_update
    assert [p.text for p in artifact.artifact.parts] == ["It is 42."]
    assert artifact.last_chunk and not artifact.append
    assert parsed(status).status_update.status.timestamp.ToDatetime(UTC) == NOW


def test_a_waiting_task_says_what_it_waits_for_and_a_failed_one_why() -> None:
    approval = ApprovalRecord(
        "apr_1",
        "run_1",
        "conv_1",
        "alice",
        "call_1",
        "calculator",
        {"expression": "6*7"},
        1,
        "pending",
        None,
        None,
        None,
        NOW,
        NOW,
        None,
    )
    call = replace(
        approval, id="apr_2", call_id="call_2", tool_name="pick_color", kind="client", tool_args={}
    )

    (waiting,) = notifications(replace(RUN, status="waiting"), "c", [approval, call])
    (failed,) = notifications(
        replace(RUN, status="failed", error="the model is down", finished_at=NOW), "c", []
    )

    message = parsed(waiting).status_update.status.message
    assert message.role == 2 and message.task_id == "run_1"  # ROLE_AGENT
    parts = orjson.loads(waiting)["statusUpdate"]["status"]["message"]["parts"]
    assert [p["data"] for p in parts] == [
        {
            "approval_id": "apr_1",
            "tool_name": "calculator",
            "tool_args": {"expression": "6*7"},
            "expires_at": NOW.isoformat(),
        },
        {"call_id": "call_2", "tool_name": "pick_color", "tool_args": {}, "expires_at": NOW.isoformat()},
    ]
    assert [p.text for p in parsed(failed).status_update.status.message.parts] == ["the model is down"]


def test_push_headers_are_the_token_and_the_authentication_of_the_config() -> None:
    config = PushConfigRecord("run_1", "alice", "c", "https://x.example/p", None, None, NOW)

    assert push_headers(config) == {}
    assert push_headers(replace(config, token="t0k")) == {"X-A2A-Notification-Token": "t0k"}
    assert push_headers(replace(config, authentication={"scheme": "Bearer", "credentials": "abc"})) == {
        "Authorization": "Bearer abc"
    }
    # A scheme without credentials sends no Authorization (as the SDK's sender).
    assert push_headers(replace(config, authentication={"scheme": "Bearer"})) == {}
