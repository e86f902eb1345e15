"""Reading what OpenAI-compatible providers send back, in every shape they send it.

Lenient by design: whatever a provider adds that the service does not use is ignored, never an
error. What is read, for every provider (each shape is named where it comes from):

* the text: ``content`` as a string, or as a list of blocks (Magistral, some gateways: ``text``
  blocks are the text, ``thinking``/``reasoning`` blocks the reasoning);
* the thinking: ``reasoning_content`` (DeepSeek, vLLM before 0.10), ``reasoning`` (OpenRouter,
  Ollama, recent vLLM), thinking blocks, and, where the profile says so, ``<think>...</think>`` at
  the start of the text (``ThinkTags``);
* tool calls in whichever choice carries them (gateways that split text and calls into two choices,
  a lone choice with ``index: 1``), whatever the ``finish_reason`` says, arguments as text or as an
  object; a missing or empty id stays empty, and the engine names the call (unique in its run);
* usage from ``usage`` or Groq's ``x_groq.usage``, absent or ``null`` as nothing reported;
* errors inside a 200 (``{"error": {...}}`` with no choices, an error chunk in a stream, as
  OpenRouter, vLLM and llama.cpp's server send them): ``ProviderReportedError`` with the provider's
  own message, retryable or not by its code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.llm.base import ChatResult, LLMResponseError, TokenUsage, ToolCall
from app.llm.providers import ProviderProfile

_OPEN = "<think>"
_CLOSE = "</think>"
_RETRYABLE_WORDS = re.compile(
    r"rate.?limit|too many requests|overloaded|server.?error|unavailable|timeout|timed out|capacity"
    r"|try again|internal error|temporar",
    re.IGNORECASE,
)


class ProviderReportedError(Exception):
    """The provider said, inside a 200 reply or stream, that the call failed."""

    def __init__(self, message: str, *, retryable: bool, status: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.status = status


def field_of(obj: object, name: str) -> Any:
    """``obj[name]`` of a JSON object read off the wire; None for anything else."""
    return obj.get(name) if isinstance(obj, dict) else None


def reported_error(error: object) -> ProviderReportedError:
    """The error object a provider sent inside a 200, as an exception saying whether to retry.

    Shapes: ``{"message", "type", "code"}`` (OpenAI-style, vLLM: ``code`` a number), OpenRouter
    (``code`` a number or a string such as ``"server_error"``), llama.cpp (``{"code", "message",
    "type"}``), or a bare string.
    """
    if isinstance(error, Mapping):
        message = error.get("message") or error.get("error") or error.get("detail")
        code, kind = error.get("code"), error.get("type")
        status = error.get("status") if isinstance(error.get("status"), int) else None
    else:
        message, code, kind, status = error, None, None, None
    text = message if isinstance(message, str) and message.strip() else "the provider reported an error"
    if status is None and isinstance(code, int | str) and str(code).isascii() and str(code).isdigit():
        # A code is an HTTP status only where it looks like one (Mistral's 3230 is not).
        status = int(code) if 400 <= int(code) <= 599 else None
    if status is not None and 400 <= status <= 599:
        retryable = status in (408, 409, 429) or status >= 500
        return ProviderReportedError(text, retryable=retryable, status=None if retryable else status)
    words = " ".join(str(x) for x in (code, kind, text) if x)
    return ProviderReportedError(text, retryable=bool(_RETRYABLE_WORDS.search(words)), status=None)


def token_usage(container: object) -> TokenUsage | None:
    """The usage a reply or chunk reports (``usage``, else Groq's ``x_groq.usage``), None if none."""
    raw = field_of(container, "usage")
    if raw is None:
        raw = field_of(field_of(container, "x_groq"), "usage")
    if not isinstance(raw, dict):
        return None

    def count(name: str) -> int:
        value = field_of(raw, name)
        return value if isinstance(value, int) and value >= 0 else 0

    prompt, completion = count("prompt_tokens"), count("completion_tokens")
    return TokenUsage(prompt, completion, count("total_tokens") or prompt + completion)


def text_and_thinking(content: object) -> tuple[str | None, str]:
    """The text and the thinking of a ``content`` value: a string, a list of blocks, or null."""
    if content is None or isinstance(content, str):
        return content, ""
    if not isinstance(content, list):
        return None, ""
    texts: list[str] = []
    thinking: list[str] = []
    for block in content:
        if isinstance(block, str):
            texts.append(block)
            continue
        kind = field_of(block, "type")
        if kind in ("thinking", "reasoning", "redacted_thinking"):
            thinking.append(_block_text(field_of(block, kind) or field_of(block, "text")))
        elif kind in (None, "text", "output_text"):
            texts.append(_block_text(field_of(block, "text")))
    return "".join(texts), "".join(thinking)


def _block_text(value: object) -> str:
    # Magistral: {"type": "thinking", "thinking": [{"type": "text", "text": "..."}]}
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_block_text(field_of(v, "text") if not isinstance(v, str) else v) for v in value)
    return ""


