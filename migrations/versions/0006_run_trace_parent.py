"""Runs keep the request that started them as a W3C traceparent (``runs.trace_parent``): the parent
of every attempt's span, so that a run resumed on another worker continues the same trace.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04 00:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("trace_parent", sa.String(length=55), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "trace_parent")
