"""The LLM protocol the engine depends on, and the message and result types it speaks.

Two implementations: ``app.llm.openai_client.OpenAICompatibleLLM`` (any OpenAI-compatible
endpoint) and ``app.llm.demo.DemoLLM`` (offline and deterministic).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call requested by the model; ``arguments`` is the raw JSON text the model sent.

    ``extra``: what the provider attached to the call that it wants back with it (Gemini's thought
    signature, in ``extra_content``); kept as it came, sent back only to the provider that needs it
    (``app.llm.providers``).
    """

    id: str
    name: str
    arguments: str
    extra: Mapping[str, Any] | None = None

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """A chat message as the engine keeps it.

    ``pinned`` messages survive context compaction (user interrupts, the question); it is engine
    bookkeeping and never sent to the provider. ``reasoning`` is the thinking the provider returned
    with an assistant message, sent back only to providers that ask for it (``app.llm.providers``).
    """

    role: Role
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    pinned: bool = False
    reasoning: str | None = None

    def to_openai(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [tc.to_openai() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role != "tool":
            msg["name"] = self.name
        return msg


@dataclass(slots=True)
class TokenUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass(slots=True)
class ChatResult:
    """The reply of one non-streaming call.

    ``attempts`` is how many HTTP calls it took (retries included), so that usage can count them.
    """

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning_content: str | None = None
    usage: TokenUsage = field(default_factory=TokenUsage)
    finish_reason: str | None = None
    attempts: int = 1
    kept_reasoning: str | None = None
    """The reasoning the provider wants sent back with this message in later requests (DeepSeek's
    thinking mode); None for every provider that does not (``app.llm.providers``)."""
    response_model: str | None = None
    """The model that answered, as the provider names it (its reply's ``model``), for traces."""
    response_id: str | None = None


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """Last item of a stream: the usage the provider reported, how many attempts it took, and why the
    answer ended (``length``: the model reached its output limit, so the answer is cut)."""

    usage: TokenUsage
    attempts: int = 1
    finish_reason: str | None = None
    response_model: str | None = None
    response_id: str | None = None


StreamItem = TextDelta | StreamEnd


class LLMError(Exception):
    """Base of every error an LLM implementation raises."""


class LLMUnavailableError(LLMError):
    """The provider could not be reached after all retries (429, 5xx, timeouts, connection)."""

    def __init__(self, message: str, *, attempts: int = 1) -> None:
        super().__init__(message)
        self.attempts = attempts


class LLMResponseError(LLMError):
    """The provider answered, but the reply is unusable (not JSON, no choices, ...)."""

    def __init__(self, message: str, *, attempts: int = 1) -> None:
        super().__init__(message)
        self.attempts = attempts


class LLMRequestRejectedError(LLMError):
    """The provider refused the request itself (401, 403, 404, 400...): retrying cannot help."""

    def __init__(self, message: str, *, status: int, attempts: int = 1) -> None:
        super().__init__(message)
        self.status = status
        self.attempts = attempts


@runtime_checkable
class LLM(Protocol):
    """What the engine needs of a model. One instance serves every call of a run (E-02)."""

    @property
    def abilities(self) -> Mapping[str, bool]:
        """``tool_call``, ``json_mode``, ``streaming``: what the model supports."""
        ...

    @property
    def model_name(self) -> str: ...

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        response_format: Mapping[str, Any] | None = None,
    ) -> ChatResult:
        """One non-streaming call. Raises ``LLMUnavailableError`` or ``LLMResponseError``."""
        ...

    def stream_chat(self, messages: Sequence[ChatMessage]) -> AsyncIterator[StreamItem]:
        """Stream the reply as ``TextDelta`` items, then one ``StreamEnd``.

        Retries happen only before the first delta was yielded, so a client never sees a token
        twice; a failure after that raises.
        """
        ...
