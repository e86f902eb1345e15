"""Turn repository records into the response bodies of API.md."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import orjson

from app.api.schemas import ConversationOut, EventOut, MessageOut, RunOut
from app.db.repositories import ConversationRecord, MessageRecord, RunRecord
from app.db.repositories.rows import path_to
from app.streaming.bus import StoredEvent


def iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def conversation_out(conv: ConversationRecord) -> ConversationOut:
    return ConversationOut(
        id=conv.id,
        title=conv.title,
        agent=dict(conv.agent_config or {}),
        created_at=iso(conv.created_at) or "",
        updated_at=iso(conv.updated_at) or "",
    )


def branch_out(records: Sequence[MessageRecord], head: int | None) -> list[MessageOut]:
    """The current branch (the path from the root to ``head``) of a conversation whose messages,
    every branch's, are ``records`` (FACES.md B-01)."""
    by_seq = {r.seq: r for r in records}
    siblings: dict[tuple[int | None, str], list[str]] = {}
    for r in records:  # in the order they were stored: oldest first
        siblings.setdefault((r.parent_seq, r.role), []).append(r.public_id)
    return [
        message_out(
            m,
            parent_id=by_seq[m.parent_seq].public_id if m.parent_seq in by_seq else None,
            sibling_ids=siblings[(m.parent_seq, m.role)],
        )
        for m in path_to(records, head)
    ]


def message_out(msg: MessageRecord, *, parent_id: str | None, sibling_ids: list[str]) -> MessageOut:
    return MessageOut(
        id=msg.public_id,
        parent_id=parent_id,
        sibling_ids=sibling_ids,
        role=msg.role,
        content=msg.content,
        tool_calls=[tc.to_openai() for tc in msg.tool_calls] if msg.tool_calls else None,
        tool_call_id=msg.tool_call_id,
        run_id=msg.run_id,
        pinned=msg.pinned,
        created_at=iso(msg.created_at) or "",
    )


def run_out(
    run: RunRecord,
    model: str,
    pending_approvals: list[dict[str, Any]] | None = None,
    pending_tool_calls: list[dict[str, Any]] | None = None,
) -> RunOut:
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "llm_calls": 0}
    usage.update({k: int(v) for k, v in (run.usage or {}).items() if k in usage})
    return RunOut(
        run_id=run.id,
        conversation_id=run.conversation_id,
        status=run.status,
        answer=run.answer,
        iterations=run.iterations,
        usage=usage,
        # Rounded like the done event's ``elapsed``, so that the record and the stream agree.
        elapsed=round(run.elapsed, 4) if run.elapsed is not None else None,
        error=run.error,
        created_at=iso(run.created_at) or "",
        finished_at=iso(run.finished_at),
        attempt=run.attempt,
        model=model,
        pending_approvals=pending_approvals or [],
        trace_id=run.trace_id,
        pending_tool_calls=pending_tool_calls or [],
        replay_of=run.replay_of,
    )


def event_out(ev: StoredEvent) -> EventOut:
    return EventOut(id=ev.id, event=ev.event, data=orjson.loads(ev.data))
