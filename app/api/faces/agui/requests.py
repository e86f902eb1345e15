"""What an AG-UI client sends (``RunAgentInput``, FACES.md G-01, G-02), read leniently.

The models here are the request body of ``POST /api/ag-ui`` and its OpenAPI document. They take
what ``@ag-ui/client`` 1.x sends and whatever fields later clients add (kept, never used), and
ignore messages of roles they do not know and content parts other than text: a client is never
refused for speaking a newer dialect (design note B7, C). What they refuse (422, nothing stored)
is a body that is not a ``RunAgentInput``: ``threadId``, ``runId`` or ``messages`` missing, or a
known field of the wrong type.

Checks that need the service (client tools, agent settings, a resume's payload) are made later:
a body that passes here is answered with a stream, whose ``RUN_ERROR`` says what cannot be done.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag
from pydantic.alias_generators import to_camel

from app.api.schemas import CLIENT_TOOL_NAME_PATTERN, NO_NUL_PATTERN, FiniteJson, no_nul

MAX_ID_CHARS = 200
"""Ids are stored (threads, messages' client ids): PostgreSQL's column holds this many."""

ClientId = Annotated[
    str,
    Field(min_length=1, max_length=MAX_ID_CHARS, json_schema_extra={"pattern": NO_NUL_PATTERN}),
    AfterValidator(no_nul),
]
Text = Annotated[str, Field(json_schema_extra={"pattern": NO_NUL_PATTERN}), AfterValidator(no_nul)]
Part = dict[str, Any]
"""A content part: only ``{"type": "text", "text"}`` is read; images and the rest are ignored."""

INPUT = ConfigDict(extra="allow", strict=True, alias_generator=to_camel, populate_by_name=True)


class _Message(BaseModel):
    model_config = INPUT

    id: ClientId


class UserIn(_Message):
    role: Literal["user"]
    content: Text | list[Part]
    name: str | None = None


class FunctionIn(BaseModel):
    model_config = INPUT

    name: Text
    arguments: Text = ""


class ToolCallIn(BaseModel):
    model_config = INPUT

    id: ClientId
    type: Literal["function"] = "function"
    function: FunctionIn


class AssistantIn(_Message):
    role: Literal["assistant"]
    content: Text | None = None
    tool_calls: list[ToolCallIn] | None = None
    name: str | None = None


class ToolMessageIn(_Message):
    role: Literal["tool"]
    content: Text | list[Part]
    tool_call_id: ClientId
    error: Text | None = None


class SystemIn(_Message):
    role: Literal["system"]
    content: Text


class DeveloperIn(_Message):
    role: Literal["developer"]
    content: Text


class ReasoningIn(_Message):
    role: Literal["reasoning"]
    content: str = ""


KNOWN_ROLES = ("user", "assistant", "tool", "system", "developer", "reasoning")


class OtherMessageIn(BaseModel):
    """A message of a role this service does not read (``activity``, or one of a later protocol):
    accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Annotated[str, Field(json_schema_extra={"not": {"enum": list(KNOWN_ROLES)}})]


def _role(value: Any) -> str:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return role if isinstance(role, str) and role in KNOWN_ROLES else "other"


MessageIn = Annotated[
    Annotated[UserIn, Tag("user")]
    | Annotated[AssistantIn, Tag("assistant")]
    | Annotated[ToolMessageIn, Tag("tool")]
    | Annotated[SystemIn, Tag("system")]
    | Annotated[DeveloperIn, Tag("developer")]
    | Annotated[ReasoningIn, Tag("reasoning")]
    | Annotated[OtherMessageIn, Tag("other")],
    Discriminator(_role),
]


class ToolIn(BaseModel):
    """A tool the client runs, declared for this run (FACES.md C-01)."""

    model_config = INPUT

    name: Annotated[str, Field(pattern=CLIENT_TOOL_NAME_PATTERN)]
    description: Text = ""
    parameters: FiniteJson = None


class ContextIn(BaseModel):
    model_config = INPUT

    description: Text
    value: Text


class ResumeIn(BaseModel):
    """An answer to an interrupt of the thread's waiting run (FACES.md G-04)."""

    model_config = INPUT

    interrupt_id: ClientId
    status: Literal["resolved", "cancelled"]
    payload: FiniteJson = None


class AgUiRunInput(BaseModel):
    """``RunAgentInput`` of AG-UI 1.0 (``threadId``, ``runId`` and ``messages`` required)."""

    model_config = INPUT

    thread_id: ClientId
    run_id: ClientId
    protocol_version: str | None = None
    parent_run_id: str | None = None
    state: FiniteJson = None
    messages: Annotated[list[MessageIn], Field(max_length=10_000)]
    tools: Annotated[list[ToolIn], Field(max_length=64)] | None = None
    context: Annotated[list[ContextIn], Field(max_length=256)] | None = None
    forwarded_props: FiniteJson = None
    resume: Annotated[list[ResumeIn], Field(max_length=256)] | None = None


_VERSION = re.compile(r"([0-9]{1,6})\.([0-9]{1,6})")


def declares_protocol_1(body: AgUiRunInput) -> bool:
    """Whether the client speaks AG-UI 1.0 or later (``protocolVersion`` ``^\\d+\\.\\d+$``,
    compared as numbers, as the client itself compares a server's: design note B5)."""
    match = _VERSION.fullmatch(body.protocol_version or "")
    return match is not None and (int(match[1]), int(match[2])) >= (1, 0)


def text_of(content: str | list[Part] | None) -> str:
    """A message's text: the string, or its text parts joined (other parts are ignored)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = [p["text"] for p in content if p.get("type") == "text" and isinstance(p.get("text"), str)]
    return "\n".join(texts)


def agent_settings(body: AgUiRunInput) -> Any:
    """``forwardedProps.agent``: a new thread's conversation settings (API.md), if sent."""
    props = body.forwarded_props
    return props.get("agent") if isinstance(props, dict) else None
