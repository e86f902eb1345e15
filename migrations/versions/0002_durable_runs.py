"""Durable runs: attempts and checkpoints of runs, follow-ups, the notebook's notes, tool effects.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN (every dialect has it, with a constant default): no table rebuild, and the
    # upgrade can be written out as SQL offline.
    op.add_column("runs", sa.Column("attempt", sa.Integer(), server_default=sa.text("1"), nullable=False))
    op.add_column(
        "runs", sa.Column("lost_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    op.add_column(
        "runs", sa.Column("cancel_requested", sa.Boolean(), server_default=sa.false(), nullable=False)
    )

    op.create_table(
        "run_checkpoints",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("attempt", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("seq", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("after", sa.String(length=64), nullable=True),
        sa.Column("data", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "attempt", "seq", name=op.f("pk_run_checkpoints")),
    )

    op.create_table(
        "follow_ups",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("conversation_id", sa.String(length=64), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name=op.f("fk_follow_ups_conversation_id_conversations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_follow_ups")),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_follow_ups_conversation_id_id", "follow_ups", ["conversation_id", "id"])

    op.create_table(
        "notes",
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("title", sa.String(length=200), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", "title", name=op.f("pk_notes")),
    )

    op.create_table(
        "tool_effects",
        sa.Column("idempotency_key", sa.String(length=300), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("result", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("idempotency_key", name=op.f("pk_tool_effects")),
    )


def downgrade() -> None:
    op.drop_table("tool_effects")
    op.drop_table("notes")
    op.drop_index("ix_follow_ups_conversation_id_id", table_name="follow_ups")
    op.drop_table("follow_ups")
    op.drop_table("run_checkpoints")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("cancel_requested")
        batch.drop_column("lost_attempts")
        batch.drop_column("attempt")
