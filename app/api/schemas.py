"""Request and response bodies of the HTTP API (API.md)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_MESSAGE_CHARS = 32_000

# The service makes its ids from this alphabet (``secrets.token_urlsafe`` behind a prefix); anything
# else names nothing, and is answered 404 before it reaches a database that might choke on it.
_RESOURCE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def is_resource_id(value: str) -> bool:
    return _RESOURCE_ID.fullmatch(value) is not None


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("text must not contain NUL characters")
    return value


def _single_line(value: str) -> str:
    _no_nul(value)
    if any(c in value for c in "\r\n") or any(ord(c) < 32 for c in value if c != "\t"):
        raise ValueError("text must be a single line without control characters")
    return value


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("text must not be blank")
    return value


# Multi-line text (questions, follow-ups, prompts) may contain CR/LF: people paste code and lists.
# NUL is never accepted. SSE framing stays safe because every payload is JSON-encoded.
MessageText = Annotated[
    str,
    Field(min_length=1, max_length=MAX_MESSAGE_CHARS),
    AfterValidator(_no_nul),
    AfterValidator(_not_blank),
]
Title = Annotated[str, Field(max_length=200), AfterValidator(_single_line)]
ToolName = Annotated[str, Field(min_length=1, max_length=128), AfterValidator(_single_line)]


# Request bodies are strict: JSON's types as they are (no "5" for 5, no true for 1), no unknown fields.
REQUEST = ConfigDict(extra="forbid", strict=True)


class AgentSpec(BaseModel):
    model_config = REQUEST

    mode: Literal["auto", "json", "native"] = "auto"
    tools: list[ToolName] | None = Field(default=None, max_length=256)
    max_iterations: int | None = Field(default=None, ge=1, le=200)
    completion_check: bool = True
    system_prompt: Annotated[str, Field(max_length=8000), AfterValidator(_no_nul)] | None = None


class ConversationCreate(BaseModel):
    model_config = REQUEST

    title: Title | None = None
    agent: AgentSpec | None = None


class RunCreate(BaseModel):
    model_config = REQUEST

    message: MessageText


class InterruptCreate(BaseModel):
    model_config = REQUEST

    content: MessageText


class ChatRequest(BaseModel):
    model_config = REQUEST

    message: MessageText
    conversation_id: (
        Annotated[str, Field(min_length=1, max_length=128), AfterValidator(_single_line)] | None
    ) = None


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class ToolInfo(BaseModel):
    name: str
    description: str
    parameters: dict[str, Any]


class MessageOut(BaseModel):
    role: str
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    run_id: str | None = None
    pinned: bool = False
    created_at: str


class ConversationOut(BaseModel):
    id: str
    title: str
    agent: dict[str, Any]
    created_at: str
    updated_at: str


class ConversationDetail(ConversationOut):
    messages: list[MessageOut]
    active_run_id: str | None


class ConversationPage(BaseModel):
    items: list[ConversationOut]
    next_cursor: str | None


class RunStarted(BaseModel):
    run_id: str
    conversation_id: str
    status: Literal["running"]
    stream_url: str


class RunOut(BaseModel):
    run_id: str
    conversation_id: str
    status: str
    answer: str | None
    iterations: int
    usage: dict[str, int]
    elapsed: float | None
    error: str | None
    created_at: str
    finished_at: str | None


class Queued(BaseModel):
    queued: int


class Accepted(BaseModel):
    run_id: str
    status: str


class EventOut(BaseModel):
    id: str
    event: str
    data: dict[str, Any]
