"""Conversations as trees, and tools the client runs (FACES.md B-01..B-08, C-01..C-03).

Messages get ``parent_seq`` (the message they follow), conversations ``head_seq`` (their current
leaf), runs ``question_seq`` (their question's place), ``client_tools`` and ``replay_of``;
approvals get ``kind`` (a person's decision, or a client tool's result), ``output`` and the status
``answered``.

Upgrade: every conversation of the previous version becomes one chain, in the order its messages
were stored, its head the last one; each run's question is its first message (B-08).
Downgrade: each conversation keeps the path from its root to its current leaf, and loses its other
branches; client tool calls go (the previous version would not know what they wait for), and an
active run waiting for one ends as failed (without a ``done`` event, as revision 0003's downgrade).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 01:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATUSES = "status IN ('pending', 'approved', 'denied', 'expired', 'cancelled')"
NEW_STATUSES = "status IN ('pending', 'approved', 'denied', 'expired', 'cancelled', 'answered')"


def _approvals_table(statuses: str) -> sa.Table:
    """The approvals table as this revision has it, with the status check ``statuses``: batch mode
    copies it from here, so that the upgrade can be written out as SQL offline too."""
    return sa.Table(
        "approvals",
        sa.MetaData(),
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
        sa.Column("kind", sa.String(length=16), server_default="approval", nullable=False),
        sa.Column("output", sa.JSON(none_as_null=True), nullable=True),
        sa.CheckConstraint(statuses, name="ck_approvals_status"),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name="fk_approvals_conversation_id_conversations",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_approvals_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_approvals"),
        sa.Index("ix_approvals_run_id", "run_id"),
        sa.Index("ix_approvals_conversation_id", "conversation_id"),
        sa.Index("ix_approvals_owner_status_created_at", "owner", "status", "created_at"),
        sa.Index("ix_approvals_status_expires_at", "status", "expires_at"),
    )


def _approval_statuses(old: str, new: str) -> None:
    if op.get_context().dialect.name != "sqlite":
        op.drop_constraint(op.f("ck_approvals_status"), "approvals", type_="check")
        op.create_check_constraint(op.f("ck_approvals_status"), "approvals", new)
        return
    # A check constraint cannot be altered in place on SQLite: batch mode rebuilds the table.
    with op.batch_alter_table("approvals", copy_from=_approvals_table(old), recreate="always") as batch:
        batch.drop_constraint(op.f("ck_approvals_status"), type_="check")
        batch.create_check_constraint(op.f("ck_approvals_status"), new)


def upgrade() -> None:
    op.add_column("messages", sa.Column("parent_seq", sa.Integer(), nullable=True))
    op.add_column("conversations", sa.Column("head_seq", sa.Integer(), nullable=True))
    op.add_column("runs", sa.Column("question_seq", sa.Integer(), nullable=True))
    op.add_column("runs", sa.Column("client_tools", sa.JSON(none_as_null=True), nullable=True))
    op.add_column("runs", sa.Column("replay_of", sa.String(length=64), nullable=True))
    op.add_column(
        "approvals",
        sa.Column("kind", sa.String(length=16), server_default="approval", nullable=False),
    )
    op.add_column("approvals", sa.Column("output", sa.JSON(none_as_null=True), nullable=True))
    _approval_statuses(OLD_STATUSES, NEW_STATUSES)
    # One chain a conversation, in the order its messages were stored (B-08).
    op.execute(
        sa.text(
            "UPDATE messages SET parent_seq = (SELECT max(m.seq) FROM messages m "
            "WHERE m.conversation_id = messages.conversation_id AND m.seq < messages.seq)"
        )
    )
    op.execute(
        sa.text(
            "UPDATE conversations SET head_seq = (SELECT max(m.seq) FROM messages m "
            "WHERE m.conversation_id = conversations.id)"
        )
    )
    op.execute(
        sa.text(
            "UPDATE runs SET question_seq = (SELECT min(m.seq) FROM messages m "
            "WHERE m.conversation_id = runs.conversation_id AND m.run_id = runs.id)"
        )
    )


def downgrade() -> None:
    # The previous version has one list of messages a conversation: the current path is kept.
    op.execute(
        sa.text(
            "DELETE FROM messages WHERE NOT EXISTS (WITH RECURSIVE path(conversation_id, seq, parent_seq) AS ("
            " SELECT m.conversation_id, m.seq, m.parent_seq FROM messages m JOIN conversations c"
            " ON c.id = m.conversation_id AND m.seq = c.head_seq"
            " UNION ALL SELECT m.conversation_id, m.seq, m.parent_seq FROM messages m JOIN path p"
            " ON m.conversation_id = p.conversation_id AND m.seq = p.parent_seq)"
            " SELECT 1 FROM path WHERE path.conversation_id = messages.conversation_id"
            " AND path.seq = messages.seq)"
        )
    )
    # The previous version would not know what a run waiting for a client tool waits for.
    op.execute(
        sa.text(
            "UPDATE runs SET status = 'failed', error = 'the service was downgraded while the run "
            "waited for a tool the client runs', worker_id = NULL, lease_expires_at = NULL, "
            "finished_at = CURRENT_TIMESTAMP WHERE status IN ('queued', 'running', 'waiting') "
            "AND id IN (SELECT run_id FROM approvals WHERE kind = 'client' AND status = 'pending')"
        )
    )
    op.execute(sa.text("DELETE FROM approvals WHERE kind = 'client'"))
    _approval_statuses(NEW_STATUSES, OLD_STATUSES)
    for table, column in (
        ("approvals", "output"),
        ("approvals", "kind"),
        ("runs", "replay_of"),
        ("runs", "client_tools"),
        ("runs", "question_seq"),
        ("conversations", "head_seq"),
        ("messages", "parent_seq"),
    ):
        op.drop_column(table, column)
