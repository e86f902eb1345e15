"""``structured_llm_call``: the one entry point for getting a JSON object out of an LLM (E-10, E-11).

Three levels, tried in order by what the model advertises: native function calling with a forced
tool choice, JSON mode (``response_format``) with one reformat retry, plain text with
``extract_json`` and an optional regex fallback, again with one reformat retry. Also home of
``extract_json``, which finds the JSON object in free text.
"""

from __future__ import annotations

import enum
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from app.engine.events import Usage
from app.llm.base import LLM, ChatMessage, ChatResult, LLMError

logger = logging.getLogger(__name__)

T = TypeVar("T")

REFORMAT_PROMPT = (
    "Your previous response could not be parsed as valid JSON. Reply again with exactly one JSON object "
    "that matches the requested schema: no prose before or after it, no markdown code fences."
)

LEVEL_DEFAULT = 0
LEVEL_NATIVE = 1
LEVEL_JSON_MODE = 2
LEVEL_PLAIN_TEXT = 3

_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON|json5)?[ \t]*\r?\n?(.*?)```", re.DOTALL)


class _Missing(enum.Enum):
    MISSING = enum.auto()


MISSING = _Missing.MISSING
"""Marks that ``default_value`` was not given (``None`` is a legitimate default)."""


class StructuredOutputError(Exception):
    """Every level failed and no ``default_value`` was given."""

    def __init__(self, message: str, *, failures: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.failures = tuple(failures)


@dataclass
class StructuredCallResult(Generic[T]):
    value: T
    raw: dict[str, Any]
    level: int
    """1 native function calling, 2 JSON mode, 3 plain text, 0 ``default_value`` used."""
    usage: Usage = field(default_factory=Usage)
    """Accumulated over every attempt, ``llm_calls`` counting transport retries too."""


class _AttemptFailed(Exception):
    """One attempt produced nothing usable; ``raw_text`` is what the model said, if anything."""

    def __init__(self, reason: str, raw_text: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.raw_text = raw_text


def extract_json(text: str) -> dict[str, Any] | None:
    """The JSON object in ``text``, or ``None``.

    Tries, in order: the whole text, each fenced code block, then every balanced ``{...}`` span
    (brace matching skips braces inside JSON strings) from left to right.
    """
    if not text:
        return None
    whole = _loads_object(text.strip())
    if whole is not None:
        return whole
    for match in _FENCE_RE.finditer(text):
        block = match.group(1).strip()
        found = _loads_object(block)
        if found is None:
            found = _first_balanced_object(block)
        if found is not None:
            return found
    return _first_balanced_object(text)


def _loads_object(candidate: str) -> dict[str, Any] | None:
    if not candidate.startswith("{"):
        return None
    try:
        obj = json.loads(candidate)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _first_balanced_object(text: str) -> dict[str, Any] | None:
    start = text.find("{")
    while start != -1:
        end = _matching_brace(text, start)
        if end is not None:
            found = _loads_object(text[start : end + 1])
            if found is not None:
                return found
        start = text.find("{", start + 1)
    return None


def _matching_brace(text: str, start: int) -> int | None:
    depth = 0
    in_string = False
    escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


@overload
async def structured_llm_call(
    llm: LLM,
    messages: Sequence[ChatMessage],
    *,
    schema: Mapping[str, Any],
    schema_name: str = "respond",
    parse_fn: None = None,
    default_value: dict[str, Any] | _Missing = MISSING,
    regex_fallback: Callable[[str], dict[str, Any] | None] | None = None,
    usage: Usage | None = None,
) -> StructuredCallResult[dict[str, Any]]: ...


@overload
async def structured_llm_call(
    llm: LLM,
    messages: Sequence[ChatMessage],
    *,
    schema: Mapping[str, Any],
    schema_name: str = "respond",
    parse_fn: Callable[[dict[str, Any]], T],
    default_value: T | _Missing = MISSING,
    regex_fallback: Callable[[str], dict[str, Any] | None] | None = None,
    usage: Usage | None = None,
) -> StructuredCallResult[T]: ...


async def structured_llm_call(
    llm: LLM,
    messages: Sequence[ChatMessage],
    *,
    schema: Mapping[str, Any],
    schema_name: str = "respond",
    parse_fn: Callable[[dict[str, Any]], Any] | None = None,
    default_value: Any = MISSING,
    regex_fallback: Callable[[str], dict[str, Any] | None] | None = None,
    usage: Usage | None = None,
) -> StructuredCallResult[Any]:
    """Get one JSON object matching ``schema`` from ``llm``, degrading level by level.

    Worst case 5 calls (tool_call + json_mode), 4 (json_mode only), 2 (plain text only). If
    ``usage`` is given every attempt's usage is added to it as well as to the result's.
    """
    call = _StructuredCall(llm, messages, schema, schema_name, parse_fn, regex_fallback, usage)
    abilities = llm.abilities
    if abilities.get("tool_call", False):
        result = await call.native()
        if result is not None:
            return result
    if abilities.get("json_mode", False):
        result = await call.with_reformat_retry(LEVEL_JSON_MODE)
        if result is not None:
            return result
    result = await call.with_reformat_retry(LEVEL_PLAIN_TEXT)
    if result is not None:
        return result

    tried = "; ".join(call.failures)
    if default_value is not MISSING:
        logger.warning("structured_output_default schema=%s tried=%r", schema_name, tried)
        return StructuredCallResult(value=default_value, raw={}, level=LEVEL_DEFAULT, usage=call.usage)
    raise StructuredOutputError(
        f"no valid JSON object for {schema_name!r} after {len(call.failures)} LLM call(s): {tried}",
        failures=call.failures,
    )


class _StructuredCall:
    """The state one ``structured_llm_call`` carries across its attempts."""

    def __init__(
        self,
        llm: LLM,
        messages: Sequence[ChatMessage],
        schema: Mapping[str, Any],
        schema_name: str,
        parse_fn: Callable[[dict[str, Any]], Any] | None,
        regex_fallback: Callable[[str], dict[str, Any] | None] | None,
        run_usage: Usage | None,
    ) -> None:
        self.llm = llm
        self.messages = list(messages)
        self.schema = schema
        self.schema_name = schema_name
        self.parse_fn = parse_fn
        self.regex_fallback = regex_fallback
        self.run_usage = run_usage
        self.usage = Usage()
        self.failures: list[str] = []

    async def native(self) -> StructuredCallResult[Any] | None:
        tool = {
            "type": "function",
            "function": {
                "name": self.schema_name,
                "description": "Return the requested result as the arguments of this function.",
                "parameters": dict(self.schema),
            },
        }
        choice = {"type": "function", "function": {"name": self.schema_name}}
        try:
            reply = await self._chat(self.messages, tools=[tool], tool_choice=choice)
            raw = self._native_arguments(reply)
            return self._result(raw, LEVEL_NATIVE)
        except _AttemptFailed as exc:
            self.failures.append(f"level 1 native function calling: {exc.reason}")
            return None

    async def with_reformat_retry(self, level: int) -> StructuredCallResult[Any] | None:
        name = "json mode" if level == LEVEL_JSON_MODE else "plain text"
        response_format = {"type": "json_object"} if level == LEVEL_JSON_MODE else None
        conversation = [*self.messages, ChatMessage(role="user", content=self._instruction())]
        for attempt in (1, 2):
            try:
                reply = await self._chat(conversation, response_format=response_format)
                text = reply.content or ""
                raw = self._text_object(text, level)
                return self._result(raw, level, raw_text=text)
            except _AttemptFailed as exc:
                self.failures.append(f"level {level} {name} attempt {attempt}: {exc.reason}")
                if attempt == 2:
                    return None
                # After a transport error there is no reply to correct: ask the same thing again.
                if exc.raw_text is not None:
                    conversation.append(ChatMessage(role="assistant", content=exc.raw_text))
                    conversation.append(ChatMessage(role="user", content=self._reformat()))
        return None

    async def _chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResult:
        try:
            reply = await self.llm.chat(messages, **kwargs)
        except Exception as exc:
            # Transport and provider errors make this attempt fail; cancellation is a
            # BaseException and passes through untouched.
            self._count(attempts=int(getattr(exc, "attempts", 1)))
            kind = "LLM error" if isinstance(exc, LLMError) else "unexpected error"
            raise _AttemptFailed(f"{kind} {type(exc).__name__}: {exc}") from exc
        self._count(
            attempts=reply.attempts,
            prompt=reply.usage.prompt_tokens,
            completion=reply.usage.completion_tokens,
            total=reply.usage.total_tokens,
        )
        return reply

    def _count(self, *, attempts: int, prompt: int = 0, completion: int = 0, total: int = 0) -> None:
        step = Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=total, llm_calls=attempts
        )
        self.usage.add(step)
        if self.run_usage is not None:
            self.run_usage.add(step)

    def _native_arguments(self, reply: ChatResult) -> dict[str, Any]:
        if not reply.tool_calls:
            raise _AttemptFailed("the reply has no tool call")
        call = next((tc for tc in reply.tool_calls if tc.name == self.schema_name), reply.tool_calls[0])
        try:
            args = json.loads(call.arguments)
            # Some providers double-encode the arguments as a JSON string.
            if isinstance(args, str):
                args = json.loads(args)
        except (ValueError, RecursionError) as exc:
            raise _AttemptFailed(f"tool arguments are not valid JSON ({exc})") from exc
        if not isinstance(args, dict):
            raise _AttemptFailed(f"tool arguments are a JSON {type(args).__name__}, not an object")
        return args

    def _text_object(self, text: str, level: int) -> dict[str, Any]:
        raw = extract_json(text)
        if raw is None and level == LEVEL_PLAIN_TEXT and self.regex_fallback is not None:
            try:
                raw = self.regex_fallback(text)
            except Exception as exc:
                raise _AttemptFailed(f"regex_fallback raised {type(exc).__name__}: {exc}", text) from exc
        if raw is None:
            what = "no JSON object in the reply" if text.strip() else "empty reply"
            if level == LEVEL_PLAIN_TEXT and self.regex_fallback is not None:
                what += " and regex_fallback found nothing"
            raise _AttemptFailed(what, text)
        return raw

    def _result(
        self, raw: dict[str, Any], level: int, raw_text: str | None = None
    ) -> StructuredCallResult[Any]:
        if self.parse_fn is None:
            return StructuredCallResult(value=raw, raw=raw, level=level, usage=self.usage)
        try:
            value = self.parse_fn(raw)
        except Exception as exc:
            raise _AttemptFailed(
                f"parse_fn rejected the object ({type(exc).__name__}: {exc})", raw_text
            ) from exc
        return StructuredCallResult(value=value, raw=raw, level=level, usage=self.usage)

    def _schema_text(self) -> str:
        return json.dumps(self.schema, ensure_ascii=False, sort_keys=True)

    def _instruction(self) -> str:
        return (
            f"Respond with a single JSON object ({self.schema_name}) that conforms to this JSON schema:\n"
            f"{self._schema_text()}\n"
            "Reply with the JSON object only."
        )

    def _reformat(self) -> str:
        return f"{REFORMAT_PROMPT}\nSchema:\n{self._schema_text()}"
