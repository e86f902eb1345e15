"""What an A2A message means to a run (FACES.md N-03, N-04).

- its text parts are the question (or the follow-up), joined; each data part is given to the model
  as JSON after them; a file part (``raw`` or ``url``) is ``ContentTypeNotSupportedError`` until the
  service has attachments; a part of a kind this version does not know is ignored;
- a data part ``{approval_id, decision: "approve"|"deny", reason?, tool_args?}`` decides an
  approval of the task it is sent to (``approval_id`` may be left out when one approval waits);
- the request's ``metadata.agent`` (or the message's) configures a new context's conversation,
  as API.md's ``agent`` object.

Everything is checked before anything is stored; a refusal is an A2A error (``InvalidParamsError``
for what the client can fix).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from a2a.types.a2a_pb2 import Message, SendMessageRequest
from a2a.utils.errors import ContentTypeNotSupportedError, InvalidParamsError
from google.protobuf import json_format
from pydantic import ValidationError

from app.api.schemas import MAX_MESSAGE_CHARS, AgentSpec

MAX_CONTEXT_ID = 200
MAX_REASON_CHARS = 2000


@dataclass(frozen=True, slots=True)
class Decision:
    approval_id: str | None
    decision: Literal["approve", "deny"]
    reason: str | None
    tool_args: Any
    """The edited arguments (``None``: as the model asked)."""


@dataclass(frozen=True, slots=True)
class Inbound:
    """A message, read: its text for the model (``""`` if it only decides), and its decisions."""

    text: str
    decisions: list[Decision]


def _checked_text(text: str, what: str) -> str:
    if "\x00" in text:
        raise InvalidParamsError(f"{what} must not contain NUL characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidParamsError(f"{what} must be valid Unicode (no lone surrogates)") from None
    return text


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def _decision(data: dict[str, Any]) -> Decision:
    decision = data.get("decision")
    if decision not in ("approve", "deny"):
        raise InvalidParamsError('a decision\'s "decision" must be "approve" or "deny"')
    approval_id = data.get("approval_id")
    if approval_id is not None and (not isinstance(approval_id, str) or not approval_id):
        raise InvalidParamsError('a decision\'s "approval_id" must be a string')
    reason = data.get("reason")
    if reason is not None:
        if not isinstance(reason, str):
            raise InvalidParamsError('a decision\'s "reason" must be a string')
        if len(reason) > MAX_REASON_CHARS:
            raise InvalidParamsError(f'a decision\'s "reason" may have at most {MAX_REASON_CHARS} characters')
        _checked_text(reason, "a decision's reason")
    tool_args = data.get("tool_args")
    if tool_args is not None and decision == "deny":
        raise InvalidParamsError('"tool_args" goes with "approve" only')
    return Decision(approval_id, decision, reason or None, tool_args)


def read_message(message: Message) -> Inbound:
    _checked_text(message.message_id, "messageId")
    texts: list[str] = []
    decisions: list[Decision] = []
    for part in message.parts:
        kind = part.WhichOneof("content")
        if kind == "text":
            if part.text:
                texts.append(_checked_text(part.text, "a text part"))
        elif kind == "data":
            value = json_format.MessageToDict(part.data)
            if isinstance(value, dict) and "decision" in value:
                decisions.append(_decision(value))
                continue
            if not _finite(value):
                raise InvalidParamsError("a data part must hold finite numbers only")
            texts.append(_checked_text(json.dumps(value, ensure_ascii=False), "a data part"))
        elif kind in ("raw", "url"):
            media = part.media_type or "a file"
            raise ContentTypeNotSupportedError(
                f"file parts ({media}) are not supported: send text parts, or data parts given to "
                "the model as JSON"
            )
    text = "\n\n".join(texts)
    if len(text) > MAX_MESSAGE_CHARS:
        raise InvalidParamsError(f"the message's text may have at most {MAX_MESSAGE_CHARS} characters")
    if not text.strip() and not decisions:
        raise InvalidParamsError("the message has no text part, data part or decision")
    return Inbound(text if text.strip() else "", decisions)


def checked_context_id(context_id: str) -> str:
    """A client's ``contextId``: per owner it names one conversation (N-03)."""
    if len(context_id) > MAX_CONTEXT_ID:
        raise InvalidParamsError(f"contextId may have at most {MAX_CONTEXT_ID} characters")
    return _checked_text(context_id, "contextId")


def agent_spec(request: SendMessageRequest) -> AgentSpec | None:
    """``metadata.agent`` of the request, else of its message: a new context's settings."""
    for holder in (request, request.message):
        if holder.HasField("metadata"):
            metadata = json_format.MessageToDict(holder.metadata)
            settings = metadata.get("agent")
            if settings is None:
                continue
            try:
                return AgentSpec.model_validate(settings)
            except ValidationError as exc:
                problem = exc.errors()[0]
                where = ".".join(str(p) for p in problem.get("loc", ()))
                raise InvalidParamsError(f"metadata.agent.{where}: {problem.get('msg')}") from None
    return None
