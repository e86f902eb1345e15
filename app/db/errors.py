"""Errors the persistence layer raises; the API maps them to HTTP status codes in one place."""

from __future__ import annotations


class PersistenceError(Exception):
    """Base of every error ``app.db`` raises on purpose."""


class RunActiveError(PersistenceError):
    """A run of the conversation is already running (only one may run at a time)."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"a run of conversation {conversation_id} is already running")
        self.conversation_id = conversation_id


class ConversationNotFoundError(PersistenceError):
    """The conversation does not exist (or was deleted meanwhile)."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id} not found")
        self.conversation_id = conversation_id


class InvalidCursorError(PersistenceError, ValueError):
    """A pagination or event cursor that this service did not hand out."""
