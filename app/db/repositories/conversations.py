"""``ConversationRepo``: conversations and their trees of messages (FACES.md B-01, B-04, B-05)."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import and_, bindparam, delete, insert, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.errors import RunActiveError
from app.db.models import ACTIVE_STATUSES, Conversation, utcnow
from app.db.repositories.rows import (
    _CONVERSATION_OF_OWNER,
    ConversationRecord,
    MessageRecord,
    _append_messages,
    _conversation_record,
    _conversations,
    _insert_conversation,
    _lock_conversation,
    _messages_of,
    _move_head,
    _runs,
    decode_page_cursor,
    encode_page_cursor,
    new_conversation,
    new_conversation_id,
    path_to,
)
from app.db.session import read_sessions
from app.llm.base import ChatMessage

_ACTIVE_RUN_OF = select(_runs.c.id).where(
    _runs.c.conversation_id == bindparam("b_conversation"), _runs.c.status.in_(ACTIVE_STATUSES)
)


class ConversationRepo:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker
        self._reads = read_sessions(sessionmaker)  # a conversation's owner check, twice a run

    async def create(self, owner: str, title: str, agent_config: dict[str, Any]) -> ConversationRecord:
        record = new_conversation(owner, title, agent_config)
        async with self._sessionmaker.begin() as session:
            await _insert_conversation(session, record)
        return record

    async def get(self, owner: str, conversation_id: str) -> ConversationRecord | None:
        """The conversation if ``owner`` owns it; None otherwise (another owner's looks absent)."""
        async with self._reads() as session:
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
        """Append ``messages`` below the conversation's current leaf, which moves to the last.

        Raises ``ConversationNotFoundError`` if the conversation is gone.
        """
        if not messages:
            return
        async with self._sessionmaker.begin() as session:
            head = await _lock_conversation(session, conversation_id)
            await _append_messages(
                session, conversation_id, run_id, messages, parent_seq=head, locked=True, head_from=head
            )

    # builtins.list: inside this class, ``list`` names the method above.
    async def messages(self, conversation_id: str) -> builtins.list[MessageRecord]:
        """Every message of the conversation, of every branch, in the order they were stored."""
        async with self._sessionmaker() as session:
            return await _messages_of(session, conversation_id)

    async def history(self, conversation_id: str) -> builtins.list[ChatMessage]:
        """The current branch: the path from the root to the current leaf."""
        async with self._sessionmaker() as session:
            head = await session.scalar(
                select(Conversation.head_seq).where(Conversation.id == conversation_id)
            )
            records = await _messages_of(session, conversation_id)
        return [record.to_chat_message() for record in path_to(records, head)]

    async def branch(self, conversation_id: str) -> tuple[builtins.list[MessageRecord], int | None]:
        """Every message of the conversation and its current leaf, read together: the leaf first,
        so that the messages read after it hold it (a message is stored before the leaf moves to
        it, in the same transaction)."""
        async with self._sessionmaker() as session:
            head: int | None = await session.scalar(
                select(Conversation.head_seq).where(Conversation.id == conversation_id)
            )
            return await _messages_of(session, conversation_id), head

    async def head(self, conversation_id: str) -> int | None:
        """The seq of the conversation's current leaf (None: no message yet)."""
        async with self._sessionmaker() as session:
            head: int | None = await session.scalar(
                select(Conversation.head_seq).where(Conversation.id == conversation_id)
            )
        return head

    async def switch(self, conversation_id: str, seq: int) -> int:
        """Make the newest leaf below message ``seq`` (itself, if it has no child) the current
        leaf (FACES.md B-04); returns its seq. Raises ``RunActiveError`` while a run of the
        conversation is active (B-07): its messages hang below the current leaf."""
        async with self._sessionmaker.begin() as session:
            await _lock_conversation(session, conversation_id)
            if await session.scalar(_ACTIVE_RUN_OF, {"b_conversation": conversation_id}) is not None:
                raise RunActiveError(conversation_id)
            leaf = newest_leaf(await _messages_of(session, conversation_id), seq)
            await _move_head(session, conversation_id, leaf, "any")
        return leaf

    async def fork(self, source: ConversationRecord, seq: int, title: str) -> ConversationRecord:
        """A new conversation of the same owner and agent whose messages are copies of the path
        to message ``seq`` of ``source`` (FACES.md B-05); ``source`` does not change. The copies
        belong to no run of the new conversation (their ``run_id`` is None)."""
        async with self._sessionmaker() as session:
            path = path_to(await _messages_of(session, source.id), seq)
        now = utcnow()
        record = ConversationRecord(
            new_conversation_id(), source.owner, title, dict(source.agent_config), now, now, None
        )
        async with self._sessionmaker.begin() as session:
            await session.execute(
                insert(_conversations),
                {
                    "id": record.id,
                    "owner": record.owner,
                    "title": title,
                    "agent_config": record.agent_config,
                    "created_at": now,
                    "updated_at": now,
                },
            )
            head = None
            if path:
                head = await _append_messages(
                    session,
                    record.id,
                    None,
                    [m.to_chat_message() for m in path],
                    parent_seq=None,
                    locked=True,
                    first_seq=0,
                )
        return replace(record, head_seq=head)


def newest_leaf(records: Sequence[MessageRecord], seq: int) -> int:
    """The seq of the newest message with no child below message ``seq`` (``seq`` itself if it
    has none)."""
    children: dict[int, builtins.list[int]] = {}
    for record in records:
        if record.parent_seq is not None:
            children.setdefault(record.parent_seq, []).append(record.seq)
    leaves: builtins.list[int] = []
    stack = [seq]
    while stack:
        current = stack.pop()
        below = children.get(current)
        if below:
            stack.extend(below)
        else:
            leaves.append(current)
    return max(leaves)
