"""Alembic migrations against real SQLite and PostgreSQL: upgrade, downgrade, and no drift from the models."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import NullPool

from app.db.migrate import downgrade_database, upgrade_database
from app.db.models import Base
from app.db.repositories import ConversationRepo, EventRepo, RunRecord, RunRepo
from app.db.repositories.approvals import ApprovalRepo, NewApproval
from app.db.repositories.push_configs import NewPushConfig, PushConfigRepo
from app.db.repositories.rows import path_to
from app.db.repositories.run_start import UNDER_HEAD, Placement
from app.db.session import Database, create_engine
from app.llm.base import ChatMessage, ToolCall
from app.webhooks.outbox import NewDelivery
from tests.support.outbox import InspectableOutbox

APP_TABLES = {
    "conversations",
    "messages",
    "runs",
    "run_events",
    "run_checkpoints",
    "follow_ups",
    "notes",
    "tool_effects",
    "approvals",
    "face_threads",
    "webhook_deliveries",
    "push_configs",
}


async def inspect_database(url: str, look: Any) -> Any:
    engine = create_engine(url, poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(look)
    finally:
        await engine.dispose()


def table_names(conn: Connection) -> set[str]:
    return set(inspect(conn).get_table_names())


def schema_diff(conn: Connection) -> list[Any]:
    context = MigrationContext.configure(conn, opts={"compare_type": True})
    return compare_metadata(context, Base.metadata)


async def test_upgrade_creates_the_schema_and_downgrade_to_base_removes_it(database_url: str) -> None:
    await asyncio.to_thread(upgrade_database, database_url)
    assert APP_TABLES <= await inspect_database(database_url, table_names)

    await asyncio.to_thread(downgrade_database, database_url, "base")
    assert await inspect_database(database_url, table_names) & APP_TABLES == set()


async def test_upgrade_twice_is_a_no_op(database_url: str) -> None:
    await asyncio.to_thread(upgrade_database, database_url)
    await asyncio.to_thread(upgrade_database, database_url)

    assert APP_TABLES <= await inspect_database(database_url, table_names)


async def test_migrated_schema_matches_the_models_exactly(database_url: str) -> None:
    await asyncio.to_thread(upgrade_database, database_url)

    assert await inspect_database(database_url, schema_diff) == []


async def test_models_without_migrations_differ_from_an_empty_database(database_url: str) -> None:
    # Guards the comparison above: on an unmigrated database it must report the missing tables.
    diff = await inspect_database(database_url, schema_diff)

    added = {entry[1].name for entry in diff if entry[0] == "add_table"}
    assert added == APP_TABLES


async def test_migrated_schema_keeps_the_partial_unique_index_and_named_constraints(
    database_url: str,
) -> None:
    await asyncio.to_thread(upgrade_database, database_url)

    def look(conn: Connection) -> dict[str, Any]:
        inspector = inspect(conn)
        return {
            "indexes": {ix["name"]: ix for ix in inspector.get_indexes("runs")},
            "fks": {fk["name"] for table in APP_TABLES for fk in inspector.get_foreign_keys(table)},
            "pk": inspector.get_pk_constraint("run_events"),
        }

    schema = await inspect_database(database_url, look)

    partial = schema["indexes"]["ux_runs_one_active_per_conversation"]
    assert partial["unique"]
    assert partial["column_names"] == ["conversation_id"]
    (where,) = (v for k, v in partial["dialect_options"].items() if k.endswith("_where"))
    assert all(status in str(where) for status in ("queued", "running", "waiting"))
    assert "completed" not in str(where)
    assert schema["fks"] == {
        "fk_messages_conversation_id_conversations",
        "fk_runs_conversation_id_conversations",
        "fk_run_events_conversation_id_conversations",
        "fk_run_checkpoints_run_id_runs",
        "fk_follow_ups_conversation_id_conversations",
        "fk_approvals_conversation_id_conversations",
        "fk_approvals_run_id_runs",
        "fk_face_threads_conversation_id_conversations",
        "fk_push_configs_run_id_runs",
    }
    assert schema["pk"]["name"] == "pk_run_events"
    assert schema["pk"]["constrained_columns"] == ["conversation_id", "cursor_ms", "cursor_seq"]


FINISHED_RUN = {
    "id": "run_old",
    "conversation_id": "conv_old",
    "owner": "alice",
    "status": "completed",
    "message": "What is 2+2?",
    "answer": "4",
    "iterations": 2,
    "usage": '{"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12, "llm_calls": 3}',
    "elapsed": 1.5,
    "error": None,
    "pending_injections": "[]",
    "start_cursor": "0-0",
    "worker_id": None,
    "lease_expires_at": None,
    "created_at": datetime(2026, 11, 1, 12, 0, tzinfo=UTC),
    "finished_at": datetime(2026, 11, 1, 12, 0, 2, tzinfo=UTC),
}


async def execute(url: str, statement: str, params: dict[str, Any] | None = None) -> None:
    engine = create_engine(url, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(statement), params or {})
    finally:
        await engine.dispose()


async def test_a_database_of_the_previous_version_upgrades_with_its_finished_runs_intact(
    database_url: str,
) -> None:
    await asyncio.to_thread(upgrade_database, database_url, "0001")
    now = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    await execute(
        database_url,
        "INSERT INTO conversations (id, owner, title, agent_config, created_at, updated_at) "
        "VALUES ('conv_old', 'alice', 'old', '{}', :now, :now)",
        {"now": now},
    )
    await execute(
        database_url,
        "INSERT INTO runs (id, conversation_id, owner, status, message, answer, iterations, usage, "
        "elapsed, error, pending_injections, start_cursor, worker_id, lease_expires_at, created_at, "
        "finished_at) VALUES (:id, :conversation_id, :owner, :status, :message, :answer, :iterations, "
        ":usage, :elapsed, :error, :pending_injections, :start_cursor, :worker_id, :lease_expires_at, "
        ":created_at, :finished_at)",
        FINISHED_RUN,
    )
    await execute(
        database_url,
        "INSERT INTO run_events (conversation_id, cursor_ms, cursor_seq, run_id, id, event, data) "
        "VALUES ('conv_old', 5, 0, 'run_old', '5-0', 'done', '{\"answer\": \"4\"}')",
    )

    await asyncio.to_thread(upgrade_database, database_url)

    db = Database(database_url)
    try:
        run = await RunRepo(db.sessionmaker).get("alice", "run_old")
        events = await EventRepo(db.sessionmaker).for_run("run_old")
    finally:
        await db.dispose()
    assert run is not None
    assert (run.status, run.answer, run.iterations, run.usage["llm_calls"]) == ("completed", "4", 2, 3)
    assert (run.attempt, run.lost_attempts, run.cancel_requested) == (1, 0, False)
    assert [(e.id, e.event) for e in events] == [("5-0", "done")]

    # And back: the previous version reads it as it was.
    await asyncio.to_thread(downgrade_database, database_url, "0001")
    tables = await inspect_database(database_url, table_names)
    assert "run_checkpoints" not in tables and "runs" in tables
    indexes = await inspect_database(
        database_url, lambda c: {i["name"] for i in inspect(c).get_indexes("runs")}
    )
    assert "ux_runs_one_running_per_conversation" in indexes


async def scalar(url: str, statement: str) -> Any:
    engine = create_engine(url, poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            return (await conn.execute(text(statement))).scalar()
    finally:
        await engine.dispose()


async def test_the_approvals_revision_keeps_runs_and_their_checkpoints_and_undoes_cleanly(
    database_url: str,
) -> None:
    # 0003 rebuilds the runs table on SQLite: the rows that hang on runs must survive it.
    await asyncio.to_thread(upgrade_database, database_url, "0002")
    now = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    await execute(
        database_url,
        "INSERT INTO conversations (id, owner, title, agent_config, created_at, updated_at) "
        "VALUES ('conv_old', 'alice', 'old', '{}', :now, :now)",
        {"now": now},
    )
    running = {**FINISHED_RUN, "id": "run_live", "status": "running", "finished_at": None}
    columns = ", ".join(running)
    await execute(
        database_url, f"INSERT INTO runs ({columns}) VALUES ({', '.join(':' + c for c in running)})", running
    )
    await execute(
        database_url,
        "INSERT INTO run_checkpoints (run_id, attempt, seq, after, data, created_at) "
        "VALUES ('run_live', 1, 0, '5-0', '{\"v\": []}', :now)",
        {"now": now},
    )

    await asyncio.to_thread(upgrade_database, database_url)

    assert await scalar(database_url, "SELECT count(*) FROM run_checkpoints") == 1
    assert await scalar(database_url, "SELECT status FROM runs WHERE id = 'run_live'") == "running"
    # A waiting run is a status the new check admits; one active run per conversation still holds.
    await execute(database_url, "UPDATE runs SET status = 'waiting' WHERE id = 'run_live'")
    second = {**running, "id": "run_second", "status": "queued"}
    with pytest.raises(IntegrityError):
        await execute(
            database_url,
            f"INSERT INTO runs ({columns}) VALUES ({', '.join(':' + c for c in second)})",
            second,
        )

    # Back to 0002, which knows no waiting run: it ends as failed, with the reason.
    await asyncio.to_thread(downgrade_database, database_url, "0002")
    assert await scalar(database_url, "SELECT status FROM runs WHERE id = 'run_live'") == "failed"
    assert await scalar(database_url, "SELECT count(*) FROM run_checkpoints") == 1
    assert "approvals" not in await inspect_database(database_url, table_names)


async def test_the_message_reasoning_revision_keeps_messages_and_stores_reasoning_both_ways(
    database_url: str,
) -> None:
    await asyncio.to_thread(upgrade_database, database_url, "0003")
    now = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    await execute(
        database_url,
        "INSERT INTO conversations (id, owner, title, agent_config, created_at, updated_at) "
        "VALUES ('conv_old', 'alice', 'old', '{}', :now, :now)",
        {"now": now},
    )
    await execute(
        database_url,
        "INSERT INTO messages (conversation_id, run_id, seq, role, content, tool_calls, pinned, created_at) "
        "VALUES ('conv_old', NULL, 0, 'user', 'hi', NULL, false, :now)",
        {"now": now},
    )

    await asyncio.to_thread(upgrade_database, database_url)

    assert await scalar(database_url, "SELECT content FROM messages WHERE seq = 0") == "hi"
    assert await scalar(database_url, "SELECT reasoning FROM messages WHERE seq = 0") is None
    await execute(
        database_url,
        "INSERT INTO messages (conversation_id, run_id, seq, role, content, tool_calls, pinned, created_at, "
        "reasoning, parent_seq) "
        "VALUES ('conv_old', NULL, 1, 'assistant', 'ok', NULL, false, :now, 'thought', 0)",
        {"now": now},
    )
    # As this version stores it: below the first message, the conversation's current leaf now.
    await execute(database_url, "UPDATE conversations SET head_seq = 1 WHERE id = 'conv_old'")
    assert await scalar(database_url, "SELECT reasoning FROM messages WHERE seq = 1") == "thought"

    await asyncio.to_thread(downgrade_database, database_url, "0003")
    columns = await inspect_database(
        database_url, lambda c: {col["name"] for col in inspect(c).get_columns("messages")}
    )
    assert "reasoning" not in columns
    assert await scalar(database_url, "SELECT count(*) FROM messages") == 2


def run_columns(conn: Connection) -> set[str]:
    return {col["name"] for col in inspect(conn).get_columns("runs")}


async def finished_run_at(database_url: str, revision: str) -> None:
    """A database at ``revision`` holding one finished run (``run_old``, of ``conv_old``)."""
    await asyncio.to_thread(upgrade_database, database_url, revision)
    now = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    await execute(
        database_url,
        "INSERT INTO conversations (id, owner, title, agent_config, created_at, updated_at) "
        "VALUES ('conv_old', 'alice', 'old', '{}', :now, :now)",
        {"now": now},
    )
    columns = ", ".join(FINISHED_RUN)
    await execute(
        database_url,
        f"INSERT INTO runs ({columns}) VALUES ({', '.join(':' + c for c in FINISHED_RUN)})",
        FINISHED_RUN,
    )


async def the_old_run(database_url: str) -> RunRecord:
    """``run_old`` (of ``finished_run_at``) as the repository reads it now."""
    db = Database(database_url)
    try:
        run = await RunRepo(db.sessionmaker).get("alice", "run_old")
    finally:
        await db.dispose()
    assert run is not None
    return run


async def test_the_run_model_revision_adds_model_and_trace_id_as_null_and_undoes_cleanly(
    database_url: str,
) -> None:
    await finished_run_at(database_url, "0004")

    await asyncio.to_thread(upgrade_database, database_url)

    assert {"model", "trace_id"} <= await inspect_database(database_url, run_columns)
    run = await the_old_run(database_url)
    assert (run.model, run.trace_id) == (None, None)
    assert (run.status, run.answer, run.iterations, run.usage["llm_calls"]) == ("completed", "4", 2, 3)
    assert run.finished_at == FINISHED_RUN["finished_at"]

    # And back: 0004 knows neither column, and keeps the run.
    await asyncio.to_thread(downgrade_database, database_url, "0004")
    assert await inspect_database(database_url, run_columns) & {"model", "trace_id"} == set()
    assert await scalar(database_url, "SELECT count(*) FROM runs") == 1
    assert await scalar(database_url, "SELECT answer FROM runs WHERE id = 'run_old'") == "4"
    assert await scalar(database_url, "SELECT status FROM runs WHERE id = 'run_old'") == "completed"


async def test_the_trace_parent_revision_adds_a_null_column_and_undoes_cleanly(database_url: str) -> None:
    await finished_run_at(database_url, "0005")
    await asyncio.to_thread(upgrade_database, database_url)

    assert "trace_parent" in await inspect_database(database_url, run_columns)
    run = await the_old_run(database_url)
    assert (run.trace_id, run.trace_parent, run.status, run.answer) == (None, None, "completed", "4")

    await asyncio.to_thread(downgrade_database, database_url, "0005")
    assert "trace_parent" not in await inspect_database(database_url, run_columns)
    assert await scalar(database_url, "SELECT answer FROM runs WHERE id = 'run_old'") == "4"


async def test_the_run_queue_revision_indexes_the_queue_and_its_downgrade_hands_queued_runs_on(
    database_url: str,
) -> None:
    await finished_run_at(database_url, "0006")
    await asyncio.to_thread(upgrade_database, database_url)

    def run_indexes(conn: Connection) -> set[str]:
        return {index["name"] for index in inspect(conn).get_indexes("runs")}

    assert {"ix_runs_status_created_at", "ix_runs_owner_status"} <= await inspect_database(
        database_url, run_indexes
    )
    await execute(
        database_url,
        "UPDATE runs SET status = 'queued', finished_at = NULL, worker_id = NULL WHERE id = 'run_old'",
    )

    # 0006 starts no queued run, but carries on a running run no worker holds: nothing is lost.
    await asyncio.to_thread(downgrade_database, database_url, "0006")
    assert (
        await inspect_database(database_url, run_indexes)
        & {
            "ix_runs_status_created_at",
            "ix_runs_owner_status",
        }
        == set()
    )
    assert await scalar(database_url, "SELECT status FROM runs WHERE id = 'run_old'") == "running"
    assert await scalar(database_url, "SELECT worker_id FROM runs WHERE id = 'run_old'") is None


def old_message(
    conversation: str, seq: int, role: str, content: str | None, run_id: str | None, **more: Any
) -> dict[str, Any]:
    """A row of ``messages`` as revision 0007 stored it: one list a conversation, in ``seq`` order."""
    return {
        "conversation_id": conversation,
        "run_id": run_id,
        "seq": seq,
        "role": role,
        "content": content,
        "tool_calls": more.get("tool_calls"),
        "tool_call_id": more.get("tool_call_id"),
        "name": None,
        "pinned": more.get("pinned", False),
        "created_at": datetime(2026, 11, 1, 12, 0, seq, tzinfo=UTC),
        "reasoning": None,
    }


CALL = {"id": "call_1", "name": "calculator", "arguments": '{"expression": "4*3"}'}
OLD_MESSAGES = {
    "conv_a": [
        ("user", "What is 2+2?", "run_a1", {}),
        ("assistant", "4", "run_a1", {}),
        ("user", "And times 3?", "run_a2", {}),
        ("assistant", None, "run_a2", {"tool_calls": json.dumps([CALL])}),
        ("tool", "4*3 = 12", "run_a2", {"tool_call_id": "call_1"}),
        ("assistant", "Twelve.", "run_a2", {}),
        ("user", "in words, please", None, {"pinned": True}),  # a follow-up no run took in
        ("user", "Thanks!", "run_a3", {}),  # a run that failed before it answered
    ],
    "conv_b": [
        ("user", "Hello", "run_b1", {}),
        ("assistant", "Hi!", "run_b1", {}),
        ("user", "Bye", "run_b2", {}),
        ("assistant", "Bye!", "run_b2", {}),
    ],
}
OLD_RUNS = {
    "run_a1": "conv_a",
    "run_a2": "conv_a",
    "run_a3": "conv_a",
    "run_b1": "conv_b",
    "run_b2": "conv_b",
}


async def test_the_branches_revision_makes_each_old_conversation_one_chain_that_reads_as_before(
    database_url: str,
) -> None:
    await asyncio.to_thread(upgrade_database, database_url, "0007")
    now = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    for conv, owner in (("conv_a", "alice"), ("conv_b", "bob")):
        await execute(
            database_url,
            "INSERT INTO conversations (id, owner, title, agent_config, created_at, updated_at) "
            "VALUES (:id, :owner, 'old', '{}', :now, :now)",
            {"id": conv, "owner": owner, "now": now},
        )
    for run_id, conv in OLD_RUNS.items():
        row = {
            **FINISHED_RUN,
            "id": run_id,
            "conversation_id": conv,
            "owner": "alice" if conv == "conv_a" else "bob",
            "status": "failed" if run_id == "run_a3" else "completed",
        }
        await execute(
            database_url,
            f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join(':' + c for c in row)})",
            row,
        )
    # The two conversations' messages stored in turns, so that their ids interleave.
    rows = [
        old_message(conv, seq, role, content, run_id, **more)
        for seq in range(max(len(m) for m in OLD_MESSAGES.values()))
        for conv, messages in OLD_MESSAGES.items()
        if seq < len(messages)
        for role, content, run_id, more in [messages[seq]]
    ]
    for row in rows:
        await execute(
            database_url,
            f"INSERT INTO messages ({', '.join(row)}) VALUES ({', '.join(':' + c for c in row)})",
            row,
        )

    await asyncio.to_thread(upgrade_database, database_url)

    chains = await rows_of(
        database_url, "SELECT conversation_id, seq, parent_seq FROM messages ORDER BY conversation_id, seq"
    )
    assert chains == [
        (conv, seq, seq - 1 if seq else None)
        for conv, messages in OLD_MESSAGES.items()
        for seq in range(len(messages))
    ]
    assert await rows_of(database_url, "SELECT id, head_seq FROM conversations ORDER BY id") == [
        (conv, len(messages) - 1) for conv, messages in OLD_MESSAGES.items()
    ]
    first_of_run = {
        run_id: min(seq for seq, m in enumerate(OLD_MESSAGES[conv]) if m[2] == run_id)
        for run_id, conv in OLD_RUNS.items()
    }
    assert dict(await rows_of(database_url, "SELECT id, question_seq FROM runs")) == first_of_run

    db = Database(database_url)
    try:
        conversations, runs = ConversationRepo(db.sessionmaker), RunRepo(db.sessionmaker)
        histories = {conv: await conversations.history(conv) for conv in OLD_MESSAGES}
        records = {conv: await conversations.messages(conv) for conv in OLD_MESSAGES}
        before_run = {}
        for run_id, conv in OLD_RUNS.items():
            run = await runs.get("alice" if conv == "conv_a" else "bob", run_id)
            assert run is not None
            before_run[run_id] = await runs.history_before(run)
    finally:
        await db.dispose()
    for conv, messages in OLD_MESSAGES.items():
        expected = [
            ChatMessage(
                role=role,  # type: ignore[arg-type]
                content=content,
                tool_calls=(ToolCall(**CALL),) if "tool_calls" in more else (),
                tool_call_id=more.get("tool_call_id"),
                pinned=more.get("pinned", False),
            )
            for role, content, _, more in messages
        ]
        assert histories[conv] == expected
        assert [r.to_chat_message() for r in records[conv]] == expected
        assert [r.run_id for r in records[conv]] == [run_id for _, _, run_id, _ in messages]
        for run_id, of in OLD_RUNS.items():
            if of == conv:
                assert before_run[run_id] == expected[: first_of_run[run_id]], run_id


async def rows_of(url: str, statement: str) -> list[tuple[Any, ...]]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            return [tuple(row) for row in await conn.execute(text(statement))]
    finally:
        await engine.dispose()


async def test_the_branches_revision_downgrade_keeps_the_current_path_and_drops_client_tool_calls(
    database_url: str,
) -> None:
    await asyncio.to_thread(upgrade_database, database_url)
    db = Database(database_url)
    try:
        conversations, runs = ConversationRepo(db.sessionmaker), RunRepo(db.sessionmaker)
        approvals = ApprovalRepo(db.sessionmaker)
        conv = await conversations.create("alice", "branched", {})
        waiting = await conversations.create("alice", "waiting", {})

        async def turn(question: str, answer: str, placement: Placement = UNDER_HEAD) -> None:
            run, _ = await runs.start(
                conv.id,
                "alice",
                question,
                worker_id="w1",
                lease_s=30,
                start_cursor="0-0",
                placement=placement,
            )
            await runs.finish(
                run.id,
                status="completed",
                answer=answer,
                iterations=1,
                usage={},
                elapsed=0.1,
                error=None,
                pending_injections=[],
                messages=[ChatMessage(role="assistant", content=answer)],
                conversation_id=conv.id,
            )

        await turn("first question", "first answer")
        await turn("second question", "second answer")
        seqs = {m.content: m.seq for m in await conversations.messages(conv.id)}
        # An edit of the second question, then back to the older branch: the current path is not
        # the newest one.
        await turn(
            "second question, edited",
            "edited answer",
            Placement(under_head=False, parent_seq=seqs["first answer"]),
        )
        await conversations.switch(conv.id, seqs["second question"])
        kept = [
            (m.role, m.content)
            for m in path_to(await conversations.messages(conv.id), await conversations.head(conv.id))
        ]
        assert kept == [
            ("user", "first question"),
            ("assistant", "first answer"),
            ("user", "second question"),
            ("assistant", "second answer"),
        ]
        # A run waiting for a person's approval and for a tool the client runs.
        run, _ = await runs.start(
            waiting.id, "alice", "use both tools", worker_id="w1", lease_s=30, start_cursor="0-0"
        )
        expires = datetime(2099, 1, 1, tzinfo=UTC)
        for kind, call in (("approval", "call_a"), ("client", "call_c")):
            await approvals.request(
                NewApproval(
                    f"apr_{kind}", run.id, waiting.id, "alice", call, f"{kind}_tool", {}, 1, expires, kind
                )
            )
        assert await approvals.park(run.id, 1, "w1") == "waiting"
        assert (await runs.get("alice", run.id)).status == "waiting"  # type: ignore[union-attr]
    finally:
        await db.dispose()

    await asyncio.to_thread(downgrade_database, database_url, "0007")

    assert (
        await rows_of(
            database_url,
            f"SELECT role, content FROM messages WHERE conversation_id = '{conv.id}' ORDER BY seq",
        )
        == kept
    )
    assert await rows_of(
        database_url, f"SELECT role, content FROM messages WHERE conversation_id = '{waiting.id}'"
    ) == [("user", "use both tools")]
    assert await rows_of(database_url, "SELECT id, status FROM approvals") == [("apr_approval", "pending")]
    ((status, error),) = await rows_of(database_url, f"SELECT status, error FROM runs WHERE id = '{run.id}'")
    assert status == "failed" and "downgraded" in error
    columns = await inspect_database(
        database_url,
        lambda c: {
            t: {col["name"] for col in inspect(c).get_columns(t)} for t in ("messages", "approvals", "runs")
        },
    )
    assert not columns["messages"] & {"parent_seq"} and not columns["approvals"] & {"kind", "output"}
    assert not columns["runs"] & {"question_seq", "client_tools", "replay_of"}

    # Upgraded again, the kept path is the conversation's one chain.
    await asyncio.to_thread(upgrade_database, database_url)
    db = Database(database_url)
    try:
        history = await ConversationRepo(db.sessionmaker).history(conv.id)
    finally:
        await db.dispose()
    assert [(m.role, m.content) for m in history] == kept


async def test_the_webhooks_revision_adds_the_outbox_and_push_configs_and_undoes_cleanly(
    database_url: str,
) -> None:
    await finished_run_at(database_url, "0009")
    await asyncio.to_thread(upgrade_database, database_url)

    run = await the_old_run(database_url)
    assert (run.webhook, run.status, run.answer) == (None, "completed", "4")
    db = Database(database_url)
    try:
        owed = NewDelivery("run", "run_old", "completed", "https://x.example/h", "{}")
        await InspectableOutbox(db.sessionmaker).enqueue([owed])
        config = NewPushConfig("c", "https://x.example/p")
        assert await PushConfigRepo(db.sessionmaker).create("alice", "run_old", config)
    finally:
        await db.dispose()

    # And back: 0009 has no outbox, no push configs, no webhook column, and keeps the run.
    await asyncio.to_thread(downgrade_database, database_url, "0009")
    assert await inspect_database(database_url, table_names) & {"webhook_deliveries", "push_configs"} == set()
    assert "webhook" not in await inspect_database(database_url, run_columns)
    assert await scalar(database_url, "SELECT answer FROM runs WHERE id = 'run_old'") == "4"
    await asyncio.to_thread(upgrade_database, database_url)
    assert await inspect_database(database_url, schema_diff) == []


def delivery_indexes(conn: Connection) -> set[str]:
    return {i["name"] for i in inspect(conn).get_indexes("webhook_deliveries")}


async def test_the_webhook_hosts_revision_keeps_what_is_owed_and_undoes_cleanly(database_url: str) -> None:
    # A delivery owed when 0010 was the schema (no host): claimed after the upgrade, told by its URL.
    await asyncio.to_thread(upgrade_database, database_url, "0010")
    now = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    await execute(
        database_url,
        "INSERT INTO webhook_deliveries (id, kind, run_id, event, url, headers, body, created_at, "
        "next_attempt_at, attempts) VALUES ('wh_old', 'run', 'run_old', 'completed', "
        "'https://Hooks.example.com/in', '{}', '{}', :now, :now, 0)",
        {"now": now},
    )

    await asyncio.to_thread(upgrade_database, database_url)

    assert {
        "ix_webhook_deliveries_delivered_at",
        "ix_webhook_deliveries_given_up_at",
    } <= await inspect_database(database_url, delivery_indexes)
    db = Database(database_url)
    try:
        outbox = InspectableOutbox(db.sessionmaker)
        assert await outbox.claim("w", 5, 30, skip_hosts={"hooks.example.com"}) != []  # no host stored
        stored = await outbox.get("wh_old")
    finally:
        await db.dispose()
    assert stored is not None and (stored.host, stored.attempts) == ("hooks.example.com", 1)

    # And back: 0010's outbox without the column and the indexes, the delivery still owed.
    await asyncio.to_thread(downgrade_database, database_url, "0010")
    columns = await inspect_database(
        database_url, lambda c: {col["name"] for col in inspect(c).get_columns("webhook_deliveries")}
    )
    assert "host" not in columns
    assert not {"ix_webhook_deliveries_delivered_at", "ix_webhook_deliveries_given_up_at"} & (
        await inspect_database(database_url, delivery_indexes)
    )
    assert await scalar(database_url, "SELECT attempts FROM webhook_deliveries WHERE id = 'wh_old'") == 1
    await asyncio.to_thread(upgrade_database, database_url)
    assert await inspect_database(database_url, schema_diff) == []
