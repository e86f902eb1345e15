"""The table definitions: UTC datetimes, constraint names, the one-running-run index."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex

from app.db.models import Base, Run, UTCDateTime

SQLITE = sqlite.dialect()
PARIS_SUMMER = timezone(timedelta(hours=2))


def test_utc_datetime_stores_aware_values_converted_to_utc() -> None:
    stored = UTCDateTime().process_bind_param(datetime(2025, 6, 1, 14, 0, tzinfo=PARIS_SUMMER), SQLITE)

    assert stored == datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
    assert stored is not None and stored.utcoffset() == timedelta(0)


def test_utc_datetime_refuses_naive_values() -> None:
    with pytest.raises(ValueError, match="naive"):
        UTCDateTime().process_bind_param(datetime(2025, 6, 1, 12, 0), SQLITE)  # noqa: DTZ001


def test_utc_datetime_reads_naive_sqlite_values_as_utc() -> None:
    read = UTCDateTime().process_result_value(datetime(2025, 6, 1, 12, 0), SQLITE)  # noqa: DTZ001

    assert read == datetime(2025, 6, 1, 12, 0, tzinfo=UTC) and read is not None and read.tzinfo == UTC


def test_utc_datetime_passes_none_through() -> None:
    assert UTCDateTime().process_bind_param(None, SQLITE) is None
    assert UTCDateTime().process_result_value(None, SQLITE) is None


def test_every_constraint_and_index_has_a_convention_name() -> None:
    names = {
        str(item.name)
        for table in Base.metadata.sorted_tables
        for item in [*table.constraints, *table.indexes]
    }

    assert names == {
        "pk_conversations",
        "ix_conversations_owner",
        "pk_messages",
        "fk_messages_conversation_id_conversations",
        "uq_messages_conversation_id_seq",
        "pk_runs",
        "fk_runs_conversation_id_conversations",
        "ck_runs_status",
        "ix_runs_conversation_id",
        "ux_runs_one_active_per_conversation",
        "ix_runs_status_created_at",
        "ix_runs_owner_status",
        "pk_run_events",
        "fk_run_events_conversation_id_conversations",
        "ix_run_events_run_id",
        "pk_run_checkpoints",
        "fk_run_checkpoints_run_id_runs",
        "pk_follow_ups",
        "fk_follow_ups_conversation_id_conversations",
        "ix_follow_ups_conversation_id_id",
        "pk_notes",
        "pk_tool_effects",
        "ix_tool_effects_created_at",
        "pk_approvals",
        "ck_approvals_status",
        "fk_approvals_run_id_runs",
        "fk_approvals_conversation_id_conversations",
        "ix_approvals_run_id",
        "ix_approvals_conversation_id",
        "ix_approvals_owner_status_created_at",
        "ix_approvals_status_expires_at",
        "pk_face_threads",
        "fk_face_threads_conversation_id_conversations",
        "ix_face_threads_conversation_id",
        "pk_webhook_deliveries",
        "ix_webhook_deliveries_due",
        "ix_webhook_deliveries_run_id",
        "ix_webhook_deliveries_delivered_at",
        "ix_webhook_deliveries_given_up_at",
        "pk_push_configs",
        "fk_push_configs_run_id_runs",
        "uq_push_configs_run_id_config_id",
    }


def test_foreign_keys_cascade_deletes_from_conversations() -> None:
    fks = [fk for table in Base.metadata.sorted_tables for fk in table.foreign_keys]

    # Everything of a conversation goes with it: checkpoints, approvals and push configs through
    # their run too. Not the webhooks' outbox: what is owed is owed still.
    assert len(fks) == 9
    assert {fk.column.table.name for fk in fks} == {"conversations", "runs"}
    assert all(fk.ondelete == "CASCADE" for fk in fks)
    through_run = {fk.parent.table.name for fk in fks if fk.column.table.name == "runs"}
    assert through_run == {"run_checkpoints", "approvals", "push_configs"}


@pytest.mark.parametrize("dialect", [sqlite.dialect(), postgresql.dialect()], ids=["sqlite", "postgresql"])
def test_only_one_active_run_index_is_partial_on_both_dialects(dialect: object) -> None:
    (index,) = (ix for ix in Run.__table__.indexes if ix.name == "ux_runs_one_active_per_conversation")

    ddl = str(CreateIndex(index).compile(dialect=dialect))  # type: ignore[arg-type]

    assert ddl.startswith("CREATE UNIQUE INDEX ux_runs_one_active_per_conversation ON runs (conversation_id)")
    assert ddl.rstrip().endswith("WHERE status IN ('queued', 'running', 'waiting')")
