"""The run queue (RUNS.md Q-01, Q-02): indexes for the queue in order and for an owner's running runs.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 09:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_runs_status_created_at", "runs", ["status", "created_at"])
    op.create_index("ix_runs_owner_status", "runs", ["owner", "status"])


def downgrade() -> None:
    # The previous version starts no queued run, but carries on a running run that no worker
    # holds (as one a stopping worker released): queued runs become that, and nothing is lost.
    op.execute(
        sa.text(
            "UPDATE runs SET status = 'running', worker_id = NULL, lease_expires_at = NULL "
            "WHERE status = 'queued'"
        )
    )
    op.drop_index("ix_runs_owner_status", table_name="runs")
    op.drop_index("ix_runs_status_created_at", table_name="runs")
