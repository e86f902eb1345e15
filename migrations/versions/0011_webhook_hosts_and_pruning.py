"""The webhooks' outbox: each delivery's host, and indexes for pruning (FACES.md N-06, N-07).

``webhook_deliveries.host`` is the URL's host name: a worker makes a few attempts at once per host
at most and claims other hosts' deliveries first, so that one slow receiver cannot hold every
attempt. Rows queued before (or by a worker still on 0010's code during a rolling deploy) have
none; the workers work it out from the URL then, so nothing is backfilled.

Pruning deletes deliveries made or given up a week ago, through an index on ``delivered_at`` and
one on ``given_up_at`` (each partial: only rows where it is set), instead of scanning the table.

Downgrade drops the indexes and the column; nothing else depends on them.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-10 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DELIVERED = sa.text("delivered_at IS NOT NULL")
GIVEN_UP = sa.text("given_up_at IS NOT NULL")


def upgrade() -> None:
    op.add_column("webhook_deliveries", sa.Column("host", sa.Text(), nullable=True))
    op.create_index(
        "ix_webhook_deliveries_delivered_at",
        "webhook_deliveries",
        ["delivered_at"],
        unique=False,
        sqlite_where=DELIVERED,
        postgresql_where=DELIVERED,
    )
    op.create_index(
        "ix_webhook_deliveries_given_up_at",
        "webhook_deliveries",
        ["given_up_at"],
        unique=False,
        sqlite_where=GIVEN_UP,
        postgresql_where=GIVEN_UP,
    )


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_given_up_at", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_delivered_at", table_name="webhook_deliveries")
    op.drop_column("webhook_deliveries", "host")
