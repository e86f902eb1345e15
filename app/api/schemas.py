"""Request and response bodies of the HTTP API (API.md)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)

MAX_MESSAGE_CHARS = 32_000

# The service makes its ids from this alphabet (``secrets.token_urlsafe`` behind a prefix); anything
# else names nothing, and is answered 404 before it reaches a database that might choke on it.
_RESOURCE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def is_resource_id(value: str) -> bool:
    return _RESOURCE_ID.fullmatch(value) is not None


def optional_parameter(max_length: int, pattern: str | None = None) -> WithJsonSchema:
    """The OpenAPI schema of an optional query or header parameter: a string, when it is sent.

    FastAPI would say "string or null", but a parameter cannot be null: a client reading that
    sends the text ``null``.
    """
    schema: dict[str, Any] = {"type": "string", "maxLength": max_length}
    if pattern is not None:
        schema["pattern"] = pattern
    return WithJsonSchema(schema)


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("text must not contain NUL characters")
    return value


def _single_line(value: str) -> str:
    _no_nul(value)
    if any(c in value for c in "\r\n") or any(ord(c) < 32 for c in value if c != "\t"):
        raise ValueError("text must be a single line without control characters")
    return value


def _finite(value: Any) -> Any:
    """JSON as JSON defines it: no NaN or Infinity (Python's parser takes them; PostgreSQL's JSON
    refuses them, and a client reading them back could not parse them)."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise ValueError("numbers must be finite (NaN and Infinity are not JSON)") from None
    except (TypeError, RecursionError):
        raise ValueError("not JSON") from None
    return value


FiniteJson = Annotated[Any, AfterValidator(_finite)]
no_nul = _no_nul  # public: the protocol faces' request models check their text with it too


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("text must not be blank")
    return value


# Multi-line text (questions, follow-ups, prompts) may contain CR/LF: people paste code and lists.
# NUL is never accepted. SSE framing stays safe because every payload is JSON-encoded.
# The same rules as JSON Schema patterns, so that the OpenAPI document tells clients (and the
# schema-driven tests) which text is accepted. Whitespace is spelled out rather than written ``\s``
# because regex engines disagree on what ``\s`` covers; this is what ``str.strip()`` removes.
_SPACE = r"\t\n\x0b\x0c\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
NO_NUL_PATTERN = r"^[^\x00]*$"
TEXT_PATTERN = rf"^[^\x00]*[^\x00{_SPACE}][^\x00]*$"
SINGLE_LINE_PATTERN = r"^[^\x00-\x08\x0a-\x1f]*$"

MessageText = Annotated[
    str,
    Field(min_length=1, max_length=MAX_MESSAGE_CHARS, json_schema_extra={"pattern": TEXT_PATTERN}),
    AfterValidator(_no_nul),
    AfterValidator(_not_blank),
]
Title = Annotated[
    str,
    Field(max_length=200, json_schema_extra={"pattern": SINGLE_LINE_PATTERN}),
    AfterValidator(_single_line),
]
ToolName = Annotated[
    str,
    Field(min_length=1, max_length=128, json_schema_extra={"pattern": SINGLE_LINE_PATTERN}),
    AfterValidator(_single_line),
]


# Request bodies are strict: JSON's types as they are (no "5" for 5, no true for 1), no unknown fields.
REQUEST = ConfigDict(extra="forbid", strict=True)


def _integral(value: object) -> object:
    # JSON has one kind of number: 5.0 is the integer 5 (JSON Schema's "integer" says so too).
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


CLIENT_TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class ClientToolSpec(BaseModel):
    """A tool the client runs (FACES.md C-01): offered to the model, never run by the service."""

    model_config = REQUEST

    name: Annotated[str, Field(pattern=CLIENT_TOOL_NAME_PATTERN)]
    description: (
        Annotated[
            str,
            Field(max_length=4000, json_schema_extra={"pattern": NO_NUL_PATTERN}),
            AfterValidator(_no_nul),
        ]
    ) = ""
    parameters: Annotated[dict[str, Any], AfterValidator(_finite)] = Field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    """A JSON Schema of the call's arguments (an object)."""


