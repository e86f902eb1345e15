"""Runs name their model (``runs.model``, LLM_MODELS' name) and their trace (``runs.trace_id``).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 20:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("model", sa.String(length=100), nullable=True))
    op.add_column("runs", sa.Column("trace_id", sa.String(length=32), nullable=True))


def downgrade() -> None:
    # SQLite drops a column in place since 3.35 (Python 3.11 ships a later one).
    op.drop_column("runs", "trace_id")
    op.drop_column("runs", "model")
