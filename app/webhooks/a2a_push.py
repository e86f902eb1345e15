"""What an A2A push notification holds (FACES.md N-04, N-06): one ``StreamResponse`` a delivery,
built with the official ``a2a-sdk`` types, and the headers of the task's push config.

A run that starts waiting is ``TASK_STATE_INPUT_REQUIRED``, its status message carrying a data part
per approval it waits for (``{approval_id, tool_name, tool_args, expires_at}``) and per call of a
tool the client runs (``{call_id, tool_name, tool_args, expires_at}``); one that goes on after it
(a decision, a result, an expiry) is ``TASK_STATE_WORKING``. A run that ends is one status update
(``COMPLETED``, ``FAILED`` with the error, ``CANCELED``), a completed one preceded by its answer as
a finished artifact. Not every token: status changes and finished artifacts.

The A2A face (``app.api.faces.a2a``) owns the rest of the mapping; this module only builds the
notifications, from the run's row as committed with the change.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

import orjson
from a2a.helpers.proto_helpers import new_data_part, new_text_part
from a2a.types import (
    Artifact,
    Message,
    Part,
    Role,
    StreamResponse,
    TaskArtifactUpdateEvent,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from google.protobuf.json_format import MessageToDict
from sqlalchemy import Table, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.api.faces.a2a.translate import ANSWER_ARTIFACT, RUN_STATES
from app.api.faces.a2a.translate import FACE as A2A_FACE
from app.db.models import FaceThread, utcnow
from app.db.repositories.approvals import ApprovalRecord
from app.db.repositories.push_configs import PushConfigRecord
from app.db.repositories.rows import RunRecord

_threads: Table = FaceThread.__table__  # type: ignore[assignment]


async def context_id_of(session: AsyncSession, run: RunRecord) -> str:
    """The ``contextId`` the task's client knows its conversation by: the id it gave (``face_threads``),
    else the conversation's own id."""
    client_id = await session.scalar(
        select(_threads.c.client_id)
        .where(
            _threads.c.conversation_id == run.conversation_id,
            _threads.c.owner == run.owner,
            _threads.c.face == A2A_FACE,
        )
        .limit(1)
    )
    return str(client_id) if client_id is not None else run.conversation_id


def _waiting_parts(pending: Sequence[ApprovalRecord]) -> list[Part]:
    parts = []
    for item in pending:
        key = {"approval_id": item.id} if item.kind == "approval" else {"call_id": item.call_id}
        parts.append(
            new_data_part(
                {
                    **key,
                    "tool_name": item.tool_name,
                    "tool_args": item.tool_args,
                    "expires_at": item.expires_at.isoformat(),
                }
            )
        )
    return parts


def status_update(
    run: RunRecord, context_id: str, pending: Sequence[ApprovalRecord], at: datetime | None = None
) -> StreamResponse:
    """The task's status as the run's row says it, with what it waits for or why it failed."""
    if run.status == "waiting":
        parts = _waiting_parts(pending)
    elif run.status in ("failed", "cancelled") and run.error:
        parts = [new_text_part(run.error)]
    else:
        parts = []
    status = TaskStatus(state=RUN_STATES[run.status])
    status.timestamp.FromDatetime(at or run.finished_at or utcnow())
    if parts:
        status.message.CopyFrom(
            Message(
                message_id=str(uuid.uuid4()),
                role=Role.ROLE_AGENT,
                parts=parts,
                task_id=run.id,
                context_id=context_id,
            )
        )
    return StreamResponse(
        status_update=TaskStatusUpdateEvent(task_id=run.id, context_id=context_id, status=status)
    )


def answer_update(run: RunRecord, context_id: str) -> StreamResponse:
    """A completed task's answer, as its finished artifact."""
    return StreamResponse(
        artifact_update=TaskArtifactUpdateEvent(
            task_id=run.id,
            context_id=context_id,
            artifact=Artifact(
                artifact_id=ANSWER_ARTIFACT, name="answer", parts=[new_text_part(run.answer or "")]
            ),
            append=False,
            last_chunk=True,
        )
    )


def notifications(run: RunRecord, context_id: str, pending: Sequence[ApprovalRecord]) -> list[str]:
    """The JSON bodies a push config gets for the run's change, in order."""
    responses = []
    if run.status == "completed":
        responses.append(answer_update(run, context_id))
    at = utcnow() if run.status == "waiting" else None  # an ended run's time is its finished_at
    responses.append(status_update(run, context_id, pending, at=at))
    return [orjson.dumps(MessageToDict(r)).decode() for r in responses]


def push_headers(config: PushConfigRecord) -> dict[str, str]:
    """The headers a push config asks for, as the SDK's sender sends them: its ``token`` as
    ``X-A2A-Notification-Token``, its ``authentication`` as ``Authorization: <scheme> <credentials>``."""
    headers: dict[str, str] = {}
    if config.token:
        headers["X-A2A-Notification-Token"] = config.token
    auth = config.authentication or {}
    scheme, credentials = str(auth.get("scheme") or ""), str(auth.get("credentials") or "")
    if scheme and credentials:
        headers["Authorization"] = f"{scheme} {credentials}"
    return headers
