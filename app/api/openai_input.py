"""The request side of ``POST /v1/chat/completions``: OpenAI's body, and a chat as a run (its
question, the turns before it, and the agent's instructions), or a clear refusal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.api.schemas import MAX_MESSAGE_CHARS
from app.errors import InvalidInputError
from app.llm.base import ChatMessage

MAX_INSTRUCTIONS_CHARS = 8000
"""System messages become the agent's ``system_prompt``, which conversations cap at this size."""
MAX_MESSAGES = 1000
_TEXT_PART_TYPES = ("text", "input_text")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """OpenAI's request body; fields this route does not use are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=256)]
    messages: Annotated[list[ChatMessageIn], Field(min_length=1, max_length=MAX_MESSAGES)]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[int | None, Field(ge=1, le=1)] = None


@dataclass(frozen=True)
class ChatInput:
    """A chat request as a run: its question, the turns before it, and the agent's instructions."""

    question: str
    prior: list[ChatMessage]
    instructions: str | None


def _text_of(message: ChatMessageIn, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        text = content
    else:
        pieces: list[str] = []
        for part in content:
            if part.type not in _TEXT_PART_TYPES or part.text is None:
                raise InvalidInputError(
                    f"messages.{index}.content: only text content is supported, not {part.type!r}"
                )
            pieces.append(part.text)
        text = "\n".join(pieces)
    if "\x00" in text:
        raise InvalidInputError(f"messages.{index}.content: text must not contain NUL characters")
    try:
        text.encode()
    except UnicodeEncodeError:
        # A lone surrogate ("\ud800" in the JSON) is no text any database can store.
        raise InvalidInputError(f"messages.{index}.content: text must be valid Unicode") from None
    return text


def chat_input(body: ChatCompletionRequest) -> ChatInput:
    """Split an OpenAI chat into the run's question, history and instructions (or refuse it)."""
    instructions: list[str] = []
    turns: list[tuple[int, ChatMessage]] = []
    for index, message in enumerate(body.messages):
        if message.role in ("tool", "function") or getattr(message, "tool_calls", None):
            raise InvalidInputError(
                f"messages.{index}: tool calls and tool results are not accepted; "
                "this model runs its own tools"
            )
        text = _text_of(message, index)
        if message.role in ("system", "developer"):
            if text.strip():
                instructions.append(text)
            continue
        role: Literal["user", "assistant"] = "user" if message.role == "user" else "assistant"
        turns.append((index, ChatMessage(role=role, content=text)))
    if not turns or turns[-1][1].role != "user":
        raise InvalidInputError("messages: the last message (system messages aside) must be from the user")
    index, last = turns[-1]
    question = last.content or ""
    if not question.strip():
        raise InvalidInputError(f"messages.{index}.content: the question must not be blank")
    if len(question) > MAX_MESSAGE_CHARS:
        raise InvalidInputError(
            f"messages.{index}.content: the question is longer than {MAX_MESSAGE_CHARS} characters"
        )
    joined = "\n\n".join(instructions) or None
    if joined is not None and len(joined) > MAX_INSTRUCTIONS_CHARS:
        raise InvalidInputError(
            f"messages: system messages are longer than {MAX_INSTRUCTIONS_CHARS} characters together"
        )
    return ChatInput(question=question, prior=[m for _, m in turns[:-1]], instructions=joined)
