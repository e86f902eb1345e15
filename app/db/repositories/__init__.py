"""Repositories: the only code that speaks SQL. They return frozen records, never ORM objects.

One module a resource: ``conversations``, ``runs``, ``events``; ``rows`` holds what they share.
"""

from app.db.repositories.conversations import ConversationRepo
from app.db.repositories.events import GROUP_ROWS, EventRepo
from app.db.repositories.rows import (
    FINAL_STATUSES,
    ConversationRecord,
    MessageRecord,
    RunRecord,
    decode_page_cursor,
    encode_page_cursor,
    new_conversation_id,
    new_run_id,
)
from app.db.repositories.runs import RunRepo

__all__ = [
    "FINAL_STATUSES",
    "GROUP_ROWS",
    "ConversationRecord",
    "ConversationRepo",
    "EventRepo",
    "MessageRecord",
    "RunRecord",
    "RunRepo",
    "decode_page_cursor",
    "encode_page_cursor",
    "new_conversation_id",
    "new_run_id",
]