def reasoning_fields(message: object) -> str:
    """``reasoning_content`` or ``reasoning``: the thinking a provider puts beside the text."""
    for name in ("reasoning_content", "reasoning"):
        value = field_of(message, name)
        if isinstance(value, str) and value:
            return value
    return ""


def split_think_tags(text: str, *, opened: bool, ended: bool = True) -> tuple[str, str]:
    """(thinking, answer) of a whole reply whose thinking may be in ``<think>`` tags.

    ``opened``: the chat template opened the tag, so the reply starts inside it; ``ended``: the
    reply ended by itself (not cut at the output limit). A reply that opened the tag, or started
    inside it, and was cut before closing it is all thinking: it has no answer yet.
    """
    stripped = text.lstrip()
    if stripped.startswith(_OPEN):
        end = stripped.find(_CLOSE)
        if end < 0:
            return stripped[len(_OPEN) :].strip(), ""
        return stripped[len(_OPEN) : end].strip(), stripped[end + len(_CLOSE) :].lstrip()
    end = text.find(_CLOSE)
    if end >= 0 and (opened or _OPEN not in text):
        # The chat template opened the tag: only its end is in the reply.
        return text[:end].strip(), text[end + len(_CLOSE) :].lstrip()
    if opened and not ended:
        return text.strip(), ""
    return "", text


def template_opens_thinking(body: object) -> bool:
    """A reply whose text closes a ``</think>`` it never opened: the model's template opens the tag
    (and no reasoning parser took the thinking out)."""
    for choice in field_of(body, "choices") or ():
        content = field_of(field_of(choice, "message"), "content")
        if isinstance(content, str) and _CLOSE in content and _OPEN not in content:
            return True
    return False


def parse_completion(body: object, profile: ProviderProfile, attempts: int) -> ChatResult:
    """A non-streamed reply as a ``ChatResult``. Raises ``ProviderReportedError`` for an error the
    provider put in the body, ``LLMResponseError`` for a reply that cannot be used."""
    if not isinstance(body, Mapping):
        raise LLMResponseError("the LLM reply is not a JSON object", attempts=attempts)
    choices = body.get("choices")
    error = body.get("error")
    if error and not choices:
        raise reported_error(error)
    if not isinstance(choices, list) or not choices:
        raise LLMResponseError("the LLM reply has no choices", attempts=attempts)
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[ToolCall] = []
    finish_reason: str | None = None
    saw_message = False
    for choice in sorted(choices, key=_choice_index):
        message = field_of(choice, "message")
        if not isinstance(message, dict):
            continue
        saw_message = True
        text, blocks_thinking = text_and_thinking(message.get("content"))
        if message.get("content") is not None and text is None:
            raise LLMResponseError("the LLM reply's message content is not text", attempts=attempts)
        reasoning = reasoning_fields(message) or blocks_thinking
        if text and profile.think_tags:
            # A server that puts the thinking in a field of its own sends the answer as the text.
            opened = profile.opens_thinking and not reasoning
            ended = field_of(choice, "finish_reason") in ("stop", "tool_calls", None)
            tagged, text = split_think_tags(text, opened=opened, ended=ended)
            reasoning = "\n\n".join(part for part in (reasoning, tagged) if part)
        if text:
            texts.append(text)
        if reasoning:
            thinking.append(reasoning)
        choice_calls = _tool_calls(message.get("tool_calls"), profile, attempts)
        calls.extend(choice_calls)
        reason = field_of(choice, "finish_reason")
        if isinstance(reason, str) and (finish_reason is None or choice_calls):
            finish_reason = reason
    if not saw_message:
        raise LLMResponseError("the LLM reply's choices have no message", attempts=attempts)
    content = "\n\n".join(texts) if texts else None
    if calls and finish_reason in ("stop", None):
        finish_reason = "tool_calls"  # some servers say "stop" beside the calls they made
    return ChatResult(
        content=content,
        tool_calls=tuple(calls),
        reasoning_content="\n\n".join(thinking) or None,
        kept_reasoning=("\n\n".join(thinking) or None) if profile.reasoning_back else None,
        usage=token_usage(body) or TokenUsage(),
        finish_reason=finish_reason,
        attempts=attempts,
        response_model=_text_field(body, "model"),
        response_id=_text_field(body, "id"),
    )


