"""How a run starts, in one transaction (``RunRepo.start``): the run's row, its question's place
in the conversation's tree (FACES.md B-02, B-03), the history it reads, the follow-ups that waited,
the events and first checkpoint of a run that starts from another's (a replay, B-06), whether
it queues (RUNS.md Q-01), and the A2A push notification configs it starts with (N-06).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, delete, exists, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.errors import EventIdTakenError
from app.db.models import FollowUp
from app.db.repositories.push_configs import NewPushConfig, insert_push_configs
from app.db.repositories.queue import Admission, admit, check_bound
from app.db.repositories.rows import (
    _LAST_EVENT_ID,
    _append_messages,
    _checkpoints,
    _event_row,
    _events,
    _insert_events,
    _lock_conversation,
    _messages_of,
    _move_head,
    _runs,
    follow_up_messages,
    next_seq,
    path_to,
)
from app.llm.base import ChatMessage
from app.streaming.bus import StoredEvent, later_cursor

_TAKE_FOLLOW_UPS = (
    delete(FollowUp)
    .where(FollowUp.conversation_id == bindparam("b_conversation"))
    .returning(FollowUp.id, FollowUp.content)
)
# What a starting run needs to know of its conversation, read in one statement once the
# conversation's row is locked: the last stored event, and whether follow-ups wait.
_START_LOOK = select(
    _LAST_EVENT_ID.scalar_subquery().label("last_event"),
    exists().where(FollowUp.conversation_id == bindparam("b_conversation")).label("follow_ups"),
)
_SET_START = update(_runs).where(_runs.c.id == bindparam("b_id"))


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a starting run's question goes in the conversation's tree (FACES.md B-02, B-03).

    By default below the current leaf. ``parent_seq``: below that message instead (None: as a
    first message) when ``under_head`` is False. ``question_seq``: no new question, the run answers
    that stored one again (a regenerate, a replay), a sibling of its other answers.
    """

    under_head: bool = True
    parent_seq: int | None = None
    question_seq: int | None = None
    client_id: str | None = None
    """The id a protocol face's client gave a new question (FACES.md V-02, G-02)."""


UNDER_HEAD = Placement()
"""A question asked below the conversation's current leaf (what a run without more does)."""


@dataclass(frozen=True, slots=True)
class Opening:
    """What a run that starts from a checkpoint of another (a replay, FACES.md B-06) stores with
    its start: its first events and the whole state its first attempt starts from."""

    events: list[StoredEvent]
    checkpoint: str


async def insert_start(
    session: AsyncSession,
    row: dict[str, Any],
    prior: Sequence[ChatMessage],
    admission: Admission | None,
    queued_event: Callable[[str, str, int], StoredEvent] | None,
    placement: Placement,
    opening: Callable[[str, str], Opening] | None,
    *,
    exclusive: bool,
    push_configs: Sequence[NewPushConfig] = (),
) -> list[ChatMessage]:
    """``RunRepo.start``'s transaction (the caller's ``session``): stores new run ``row`` (updated
    in place if it queues) and returns its history."""
    conversation_id = row["conversation_id"]
    start_cursor = row["start_cursor"]
    await session.execute(insert(_runs), row)  # the one-active-run index decides here
    position = await admit(session, row["id"], row["owner"], admission) if admission else None
    if position is not None:
        row.update(status="queued", worker_id=None, lease_expires_at=None)
    # The conversation's row locked before anything of it is read (FollowUpRepo takes the same
    # lock): follow-ups accepted after the previous run took its last ones, and kept nowhere
    # since, are stored now (in the history, before a question asked below the current leaf),
    # so that the run's queue holds only what comes after its start.
    head = await _lock_conversation(session, conversation_id)
    look = (await session.execute(_START_LOOK, {"b_conversation": conversation_id})).one()
    cursor = later_cursor(start_cursor, look.last_event)
    row["start_cursor"] = cursor
    records = await _messages_of(session, conversation_id)
    seq = next_seq(records)
    late = (
        list(await session.execute(_TAKE_FOLLOW_UPS, {"b_conversation": conversation_id}))
        if look.follow_ups
        else []
    )
    missed = follow_up_messages([r.content for r in sorted(late, key=lambda r: r.id)])
    asks_below_head = placement.under_head and placement.question_seq is None
    if missed and not asks_below_head:
        # Follow-ups the previous run missed belong to its branch: below where it ended, out of
        # this run's history (it asks elsewhere in the tree).
        await _append_messages(
            session,
            conversation_id,
            None,
            missed,
            parent_seq=head,
            locked=True,
            first_seq=seq,
            head_from="stay",
        )
        seq += len(missed)
        missed = []
    if placement.question_seq is not None:
        # Answered again: the question is stored already.
        question = placement.question_seq
        parent = next((r.parent_seq for r in records if r.seq == question), None)
        history = [r.to_chat_message() for r in path_to(records, parent)]
        await _move_head(session, conversation_id, question, "any")
    else:
        parent = head if placement.under_head else placement.parent_seq
        history = [r.to_chat_message() for r in path_to(records, parent)]
        before = [*prior, *missed]
        if before:
            parent = await _append_messages(
                session,
                conversation_id,
                None,
                before,
                parent_seq=parent,
                locked=True,
                first_seq=seq,
                head_from="stay",  # the question, next, is the new leaf
            )
            history += before
            seq = parent + 1
        question = await _append_messages(
            session,
            conversation_id,
            row["id"],
            [ChatMessage(role="user", content=row["message"])],
            parent_seq=parent,
            locked=True,
            first_seq=seq,
            client_ids=(placement.client_id,),
        )
    row["question_seq"] = question
    await insert_push_configs(session, row["id"], row["owner"], push_configs)
    await session.execute(_SET_START, {"b_id": row["id"], "start_cursor": cursor, "question_seq": question})
    after = cursor
    if opening is not None:
        opened = opening(row["id"], cursor)
        if opened.events:
            await _insert_events(session, [_event_row(conversation_id, e) for e in opened.events])
            stored = await session.scalar(select(func.count()).where(_events.c.run_id == row["id"]))
            if stored != len(opened.events):  # another process stored under one of the ids
                raise EventIdTakenError(opened.events[0].id)
            after = opened.events[-1].id
        await session.execute(
            insert(_checkpoints),
            {
                "run_id": row["id"],
                "attempt": row["attempt"],
                "seq": 0,
                "after": after,
                "data": opened.checkpoint,
                "created_at": row["created_at"],
            },
        )
    if position is not None and admission is not None:
        if queued_event is not None:
            event = queued_event(row["id"], after, position)
            if not await _insert_events(session, [_event_row(conversation_id, event)]):
                raise EventIdTakenError(event.id)
        await check_bound(session, admission.max_queued, exclusive=exclusive)
    return history
