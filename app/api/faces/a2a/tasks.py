"""Tasks as the database holds them (FACES.md N-03): a task is a run, its context the conversation.

A conversation's ``contextId`` is the client's id for it where an A2A client named it (the
``a2a`` face threads), else the conversation's own id: a run started through the own API or
another face is a task too, in the context of its conversation. ``TaskStore`` reads what
``GetTask`` and ``ListTasks`` need in a few queries (a read model of the runs table: this face alone
lists an owner's runs across conversations).

A task's status timestamp is when its run finished, else when it was created: ``ListTasks`` sorts
by it (newest first) and pages with a cursor over it and the run's id.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from a2a.types.a2a_pb2 import Artifact, ListTasksRequest, Message, Role, Task, TaskState, TaskStatus
from a2a.utils.errors import InvalidParamsError
from sqlalchemy import Table, and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.api.faces.a2a.translate import (
    ANSWER_ARTIFACT,
    FACE,
    RUN_STATES,
    agent_message,
    approval_data,
    data_part,
    text_part,
)
from app.api.schemas import is_resource_id
from app.db.errors import InvalidCursorError
from app.db.models import FaceThread, Run, UTCDateTime
from app.db.repositories import RunRecord
from app.db.repositories.approvals import ApprovalRecord
from app.db.repositories.rows import _run_record, decode_page_cursor, encode_page_cursor

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 100

_threads: Table = FaceThread.__table__  # type: ignore[assignment]
_runs: Table = Run.__table__  # type: ignore[assignment]
_STATUS_TIME = func.coalesce(_runs.c.finished_at, _runs.c.created_at, type_=UTCDateTime())
_STATUSES_OF = {state: status for status, state in RUN_STATES.items()}
# Cursors and filters this service can have handed out or can take: outside these bounds a
# datetime would overflow a database's conversion.
_EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
_LATEST = datetime(9000, 1, 1, tzinfo=UTC)


def status_time(run: RunRecord) -> datetime:
    return run.finished_at or run.created_at


def question(run: RunRecord) -> Message:
    """The task's question, as the first message of its history."""
    return Message(
        message_id=f"{run.id}-question",
        task_id=run.id,
        role=Role.ROLE_USER,
        parts=[text_part(run.message)],
    )


def task_of(
    run: RunRecord,
    context_id: str,
    pending: Sequence[ApprovalRecord] = (),
    *,
    history_length: int | None = None,
) -> Task:
    """The task ``run`` is, from its record (and the approvals it waits for). A run that asked for
    an approval waits for a person from then on, though its row says ``running`` until it parks."""
    state = RUN_STATES[run.status]
    if run.status == "running" and pending:
        state = TaskState.TASK_STATE_INPUT_REQUIRED
    status = TaskStatus(state=state)
    status.timestamp.FromDatetime(status_time(run))
    message: Message | None = None
    if state == TaskState.TASK_STATE_INPUT_REQUIRED and pending:
        names = ", ".join(a.tool_name for a in pending)
        message = agent_message(
            f"{run.id}-waiting",
            run.id,
            context_id,
            [text_part(f"waiting for a person to approve {names}")]
            + [
                data_part(
                    approval_data(
                        {
                            "approval_id": a.id,
                            "tool_name": a.tool_name,
                            "tool_args": a.tool_args,
                            "expires_at": a.expires_at.isoformat(),
                        }
                    )
                )
                for a in pending
            ],
        )
    elif state == TaskState.TASK_STATE_FAILED:
        message = agent_message(
            f"{run.id}-failed", run.id, context_id, [text_part(run.error or "the run failed")]
        )
    if message is not None:
        status.message.CopyFrom(message)
    task = Task(id=run.id, context_id=context_id, status=status)
    if run.status == "completed":
        task.artifacts.append(
            Artifact(artifact_id=ANSWER_ARTIFACT, name="answer", parts=[text_part(run.answer or "")])
        )
    if history_length != 0:
        first = question(run)
        first.context_id = context_id
        task.history.append(first)
    return task


class TaskStore:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def context_ids(self, owner: str, conversation_ids: Sequence[str]) -> dict[str, str]:
        """The ``contextId`` of each conversation (the client's id for it, else its own id)."""
        wanted = list(dict.fromkeys(conversation_ids))
        if not wanted:
            return {}
        query = select(_threads.c.conversation_id, _threads.c.client_id).where(
            _threads.c.owner == owner, _threads.c.face == FACE, _threads.c.conversation_id.in_(wanted)
        )
        async with self._sessionmaker() as session:
            named = {row.conversation_id: row.client_id for row in await session.execute(query)}
        return {conv: named.get(conv, conv) for conv in wanted}

    async def page(
        self, owner: str, request: ListTasksRequest, conversation_id: str | None
    ) -> tuple[list[RunRecord], str, int]:
        """A page of ``owner``'s runs as ``request`` asks (``conversation_id``: of that context's
        conversation), newest status first; the next page's token (``""`` at the end) and the
        number of tasks that match."""
        size = request.page_size if request.HasField("page_size") else DEFAULT_PAGE_SIZE
        if not 1 <= size <= MAX_PAGE_SIZE:
            raise InvalidParamsError(f"pageSize must be between 1 and {MAX_PAGE_SIZE}")
        matching = [_runs.c.owner == owner]
        if conversation_id is not None:
            matching.append(_runs.c.conversation_id == conversation_id)
        if request.status != TaskState.TASK_STATE_UNSPECIFIED:
            status = _STATUSES_OF.get(request.status)
            if status is None:  # REJECTED, AUTH_REQUIRED: no run is ever in them
                return [], "", 0
            matching.append(_runs.c.status == status)
        if request.HasField("status_timestamp_after"):
            try:
                after = request.status_timestamp_after.ToDatetime(tzinfo=UTC)
            except (ValueError, OverflowError):
                raise InvalidParamsError("statusTimestampAfter is out of range") from None
            after = _bounded(after, "statusTimestampAfter")
            matching.append(_STATUS_TIME > after)
        conditions = list(matching)
        if request.page_token:
            try:
                at, run_id = decode_page_cursor(request.page_token)
                at = _bounded(at, "pageToken")
            except (InvalidCursorError, InvalidParamsError):
                run_id = ""
            if not is_resource_id(run_id):
                raise InvalidParamsError("pageToken is not one this service handed out")
            conditions.append(or_(_STATUS_TIME < at, and_(_STATUS_TIME == at, _runs.c.id < run_id)))
        query = (
            select(_runs).where(*conditions).order_by(_STATUS_TIME.desc(), _runs.c.id.desc()).limit(size + 1)
        )
        count = select(func.count()).select_from(_runs).where(*matching)
        async with self._sessionmaker() as session:
            rows = list(await session.execute(query))
            total = int(await session.scalar(count) or 0)
        runs = [_run_record(row) for row in rows[:size]]
        token = encode_page_cursor(status_time(runs[-1]), runs[-1].id) if len(rows) > size else ""
        return runs, token, total


def _bounded(at: datetime, what: str) -> datetime:
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    if not _EARLIEST <= at <= _LATEST:
        raise InvalidParamsError(f"{what} is out of range")
    return at