class AgentSpec(BaseModel):
    model_config = REQUEST

    mode: Literal["auto", "json", "native"] = "auto"
    tools: list[ToolName] | None = Field(default=None, max_length=256)
    require_approval: list[ToolName] | None = Field(default=None, max_length=256)
    """Tools whose calls wait for a person (``["*"]``: every tool; RUNS.md A-01)."""
    max_iterations: Annotated[int, Field(ge=1, le=200), BeforeValidator(_integral)] | None = None
    completion_check: bool = True
    model: Annotated[str, Field(min_length=1, max_length=100)] | None = None
    """A configured model's name (GET /api/models); unset: the default."""
    system_prompt: (
        Annotated[
            str,
            Field(max_length=8000, json_schema_extra={"pattern": NO_NUL_PATTERN}),
            AfterValidator(_no_nul),
        ]
        | None
    ) = None
    client_tools: list[ClientToolSpec] | None = Field(default=None, max_length=64)
    """Tools the client runs (FACES.md C-01)."""


class ConversationCreate(BaseModel):
    model_config = REQUEST

    title: Title | None = None
    agent: AgentSpec | None = None


MessageId = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^msg_[0-9]{1,20}$")]


def _one_of(fields: dict[str, list[str]], non_null: tuple[str, ...]) -> Any:
    """A body's JSON Schema saying which fields go together: exactly one of ``fields``' keys, each
    with the fields it admits beside it (and the ``non_null`` ones never null)."""

    def shape(schema: dict[str, Any]) -> None:
        props = schema.get("properties", {})
        for name in non_null:
            options = props.get(name, {}).get("anyOf")
            if options:
                kept = [o for o in options if o.get("type") != "null"]
                props[name].pop("anyOf")
                props[name].update(kept[0] if len(kept) == 1 else {"anyOf": kept})
        every = set(props)
        schema["oneOf"] = [
            {
                "required": [key],
                "not": {"anyOf": [{"required": [other]} for other in sorted(every - {key, *with_it})]},
            }
            for key, with_it in fields.items()
        ]

    return shape


