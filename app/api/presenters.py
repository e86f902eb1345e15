"""Turn repository records into the response bodies of API.md."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson

from app.api.schemas import ConversationOut, EventOut, MessageOut, RunOut
from app.db.repositories import ConversationRecord, MessageRecord, RunRecord
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


def message_out(msg: MessageRecord) -> MessageOut:
    return MessageOut(
        role=msg.role,
        content=msg.content,
        tool_calls=[tc.to_openai() for tc in msg.tool_calls] if msg.tool_calls else None,
        tool_call_id=msg.tool_call_id,
        run_id=msg.run_id,
        pinned=msg.pinned,
        created_at=iso(msg.created_at) or "",
    )


def run_out(run: RunRecord, model: str, pending_approvals: list[dict[str, Any]] | None = None) -> RunOut:
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
    )


def event_out(ev: StoredEvent) -> EventOut:
    return EventOut(id=ev.id, event=ev.event, data=orjson.loads(ev.data))
