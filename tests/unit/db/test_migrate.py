"""The Alembic set-up: one linear history, and offline SQL that builds the models' schema."""

from __future__ import annotations

import io

import pytest
from alembic import command
from alembic.script import ScriptDirectory

from app.db.migrate import MIGRATIONS_DIR, alembic_config


def test_the_migration_history_has_a_single_head_starting_at_0001() -> None:
    script = ScriptDirectory.from_config(alembic_config("sqlite+aiosqlite:///unused.db"))

    assert script.get_heads() == [script.get_current_head()]
    assert [rev.revision for rev in script.walk_revisions()][-1] == "0001"
    assert (MIGRATIONS_DIR / "env.py").is_file()


@pytest.mark.parametrize(
    ("url", "partial_index"),
    [
        (
            "sqlite+aiosqlite:///unused.db",
            "CREATE UNIQUE INDEX ux_runs_one_active_per_conversation ON runs (conversation_id) "
            "WHERE status IN ('queued', 'running', 'waiting')",
        ),
        (
            "postgresql+asyncpg://u@nowhere/app",
            "CREATE UNIQUE INDEX ux_runs_one_active_per_conversation ON runs (conversation_id) "
            "WHERE status IN ('queued', 'running', 'waiting')",
        ),
    ],
    ids=["sqlite", "postgresql"],
)
def test_offline_upgrade_emits_the_schema_without_a_connection(url: str, partial_index: str) -> None:
    config = alembic_config(url)
    config.output_buffer = io.StringIO()

    command.upgrade(config, "head", sql=True)

    sql = config.output_buffer.getvalue()
    for table in ("conversations", "messages", "runs", "run_events", "run_checkpoints", "follow_ups"):
        assert f"CREATE TABLE {table} (" in sql
    assert "ALTER TABLE runs ADD COLUMN attempt" in sql
    assert partial_index in sql
    assert "ON DELETE CASCADE" in sql