def _text_field(body: object, name: str) -> str | None:
    value = field_of(body, name)
    return value if isinstance(value, str) and value else None


def _choice_index(choice: object) -> int:
    index = field_of(choice, "index")
    return index if isinstance(index, int) else 0


def _tool_calls(raw_calls: object, profile: ProviderProfile, attempts: int) -> list[ToolCall]:
    if raw_calls is None:
        return []
    if not isinstance(raw_calls, list):
        raise LLMResponseError("the LLM reply's tool_calls is not a list", attempts=attempts)
    calls: list[ToolCall] = []
    for i, raw in enumerate(raw_calls):
        function = field_of(raw, "function")
        name = field_of(function, "name")
        arguments = field_of(function, "arguments")
        call_id = field_of(raw, "id")
        if not isinstance(name, str) or not name:
            raise LLMResponseError(f"tool call #{i} of the LLM reply has no function name", attempts=attempts)
        # Arguments stay raw text: whether they are JSON is for the engine to judge (E-27).
        # Some servers send an object instead of a string; dropping it would run the tool without
        # its arguments, so it is kept as the JSON text it stands for.
        if arguments is None:
            arguments = ""
        elif not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False, default=str)
        calls.append(
            ToolCall(
                id=call_id if isinstance(call_id, str) and call_id.strip() else "",
                name=name,
                arguments=arguments,
                extra=profile.kept_call_fields(raw) if isinstance(raw, dict) else None,
            )
        )
    return calls


@dataclass(slots=True)
class ThinkTags:
    """Separates ``<think>...</think>`` from the answer in a stream whose tags arrive split across
    chunks: ``feed`` returns only answer text, never a character of the thinking.

    With ``opened`` (the chat template opened the tag) everything is held back until ``</think>``
    arrives; a reply that ends by itself without one had no thinking, and ``finish`` hands it all
    over then (one cut at the output limit was still thinking: nothing). A server that sends the
    thinking in a field of its own (``separated``) sends the answer as the text.
    """

    opened: bool = False
    state: str = "start"  # start -> thinking -> after (skipping blank lines) -> answer
    held: str = ""
    tagged: bool = False
    """The reply opened the tag itself."""
    unclosed: list[str] = field(default_factory=list)
    """What an ``opened`` reply said before any ``</think>``: its thinking, or its whole answer."""

    def feed(self, piece: str) -> str:
        if self.state == "answer":
            return piece
        self.held += piece
        if self.state == "start":
            head = self.held.lstrip()
            if head.startswith(_OPEN):
                self.state, self.held, self.tagged = "thinking", head[len(_OPEN) :], True
            elif _OPEN.startswith(head):
                return ""  # blank, or a tag not complete yet
            elif self.opened:
                self.state = "thinking"
            else:
                return self._answer()
        if self.state == "thinking":
            end = self.held.find(_CLOSE)
            if end < 0:
                keep = _partial_suffix(self.held, _CLOSE)
                if not self.tagged:
                    self.unclosed.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return ""
            self.unclosed.clear()
            self.state, self.held = "after", self.held[end + len(_CLOSE) :]
        # "after": the blank lines between the thinking and the answer are not the answer.
        self.held = self.held.lstrip()
        return self._answer() if self.held else ""

    def separated(self) -> str:
        """The server sends the thinking apart: what was held for a tag the text will not have is
        answer text."""
        if self.tagged or self.state in ("after", "answer"):
            return ""
        return self._release()

    def finish(self, *, ended: bool = True) -> str:
        """What is still held at the stream's end that belongs to the answer; ``ended``: the
        provider ended the reply (not a cut at the output limit)."""
        if self.state == "start":
            return self._answer()
        if self.state == "thinking" and not self.tagged:
            # Held for a closing tag that never came: a reply that ended had no thinking, all of
            # it was the answer; one that was cut was thinking still.
            return self._release() if ended else ""
        return ""

    def _release(self) -> str:
        text = "".join(self.unclosed) + self.held
        self.unclosed.clear()
        self.held, self.state = "", "answer"
        return text

    def _answer(self) -> str:
        text, self.held, self.state = self.held, "", "answer"
        return text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a beginning of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
