"""Approvals: runs that wait for a person (status ``waiting``), and the approvals they wait for.

The runs' status check admits ``waiting`` (and ``queued``, for the run queue), and the partial
unique index that allows one running run per conversation becomes one active run (queued, running
or waiting) per conversation.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 16:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATUSES = "status IN ('running', 'completed', 'failed', 'cancelled')"
NEW_STATUSES = "status IN ('queued', 'running', 'waiting', 'completed', 'failed', 'cancelled')"
OLD_INDEX, OLD_WHERE = "ux_runs_one_running_per_conversation", "status = 'running'"
NEW_INDEX, NEW_WHERE = "ux_runs_one_active_per_conversation", "status IN ('queued', 'running', 'waiting')"


def _index(name: str, where: str) -> None:
    op.create_index(
        name,
        "runs",
        ["conversation_id"],
        unique=True,
        sqlite_where=sa.text(where),
        postgresql_where=sa.text(where),
    )


def _runs_table(statuses: str) -> sa.Table:
    """The runs table as revisions 0002 and 0003 have it, with the status check ``statuses``:
    batch mode copies it from here, so that the upgrade can be written out as SQL offline too."""
    return sa.Table(
        "runs",
        sa.MetaData(),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("conversation_id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("answer", sa.Text(), nullable=True),
        sa.Column("iterations", sa.Integer(), nullable=False),
        sa.Column("usage", sa.JSON(), nullable=False),
        sa.Column("elapsed", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("pending_injections", sa.JSON(), nullable=False),
        sa.Column("start_cursor", sa.String(length=64), nullable=False),
        sa.Column("worker_id", sa.String(length=200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("lost_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.CheckConstraint(statuses, name="ck_runs_status"),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name="fk_runs_conversation_id_conversations",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.Index("ix_runs_conversation_id", "conversation_id"),
    )


def _statuses(old: str, new: str) -> None:
    if op.get_context().dialect.name != "sqlite":
        op.drop_constraint(op.f("ck_runs_status"), "runs", type_="check")
        op.create_check_constraint(op.f("ck_runs_status"), "runs", new)
        return
    # A check constraint cannot be altered in place on SQLite: batch mode rebuilds the table.
    with op.batch_alter_table("runs", copy_from=_runs_table(old), recreate="always") as batch:
        batch.drop_constraint(op.f("ck_runs_status"), type_="check")
        batch.create_check_constraint(op.f("ck_runs_status"), new)


def upgrade() -> None:
    op.drop_index(OLD_INDEX, table_name="runs")
    _statuses(OLD_STATUSES, NEW_STATUSES)
    _index(NEW_INDEX, NEW_WHERE)

    op.create_table(
        "approvals",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("conversation_id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("call_id", sa.String(length=200), nullable=False),
        sa.Column("tool_name", sa.String(length=200), nullable=False),
        sa.Column("tool_args", sa.JSON(), nullable=False),
        sa.Column("iteration", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("decided_args", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("decided_by", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'approved', 'denied', 'expired', 'cancelled')",
            name=op.f("ck_approvals_status"),
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name=op.f("fk_approvals_conversation_id_conversations"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_approvals_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_approvals")),
    )
    op.create_index("ix_approvals_run_id", "approvals", ["run_id"])
    op.create_index("ix_approvals_conversation_id", "approvals", ["conversation_id"])
    op.create_index("ix_approvals_owner_status_created_at", "approvals", ["owner", "status", "created_at"])
    op.create_index("ix_approvals_status_expires_at", "approvals", ["status", "expires_at"])
    # Old tool effects are pruned by age (app/runs/takeover.py).
    op.create_index("ix_tool_effects_created_at", "tool_effects", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_tool_effects_created_at", table_name="tool_effects")
    # The previous version knows no waiting or queued run, and would run a call that a person
    # denied (it reads no decision): every active run that asked for an approval ends as failed.
    op.execute(
        sa.text(
            "UPDATE runs SET status = 'failed', error = 'the service was downgraded while the run "
            "waited for an approval', worker_id = NULL, lease_expires_at = NULL, "
            "finished_at = CURRENT_TIMESTAMP WHERE status IN ('queued', 'waiting') "
            "OR (status = 'running' AND id IN (SELECT run_id FROM approvals))"
        )
    )
    op.drop_index("ix_approvals_status_expires_at", table_name="approvals")
    op.drop_index("ix_approvals_owner_status_created_at", table_name="approvals")
    op.drop_index("ix_approvals_conversation_id", table_name="approvals")
    op.drop_index("ix_approvals_run_id", table_name="approvals")
    op.drop_table("approvals")
    op.drop_index(NEW_INDEX, table_name="runs")
    _statuses(NEW_STATUSES, OLD_STATUSES)
    _index(OLD_INDEX, OLD_WHERE)