WebhookUrl = Annotated[
    str,
    Field(min_length=1, max_length=2048, pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[^\x00-\x20\x7f]+$"),
]
"""An http(s) URL; whether the service posts to it is checked apart (``app.webhooks.urls``)."""


class RunCreate(BaseModel):
    """A question (below ``parent_id`` when given: an edit, FACES.md B-02), or a question answered
    again (``regenerate``, B-03); ``webhook`` gets the run's record when it waits and when it ends
    (N-07)."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra=_one_of(
            {"message": ["parent_id", "webhook"], "regenerate": ["webhook"]},
            ("message", "regenerate", "webhook"),
        ),
    )

    message: MessageText | None = None
    parent_id: MessageId | None = None
    """The message the question follows (null: a conversation's first); unset: the current leaf."""
    regenerate: MessageId | None = None
    """A user message to answer again, or an assistant message to replace with a new sibling."""
    webhook: WebhookUrl | None = None

    @model_validator(mode="after")
    def _question_or_regenerate(self) -> RunCreate:
        if self.webhook is None and "webhook" in self.model_fields_set:
            raise ValueError("webhook must be a URL (leave it out for none)")
        if self.regenerate is not None:
            if self.message is not None or "parent_id" in self.model_fields_set:
                raise ValueError("regenerate goes alone: no message, no parent_id")
        elif self.message is None:
            raise ValueError("message is required (or regenerate)")
        return self


class InterruptCreate(BaseModel):
    model_config = REQUEST

    content: MessageText


class ChatRequest(BaseModel):
    model_config = REQUEST

    message: MessageText
    conversation_id: (
        Annotated[
            str,
            Field(min_length=1, max_length=128, json_schema_extra={"pattern": SINGLE_LINE_PATTERN}),
            AfterValidator(_single_line),
        ]
        | None
    ) = None


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


_ERROR_DESCRIPTIONS = {
    400: "`invalid_json`: the body is not JSON, not UTF-8, or nested too deeply",
    401: "`unauthorized`: no API key, or not one of API_KEYS",
    404: "`not_found`: nothing of the caller's has this id (another owner's ids are not found either)",
    409: (
        "`run_active` (a run is already active), `no_active_run`, `approval_closed` or `call_closed`"
    ),
    413: "`too_large`: the body is over 1,000,000 bytes",
    422: "`invalid_request`: a field or parameter is invalid; the message says which",
    429: (
        "`too_many_follow_ups` (100 follow-ups already wait for the active run) or `queue_full` "
        "(MAX_QUEUED_RUNS runs wait; nothing was stored); retry after `Retry-After`"
    ),
    503: "`shutting_down`: this worker takes no new runs; retry (another worker will)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` entries of the errors a route can answer."""
    return {s: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[s]} for s in statuses}


class CapacityOut(BaseModel):
    """This worker's room and the service's queue (RUNS.md Q-01, Q-02)."""

    max_active_runs: int
    active_runs: int
    room: int
    queued: int | None
    """Runs waiting across the service (null when the database cannot say)."""
    max_queued_runs: int


class ReadyOut(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str]
    down: list[str] | None = None
    capacity: CapacityOut | None = None


class ToolInfo(BaseModel):
    name: str
    description: str
    parameters: dict[str, Any]


class MessageOut(BaseModel):
    id: str
    parent_id: str | None
    sibling_ids: list[str]
    """The messages with the same parent and role, oldest first, itself included (FACES.md B-01)."""
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
    """The current branch: the path from the first message to the current leaf."""
    active_run_id: str | None
    pending_approvals: list[dict[str, Any]]
    pending_tool_calls: list[dict[str, Any]]


class HeadIn(BaseModel):
    model_config = REQUEST

    message_id: MessageId


class ForkIn(BaseModel):
    model_config = REQUEST

    message_id: MessageId
    title: Title | None = None


class ReplayIn(BaseModel):
    model_config = REQUEST

    after: Annotated[str, Field(min_length=1, max_length=64)]
    """The id of an event of the run: the replay starts from its last checkpoint at or before it."""
    model: Annotated[str, Field(min_length=1, max_length=100)] | None = None


class ToolResultIn(BaseModel):
    """The result of a tool the client ran (FACES.md C-03): ``output`` (any JSON) or ``error``."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra=_one_of({"output": [], "error": []}, ("error",))
    )

    output: FiniteJson = None
    error: (
        Annotated[
            str,
            Field(min_length=1, max_length=MAX_MESSAGE_CHARS, json_schema_extra={"pattern": NO_NUL_PATTERN}),
            AfterValidator(_no_nul),
        ]
        | None
    ) = None

    @model_validator(mode="after")
    def _one_of(self) -> ToolResultIn:
        given = {"output", "error"} & self.model_fields_set
        if len(given) != 1 or (given == {"error"} and self.error is None):
            raise ValueError("send exactly one of output (any JSON) or error (a string)")
        return self


class ToolResultOut(BaseModel):
    call_id: str
    status: Literal["answered"]
    run_id: str


class ConversationPage(BaseModel):
    items: list[ConversationOut]
    next_cursor: str | None


class RunStarted(BaseModel):
    run_id: str
    conversation_id: str
    status: Literal["running", "queued"]
    stream_url: str


class ModelInfo(BaseModel):
    name: str
    """What ``agent.model`` and ``/v1/chat/completions``' ``model`` name it by."""
    model: str
    """The provider's model name."""
    abilities: dict[str, bool]
    default: bool


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
    attempt: int
    """1 for the first attempt; one more each time another worker carried the run on (RUNS.md R-03)."""
    model: str
    pending_approvals: list[dict[str, Any]]
    trace_id: str | None
    pending_tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    """Calls of tools the client runs that wait for their results (FACES.md C-02)."""
    replay_of: str | None = None
    """The run this one replays from a checkpoint (FACES.md B-06)."""


class ApprovalDecisionIn(BaseModel):
    model_config = REQUEST

    decision: Literal["approve", "deny"]
    reason: (
        Annotated[
            str,
            Field(max_length=2000, json_schema_extra={"pattern": NO_NUL_PATTERN}),
            AfterValidator(_no_nul),
        ]
        | None
    ) = None
    tool_args: Annotated[dict[str, Any], AfterValidator(_finite)] | None = None
    """Approve with these arguments instead (checked against the tool's parameters)."""


class ApprovalDecisionOut(BaseModel):
    approval_id: str
    status: Literal["approved", "denied"]
    run_id: str


class ApprovalPage(BaseModel):
    items: list[dict[str, Any]]


class Queued(BaseModel):
    queued: int


class Accepted(BaseModel):
    run_id: str
    status: str


class EventOut(BaseModel):
    id: str
    event: str
    data: dict[str, Any]
