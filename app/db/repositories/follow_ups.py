"""``FollowUpRepo``: the follow-ups users post to a conversation's active run (E-22, RUNS.md R-11).

A run takes them in order of their ids and its checkpoints say how far it got (its position): the
rows it took are deleted with the checkpoint that records them, the rest with the run's close,
which names them in its ``done``. So a follow-up survives the worker that was about to take it,
and none is taken twice by a new attempt.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.errors import ConversationNotFoundError, FollowUpLimitError
from app.db.models import ACTIVE_STATUSES, Conversation, FollowUp, Message, Run, utcnow
from app.db.repositories.rows import _append_messages, _lock_conversation, follow_up_messages


@dataclass(frozen=True, slots=True)
class FollowUpRecord:
    id: int
    content: str


class FollowUpRepo:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def add(self, conversation_id: str, content: str, *, limit: int) -> int:
        """Store a follow-up; how many wait now. Raises ``FollowUpLimitError`` (storing nothing)
        when ``limit`` already wait, ``ConversationNotFoundError`` if the conversation is gone."""
        async with self._sessionmaker.begin() as session:
            # The conversation's row first: concurrent posts take turns, so the limit holds.
            touched = await session.execute(
                update(Conversation).where(Conversation.id == conversation_id).values(updated_at=utcnow())
            )
            if not touched.rowcount:  # type: ignore[attr-defined]
                raise ConversationNotFoundError(conversation_id)
            waiting = await session.scalar(
                select(func.count()).select_from(FollowUp).where(FollowUp.conversation_id == conversation_id)
            )
            if (waiting or 0) >= limit:
                raise FollowUpLimitError(limit)
            await session.execute(
                insert(FollowUp).values(conversation_id=conversation_id, content=content, created_at=utcnow())
            )
        return int(waiting or 0) + 1

    async def after(self, conversation_id: str, position: int) -> list[FollowUpRecord]:
        """The conversation's follow-ups with an id above ``position``, oldest first."""
        async with self._sessionmaker() as session:
            rows = await session.execute(
                select(FollowUp.id, FollowUp.content)
                .where(FollowUp.conversation_id == conversation_id, FollowUp.id > position)
                .order_by(FollowUp.id)
            )
            return [FollowUpRecord(row.id, row.content) for row in rows]

    async def keep_if_no_run(self, conversation_id: str, run_id: str) -> list[str]:
        """When no run of the conversation is running any more, move what waits into its messages
        (pinned, for the next run's history) and return it; otherwise leave it to the run."""
        async with self._sessionmaker.begin() as session:
            # Locks the conversation: a run that starts now (RunRepo.start appends its question
            # under the same lock) either saw these in its queue or comes after this.
            try:
                head = await _lock_conversation(session, conversation_id)
            except ConversationNotFoundError:
                return []
            running = await session.scalar(
                select(Run.id).where(Run.conversation_id == conversation_id, Run.status.in_(ACTIVE_STATUSES))
            )
            if running is not None:
                return []
            rows = await session.execute(
                select(FollowUp.id, FollowUp.content)
                .where(FollowUp.conversation_id == conversation_id)
                .order_by(FollowUp.id)
            )
            taken = [(row.id, row.content) for row in rows]
            if not taken:
                return []
            await session.execute(
                delete(FollowUp).where(
                    FollowUp.conversation_id == conversation_id, FollowUp.id <= taken[-1][0]
                )
            )
            contents = [content for _, content in taken]
            messages = follow_up_messages(contents)
            # Below where the run that missed them ended (its last message, else its question),
            # which is the current leaf unless someone switched branches meanwhile.
            end = await session.scalar(
                select(func.max(Message.seq)).where(
                    Message.conversation_id == conversation_id, Message.run_id == run_id
                )
            )
            if end is None:
                end = await session.scalar(select(Run.question_seq).where(Run.id == run_id))
            parent = end if end is not None else head
            await _append_messages(
                session, conversation_id, run_id, messages, parent_seq=parent, locked=True, head_from=parent
            )
            return contents
