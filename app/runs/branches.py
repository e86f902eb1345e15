"""Where a new run goes in a conversation's tree of messages (FACES.md B-02, B-03), and which
messages a question may follow.

The API's and the protocol faces' words (an edit, a regenerate, a message the client names) all
come down to a ``Placement`` here; ``RunRepo.start`` stores the run there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.db.repositories import ConversationRecord, ConversationRepo, MessageRecord, RunRepo
from app.db.repositories.rows import parse_message_id
from app.db.repositories.run_start import UNDER_HEAD, Placement
from app.errors import InvalidInputError, NotFoundError


@dataclass(frozen=True, slots=True)
class Question:
    """A run's question and its place."""

    text: str
    placement: Placement = UNDER_HEAD


def find_message(records: Sequence[MessageRecord], public_id: str) -> MessageRecord:
    """The message of ``records`` (one conversation's) with API id ``public_id``; 404 otherwise
    (another conversation's message is not found either)."""
    wanted = parse_message_id(public_id)
    found = next((r for r in records if r.id == wanted), None) if wanted is not None else None
    if found is None:
        raise NotFoundError("message not found in this conversation")
    return found


def check_parent(records: Sequence[MessageRecord], parent: MessageRecord, field: str = "parent_id") -> None:
    """A question may follow any message after which a conversation can go on: not an assistant
    message that asks for tools (its results follow it), nor a tool result that others of the
    same reply follow. ``field``: the request's name for ``parent``, for the 422's message."""
    if parent.role == "assistant" and parent.tool_calls:
        raise InvalidInputError(
            f"{field} names an assistant message that calls tools: a question cannot follow it "
            "before their results; name the answer of that run, or its question's parent"
        )
    if parent.role == "tool" and any(r.parent_seq == parent.seq and r.role == "tool" for r in records):
        raise InvalidInputError(f"{field} names a tool result that others of the same call follow")


async def question_of(
    conversations: ConversationRepo,
    runs: RunRepo,
    conversation: ConversationRecord,
    *,
    message: str | None,
    parent_id: str | None,
    parent_given: bool,
    regenerate: str | None,
) -> Question:
    """What ``POST .../runs`` asks: ``message`` below the current leaf, below ``parent_id`` when
    given (None: as a first message; B-02), or a message answered again (``regenerate``, B-03)."""
    if regenerate is not None:
        records = await conversations.messages(conversation.id)
        target = find_message(records, regenerate)
        question = await answered_question(runs, conversation, records, target)
        return Question(question.content or "", Placement(question_seq=question.seq))
    assert message is not None
    if not parent_given:
        return Question(message)
    if parent_id is None:
        return Question(message, Placement(under_head=False, parent_seq=None))
    records = await conversations.messages(conversation.id)
    parent = find_message(records, parent_id)
    check_parent(records, parent)
    return Question(message, Placement(under_head=False, parent_seq=parent.seq))


async def answered_question(
    runs: RunRepo, conversation: ConversationRecord, records: Sequence[MessageRecord], target: MessageRecord
) -> MessageRecord:
    """The user message a regenerate of ``target`` answers again: ``target`` itself, or, for an
    assistant message, the question of the run that wrote it (the nearest user message above it
    when no run did)."""
    if target.role == "user":
        if not (target.content or "").strip():
            raise InvalidInputError("that user message has no text to answer")
        return target
    if target.role != "assistant":
        raise InvalidInputError("regenerate names a user or an assistant message")
    by_seq = {r.seq: r for r in records}
    if target.run_id is not None:
        run = await runs.get(conversation.owner, target.run_id)
        if run is not None and run.conversation_id == conversation.id and run.question_seq in by_seq:
            return by_seq[run.question_seq]
    seq = target.parent_seq
    while seq is not None and seq in by_seq:
        if by_seq[seq].role == "user" and (by_seq[seq].content or "").strip():
            return by_seq[seq]
        seq = by_seq[seq].parent_seq
    raise InvalidInputError("that assistant message answers no question of this conversation")
