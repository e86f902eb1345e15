"""``ConversationRepo``: conversations and their messages."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, delete, insert, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.models import Conversation, Message, utcnow
from app.db.repositories.rows import (
    _CONVERSATION_OF_OWNER,
    ConversationRecord,
    MessageRecord,
    _append_messages,
    _conversation_record,
    _conversations,
    _history,
    _message_record,
    decode_page_cursor,
    encode_page_cursor,
    new_conversation_id,
)
from app.llm.base import ChatMessage


class ConversationRepo:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def create(self, owner: str, title: str, agent_config: dict[str, Any]) -> ConversationRecord:
        now = utcnow()
        record = ConversationRecord(new_conversation_id(), owner, title, dict(agent_config), now, now)
        async with self._sessionmaker.begin() as session:
            await session.execute(
                insert(_conversations),
                {
                    "id": record.id,
                    "owner": owner,
                    "title": title,
                    "agent_config": agent_config,
                    "created_at": now,
                    "updated_at": now,
                },
            )
        return record

    async def get(self, owner: str, conversation_id: str) -> ConversationRecord | None:
        """The conversation if ``owner`` owns it; None otherwise (another owner's looks absent)."""
        async with self._sessionmaker() as session:
            row = (
                await session.execute(_CONVERSATION_OF_OWNER, {"b_id": conversation_id, "b_owner": owner})
            ).first()
        return _conversation_record(row) if row is not None else None

    async def list(
        self, owner: str, limit: int, cursor: str | None
    ) -> tuple[list[ConversationRecord], str | None]:
        """``owner``'s conversations newest first, and the cursor of the next page (None at the end)."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        query = select(Conversation).where(Conversation.owner == owner)
        if cursor is not None:
            created_at, after_id = decode_page_cursor(cursor)
            query = query.where(
                or_(
                    Conversation.created_at < created_at,
                    and_(Conversation.created_at == created_at, Conversation.id < after_id),
                )
            )
        query = query.order_by(Conversation.created_at.desc(), Conversation.id.desc()).limit(limit + 1)
        async with self._sessionmaker() as session:
            rows = list(await session.scalars(query))
        page = [_conversation_record(row) for row in rows[:limit]]
        next_cursor = encode_page_cursor(page[-1].created_at, page[-1].id) if len(rows) > limit else None
        return page, next_cursor

    async def delete(self, owner: str, conversation_id: str) -> bool:
        """Delete the conversation with its messages, runs and events; False if ``owner`` has no such one."""
        async with self._sessionmaker.begin() as session:
            result = await session.execute(
                delete(Conversation).where(Conversation.id == conversation_id, Conversation.owner == owner)
            )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    async def add_messages(
        self, conversation_id: str, run_id: str | None, messages: Sequence[ChatMessage]
    ) -> None:
        """Append ``messages`` after the conversation's last one and mark the conversation updated.

        Raises ``ConversationNotFoundError`` if the conversation is gone.
        """
        if not messages:
            return
        async with self._sessionmaker.begin() as session:
            await _append_messages(session, conversation_id, run_id, messages)

    # builtins.list: inside this class, ``list`` names the method above.
    async def messages(self, conversation_id: str) -> builtins.list[MessageRecord]:
        async with self._sessionmaker() as session:
            rows = await session.scalars(
                select(Message).where(Message.conversation_id == conversation_id).order_by(Message.seq)
            )
            return [_message_record(row) for row in rows]

    async def history(self, conversation_id: str) -> builtins.list[ChatMessage]:
        async with self._sessionmaker() as session:
            return await _history(session, conversation_id)
