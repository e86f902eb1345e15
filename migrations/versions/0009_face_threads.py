"""The protocol faces (FACES.md V-02, G-02): the client's chat and thread ids, and its message ids.

``face_threads`` maps an owner's client-side id of a chat (AI SDK), a thread (AG-UI) or a context
(A2A) to the conversation it names; ``messages.client_id`` keeps the id a client gave a message it
sent, so that the history it sends back is recognised and the messages it loads carry its ids.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 05:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "face_threads",
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("face", sa.String(length=16), nullable=False),
        sa.Column("client_id", sa.String(length=200), nullable=False),
        sa.Column("conversation_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name=op.f("fk_face_threads_conversation_id_conversations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("owner", "face", "client_id", name=op.f("pk_face_threads")),
    )
    op.create_index(
        op.f("ix_face_threads_conversation_id"), "face_threads", ["conversation_id"], unique=False
    )
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("client_id", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("client_id")
    op.drop_index(op.f("ix_face_threads_conversation_id"), table_name="face_threads")
    op.drop_table("face_threads")
