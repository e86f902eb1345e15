"""Alembic migrations against real SQLite and PostgreSQL: upgrade, downgrade, and no drift from the models."""

from __future__ import annotations

import asyncio
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from app.db.migrate import downgrade_database, upgrade_database
from app.db.models import Base
from app.db.session import create_engine

APP_TABLES = {"conversations", "messages", "runs", "run_events"}


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

    partial = schema["indexes"]["ux_runs_one_running_per_conversation"]
    assert partial["unique"]
    assert partial["column_names"] == ["conversation_id"]
    (where,) = (v for k, v in partial["dialect_options"].items() if k.endswith("_where"))
    assert "running" in str(where)
    assert schema["fks"] == {
        "fk_messages_conversation_id_conversations",
        "fk_runs_conversation_id_conversations",
        "fk_run_events_conversation_id_conversations",
    }
    assert schema["pk"]["name"] == "pk_run_events"
    assert schema["pk"]["constrained_columns"] == ["conversation_id", "cursor_ms", "cursor_seq"]
