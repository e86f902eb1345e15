"""ConversationRepo against real SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import UTC

import pytest
from sqlalchemy import update

from app.db.errors import ConversationNotFoundError, InvalidCursorError
from app.db.models import Conversation
from app.db.repositories import ConversationRepo, EventRepo, RunRepo
from app.db.session import Database
from app.llm.base import ChatMessage, ToolCall
from app.streaming.bus import StoredEvent


@pytest.fixture
def conversations(database: Database) -> ConversationRepo:
    return ConversationRepo(database.sessionmaker)


async def test_create_then_get_returns_the_same_record_with_utc_datetimes(
    conversations: ConversationRepo,
) -> None:
    config = {"mode": "native", "tools": ["calculator"], "max_iterations": 7, "nested": {"a": [1, None]}}

    created = await conversations.create("alice", "Taxes", config)
    fetched = await conversations.get("alice", created.id)

    assert fetched == created
    assert created.id.startswith("conv_") and len(created.id) >= 25
    assert created.agent_config == config
    assert created.created_at.tzinfo == UTC and created.updated_at == created.created_at


async def test_conversation_ids_are_unique(conversations: ConversationRepo) -> None:
    made = [await conversations.create("alice", "t", {}) for _ in range(5)]

    assert len({c.id for c in made}) == 5


async def test_get_of_another_owners_conversation_returns_none(conversations: ConversationRepo) -> None:
    created = await conversations.create("alice", "private", {})

    assert await conversations.get("mallory", created.id) is None
    assert await conversations.get("alice", "conv_missing") is None


async def test_delete_of_another_owners_conversation_returns_false_and_keeps_it(
    conversations: ConversationRepo,
) -> None:
    created = await conversations.create("alice", "private", {})

    assert await conversations.delete("mallory", created.id) is False
    assert await conversations.get("alice", created.id) == created


async def test_delete_removes_the_conversation_with_its_messages_runs_and_events(database: Database) -> None:
    conversations = ConversationRepo(database.sessionmaker)
    runs = RunRepo(database.sessionmaker)
    events = EventRepo(database.sessionmaker)
    conv = await conversations.create("alice", "doomed", {})
    run, _ = await runs.start(conv.id, "alice", "hi", worker_id="w1", lease_s=30, start_cursor="0-0")
    await events.save(conv.id, [StoredEvent(id="5-0", event="done", data="{}", run_id=run.id)])

    assert await conversations.delete("alice", conv.id) is True

    assert await conversations.get("alice", conv.id) is None
    assert await conversations.messages(conv.id) == []
    assert await runs.get_any(run.id) is None
    assert await events.for_run(run.id) == []
    assert await conversations.delete("alice", conv.id) is False


async def test_list_pages_newest_first_through_the_cursor_without_gaps_or_repeats(
    conversations: ConversationRepo,
) -> None:
    made = [await conversations.create("alice", f"c{i}", {}) for i in range(7)]
    await conversations.create("bob", "not alice's", {})

    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        page, cursor = await conversations.list("alice", limit=3, cursor=cursor)
        pages += 1
        seen.extend(c.id for c in page)
        if cursor is None:
            break

    assert pages == 3
    assert seen == [c.id for c in reversed(made)]


async def test_list_breaks_created_at_ties_by_id(database: Database, conversations: ConversationRepo) -> None:
    made = [await conversations.create("alice", f"c{i}", {}) for i in range(4)]
    # Same timestamp for all: the order must still be total and stable across pages.
    async with database.sessionmaker.begin() as session:
        await session.execute(update(Conversation).values(created_at=made[0].created_at))

    first, cursor = await conversations.list("alice", limit=2, cursor=None)
    second, end = await conversations.list("alice", limit=2, cursor=cursor)

    assert end is None
    assert [c.id for c in first + second] == sorted((c.id for c in made), reverse=True)


async def test_list_of_exactly_one_full_page_has_no_next_cursor(conversations: ConversationRepo) -> None:
    for i in range(3):
        await conversations.create("alice", f"c{i}", {})

    page, cursor = await conversations.list("alice", limit=3, cursor=None)

    assert len(page) == 3 and cursor is None


@pytest.mark.parametrize("cursor", ["garbage", "", "eyJ4IjoxfQ", "WyJub3QgYSBkYXRlIiwiY29udl94Il0"])
async def test_list_with_an_invalid_cursor_raises_invalid_cursor_error(
    conversations: ConversationRepo, cursor: str
) -> None:
    with pytest.raises(InvalidCursorError):
        await conversations.list("alice", limit=3, cursor=cursor)


async def test_history_round_trips_tool_calls_pins_and_names_in_order(
    conversations: ConversationRepo,
) -> None:
    conv = await conversations.create("alice", "tools", {})
    history = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="what is 2+2 and 3*3?", pinned=True),
        ChatMessage(
            role="assistant",
            content=None,
            tool_calls=(
                ToolCall(id="call_1", name="calculator", arguments='{"expression": "2+2"}'),
                ToolCall(id="call_2", name="calculator", arguments='{"expression":"3*3"}'),
            ),
        ),
        ChatMessage(role="tool", content="4", tool_call_id="call_1", name="calculator"),
        ChatMessage(role="tool", content="9", tool_call_id="call_2", name="calculator"),
        ChatMessage(role="assistant", content="4 and 9 — done ✓", name="agent"),
    ]

    await conversations.add_messages(conv.id, "run_a", history[:2])
    await conversations.add_messages(conv.id, "run_a", history[2:])

    assert await conversations.history(conv.id) == history
    records = await conversations.messages(conv.id)
    assert [m.seq for m in records] == list(range(6))
    assert {m.run_id for m in records} == {"run_a"}
    assert records[0].created_at.tzinfo == UTC


async def test_add_messages_without_a_run_stores_a_null_run_id(conversations: ConversationRepo) -> None:
    conv = await conversations.create("alice", "t", {})

    await conversations.add_messages(conv.id, None, [ChatMessage(role="user", content="seeded")])

    (record,) = await conversations.messages(conv.id)
    assert record.run_id is None and record.tool_calls == ()


async def test_concurrent_add_messages_get_distinct_consecutive_seqs(conversations: ConversationRepo) -> None:
    conv = await conversations.create("alice", "t", {})
    batches = [[ChatMessage(role="user", content=f"{b}-{i}") for i in range(3)] for b in range(4)]

    await asyncio.gather(*(conversations.add_messages(conv.id, None, batch) for batch in batches))

    records = await conversations.messages(conv.id)
    assert [m.seq for m in records] == list(range(12))
    # Each batch stays contiguous: appends are serialised, never interleaved.
    contents = [m.content for m in records]
    for batch in batches:
        start = contents.index(batch[0].content)
        assert contents[start : start + 3] == [m.content for m in batch]


async def test_add_messages_to_a_missing_conversation_raises_conversation_not_found(
    conversations: ConversationRepo,
) -> None:
    with pytest.raises(ConversationNotFoundError):
        await conversations.add_messages("conv_missing", None, [ChatMessage(role="user", content="x")])


async def test_add_messages_moves_updated_at_forward(conversations: ConversationRepo) -> None:
    conv = await conversations.create("alice", "t", {})

    await conversations.add_messages(conv.id, None, [ChatMessage(role="user", content="x")])
    after_add = await conversations.get("alice", conv.id)
    await conversations.add_messages(conv.id, None, [ChatMessage(role="user", content="y")])
    after_second = await conversations.get("alice", conv.id)

    assert after_add is not None and after_second is not None
    assert conv.updated_at <= after_add.updated_at <= after_second.updated_at
    assert after_second.updated_at > conv.updated_at
    assert after_second.created_at == conv.created_at
