"""``FaceThreadRepo``: the chats, threads and contexts of the protocol faces (FACES.md V-02, G-02).

A client of a face names its conversation with an id of its own; per owner and face that id names
one conversation, created at its first use (with the earlier messages the client sent, if any).
Two owners who pick the same id get two conversations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import Table, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.models import FaceThread
from app.db.repositories.rows import (
    ConversationRecord,
    _append_messages,
    _conversation_record,
    _conversations,
    _insert_conversation,
    new_conversation,
)
from app.llm.base import ChatMessage

_threads: Table = FaceThread.__table__  # type: ignore[assignment]


class FaceThreadRepo:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def find(self, owner: str, face: str, client_id: str) -> ConversationRecord | None:
        """The conversation ``owner``'s ``client_id`` names on ``face``, if it was used before."""
        query = (
            select(_conversations)
            .join(_threads, _threads.c.conversation_id == _conversations.c.id)
            .where(
                _threads.c.owner == owner,
                _threads.c.face == face,
                _threads.c.client_id == client_id,
                _conversations.c.owner == owner,
            )
        )
        async with self._sessionmaker() as session:
            row = (await session.execute(query)).first()
        return _conversation_record(row) if row is not None else None

    async def open(
        self,
        owner: str,
        face: str,
        client_id: str,
        *,
        title: str,
        agent_config: dict[str, Any],
        history: Sequence[tuple[ChatMessage, str | None]] = (),
    ) -> tuple[ConversationRecord, bool]:
        """The conversation ``client_id`` names, created now with ``history`` (messages and the
        ids the client gave them) if it is new; and whether it was created. Of two requests that
        create the same one at once, one creates it and the other gets it."""
        found = await self.find(owner, face, client_id)
        if found is not None:
            return found, False
        record = new_conversation(owner, title, agent_config)
        now = record.created_at
        try:
            async with self._sessionmaker.begin() as session:
                await _insert_conversation(session, record)
                await session.execute(
                    insert(_threads),
                    {
                        "owner": owner,
                        "face": face,
                        "client_id": client_id,
                        "conversation_id": record.id,
                        "created_at": now,
                    },
                )
                if history:
                    head = await _append_messages(
                        session,
                        record.id,
                        None,
                        [message for message, _ in history],
                        parent_seq=None,
                        client_ids=[client for _, client in history],
                    )
                    record = replace(record, head_seq=head)
        except IntegrityError:
            raced = await self.find(owner, face, client_id)
            if raced is None:
                raise
            return raced, False
        return record, True
