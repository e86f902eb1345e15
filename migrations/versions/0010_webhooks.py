"""Run webhooks and A2A push notifications (FACES.md N-06, N-07): the durable outbox.

``webhook_deliveries`` holds every POST the service owes a receiver, stored in the transaction of
the change it tells of, claimed by any worker under a lease; ``push_configs`` the A2A push
notification configs of tasks (runs); ``runs.webhook`` the URL a run's record is posted to.

Downgrade: the outbox goes with what it still owed (the previous version would deliver none of it),
and so do the push configs and the runs' webhook URLs.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-08 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PENDING = sa.text("delivered_at IS NULL AND given_up_at IS NULL")


def upgrade() -> None:
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("headers", sa.JSON(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("claimed_by", sa.String(length=200), nullable=True),
        sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("given_up_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
    )
    op.create_index(
        "ix_webhook_deliveries_due",
        "webhook_deliveries",
        ["next_attempt_at"],
        unique=False,
        sqlite_where=PENDING,
        postgresql_where=PENDING,
    )
    op.create_index(
        op.f("ix_webhook_deliveries_run_id"), "webhook_deliveries", ["run_id"], unique=False
    )
    op.create_table(
        "push_configs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("config_id", sa.String(length=200), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("token", sa.Text(), nullable=True),
        sa.Column("authentication", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_push_configs_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_push_configs")),
        sa.UniqueConstraint("run_id", "config_id", name=op.f("uq_push_configs_run_id_config_id")),
    )
    op.add_column("runs", sa.Column("webhook", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "webhook")
    op.drop_table("push_configs")
    op.drop_index(op.f("ix_webhook_deliveries_run_id"), table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_due", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
