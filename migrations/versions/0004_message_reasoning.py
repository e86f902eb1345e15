"""Messages keep the thinking a provider returned with them (``messages.reasoning``).

Some providers refuse the next request of a tool loop unless each assistant message carries its
thinking back (DeepSeek's thinking mode): the history a run reads from the database must have it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 19:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("messages", sa.Column("reasoning", sa.Text(), nullable=True))


def downgrade() -> None:
    # SQLite drops a column in place since 3.35 (Python 3.11 ships a later one).
    op.drop_column("messages", "reasoning")
