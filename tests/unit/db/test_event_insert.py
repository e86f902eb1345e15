"""The event store's INSERT at the driver (``insert_event_values``): which drivers get it."""

from __future__ import annotations

from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.dialects.postgresql.psycopg import PGDialectAsync_psycopg
from sqlalchemy.dialects.sqlite.aiosqlite import SQLiteDialect_aiosqlite

from app.db.repositories.rows import _event_insert_sql


def test_positional_drivers_get_one_statement_with_every_column_in_order() -> None:
    sqlite = _event_insert_sql(SQLiteDialect_aiosqlite())
    asyncpg = _event_insert_sql(PGDialect_asyncpg())

    columns = "(conversation_id, cursor_ms, cursor_seq, run_id, id, event, data)"
    assert sqlite is not None and columns in sqlite and sqlite.count("?") == 7
    assert asyncpg is not None and columns in asyncpg and "$7" in asyncpg
    assert "ON CONFLICT DO NOTHING" in sqlite and "ON CONFLICT DO NOTHING" in asyncpg


def test_a_driver_with_named_parameters_is_left_to_the_orm_even_after_asyncpg() -> None:
    # Both PostgreSQL drivers are dialect "postgresql": asyncpg's statement must not reach psycopg.
    assert _event_insert_sql(PGDialect_asyncpg()) is not None

    assert _event_insert_sql(PGDialectAsync_psycopg()) is None
