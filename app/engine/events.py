"""Typed events the engine emits while it works (ENGINE.md E-28).

Every event is a small frozen dataclass. ``channel`` is the SSE event name and ``data()`` the JSON
payload of the source's table; only ``app.streaming.sse`` turns them into wire text (adding
``run_id``). Nothing else in the engine builds event dicts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

Channel = Literal["step", "answer", "compact", "phase", "inject", "approval", "done"]
RunStatus = Literal["running", "completed", "failed", "cancelled"]


@dataclass(slots=True)
class Usage:
    """Token usage summed over every LLM call of a run; ``llm_calls`` counts retries too."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    llm_calls: int = 0

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.total_tokens += other.total_tokens
        self.llm_calls += other.llm_calls

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "llm_calls": self.llm_calls,
        }


@dataclass(frozen=True, slots=True)
class ThinkingStarted:
    iteration: int
    kind: Literal["thinking_start"] = "thinking_start"
    channel: ClassVar[Channel] = "step"

    def data(self) -> dict[str, Any]:
        return {"type": "thinking", "status": "start", "iteration": self.iteration}


@dataclass(frozen=True, slots=True)
class ThinkingDone:
    iteration: int
    reasoning: str
    kind: Literal["thinking_done"] = "thinking_done"
    channel: ClassVar[Channel] = "step"

    def data(self) -> dict[str, Any]:
        return {
            "type": "thinking",
            "status": "done",
            "iteration": self.iteration,
            "reasoning": self.reasoning,
        }


@dataclass(frozen=True, slots=True)
class IterationStarted:
    iteration: int
    tool_name: str
    tool_args: dict[str, Any]
    call_id: str | None = None
    """The call's id (the same in its ``done``): parallel calls of one reply are told apart by it."""
    client: bool = False
    """A tool the client runs (FACES.md C-02): the run waits for its result."""
    expires_at: str | None = None
    """A client call's deadline (ISO 8601, UTC): no result by then, the model is told so."""
    approval_id: str | None = None
    """A client call's record (kept by the service; not on the wire)."""
    kind: Literal["iteration_start"] = "iteration_start"
    channel: ClassVar[Channel] = "step"

    def data(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "iteration",
            "status": "start",
            "iteration": self.iteration,
            "tool_name": self.tool_name,
            "tool_args": self.tool_args,
        }
        if self.call_id is not None:
            out["call_id"] = self.call_id
        if self.client:
            out["client"] = True
            out["expires_at"] = self.expires_at
        return out


@dataclass(frozen=True, slots=True)
class IterationDone:
    iteration: int
    tool_name: str
    observation: str
    error: str | None
    iter_elapsed: float
    artifact: dict[str, str] | None = None
    """``{filename, mime_type, content}`` when the tool produced a file the UI can preview."""
    call_id: str | None = None
    client: bool = False
    """The result of a tool the client ran (FACES.md C-03)."""
    kind: Literal["iteration_done"] = "iteration_done"
    channel: ClassVar[Channel] = "step"

    def data(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "iteration",
            "status": "done",
            "iteration": self.iteration,
            "tool_name": self.tool_name,
            "observation": self.observation,
            "error": self.error,
            "iter_elapsed": round(self.iter_elapsed, 4),
        }
        if self.call_id is not None:
            out["call_id"] = self.call_id
        if self.client:
            out["client"] = True
        if self.artifact is not None:
            out["artifact"] = self.artifact
        return out


@dataclass(frozen=True, slots=True)
class AnswerSignalled:
    """The loop is done and synthesis is about to start (``step {type: "answer"}``)."""

    kind: Literal["answer_signal"] = "answer_signal"
    channel: ClassVar[Channel] = "step"

    def data(self) -> dict[str, Any]:
        return {"type": "answer", "status": "start"}


@dataclass(frozen=True, slots=True)
class AnswerStarted:
    kind: Literal["answer_start"] = "answer_start"
    channel: ClassVar[Channel] = "answer"

    def data(self) -> dict[str, Any]:
        return {"status": "start"}


@dataclass(frozen=True, slots=True)
class AnswerDelta:
    content: str
    kind: Literal["answer_delta"] = "answer_delta"
    channel: ClassVar[Channel] = "answer"

    def data(self) -> dict[str, Any]:
        return {"status": "delta", "content": self.content}


@dataclass(frozen=True, slots=True)
class AnswerDone:
    kind: Literal["answer_done"] = "answer_done"
    channel: ClassVar[Channel] = "answer"

    def data(self) -> dict[str, Any]:
        return {"status": "done"}


@dataclass(frozen=True, slots=True)
class Compacted:
    original_messages: int
    kept_messages: int
    kind: Literal["compact"] = "compact"
    channel: ClassVar[Channel] = "compact"

    def data(self) -> dict[str, Any]:
        return {"original_messages": self.original_messages, "kept_messages": self.kept_messages}


@dataclass(frozen=True, slots=True)
class PhaseChanged:
    phase: str
    total_tools: int
    kind: Literal["phase"] = "phase"
    channel: ClassVar[Channel] = "phase"

    def data(self) -> dict[str, Any]:
        return {"phase": self.phase, "total_tools": self.total_tools}


@dataclass(frozen=True, slots=True)
class RunResumed:
    """The first event of a new attempt of a run (RUNS.md R-03): what came after ``after`` was
    published by work that this attempt does again."""

    attempt: int
    after: str
    kind: Literal["resumed"] = "resumed"
    channel: ClassVar[Channel] = "phase"

    def data(self) -> dict[str, Any]:
        return {"phase": "resumed", "attempt": self.attempt, "after": self.after}


@dataclass(frozen=True, slots=True)
class RunWaiting:
    """The run stops to wait (RUNS.md A-02, FACES.md C-02): for a person's decision on each of
    ``approval_ids``, for the client's result of each of ``call_ids``. The last event of its
    attempt; it goes on, with no ``resumed`` phase, once nothing of it is pending."""

    approval_ids: tuple[str, ...]
    call_ids: tuple[str, ...]
    kind: Literal["waiting"] = "waiting"
    channel: ClassVar[Channel] = "phase"

    def data(self) -> dict[str, Any]:
        return {"phase": "waiting", "approval_ids": list(self.approval_ids), "call_ids": list(self.call_ids)}


@dataclass(frozen=True, slots=True)
class RunQueued:
    """The run waits for room on some worker (RUNS.md Q-01): ``position`` 1 is the next to start."""

    position: int
    kind: Literal["queued"] = "queued"
    channel: ClassVar[Channel] = "phase"

    def data(self) -> dict[str, Any]:
        return {"phase": "queued", "position": self.position}


@dataclass(frozen=True, slots=True)
class FellBack:
    """A call of the run went to its model's fallback: the model stayed unavailable after its
    retries (API.md, ``phase`` ``fallback``). Names are LLM_MODELS' names."""

    from_model: str
    to_model: str
    kind: Literal["fallback"] = "fallback"
    channel: ClassVar[Channel] = "phase"

    def data(self) -> dict[str, Any]:
        return {"phase": "fallback", "from_model": self.from_model, "to_model": self.to_model}


@dataclass(frozen=True, slots=True)
class Injected:
    content: str
    kind: Literal["inject"] = "inject"
    channel: ClassVar[Channel] = "inject"

    def data(self) -> dict[str, Any]:
        return {"type": "inject", "content": self.content}


@dataclass(frozen=True, slots=True)
class ApprovalRequested:
    """A tool call waits for a person's decision (RUNS.md A-02)."""

    approval_id: str
    call_id: str
    tool_name: str
    tool_args: dict[str, Any]
    iteration: int
    expires_at: str
    kind: Literal["approval_requested"] = "approval_requested"
    channel: ClassVar[Channel] = "approval"

    def data(self) -> dict[str, Any]:
        return {
            "status": "requested",
            "approval_id": self.approval_id,
            "call_id": self.call_id,
            "tool_name": self.tool_name,
            "tool_args": self.tool_args,
            "iteration": self.iteration,
            "expires_at": self.expires_at,
        }


@dataclass(frozen=True, slots=True)
class ApprovalDecided:
    """A person's decision on a call (or its expiry) taken in by the run (A-03, A-04)."""

    approval_id: str
    status: Literal["approved", "denied", "expired"]
    reason: str | None
    tool_args: dict[str, Any]
    """The arguments that run (approved), or that would have."""
    kind: Literal["approval_decided"] = "approval_decided"
    channel: ClassVar[Channel] = "approval"

    def data(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "approval_id": self.approval_id,
            "reason": self.reason,
            "tool_args": self.tool_args,
        }


@dataclass(frozen=True, slots=True)
class RunDone:
    """The last event of every run, whatever happened."""

    answer: str
    iterations: int
    usage: dict[str, int]
    elapsed: float
    status: RunStatus
    error: str | None = None
    pending_injections: tuple[str, ...] = field(default=())
    model: str | None = None
    """The configured model the run was bound to (the service sets it; the engine knows none)."""
    kind: Literal["done"] = "done"
    channel: ClassVar[Channel] = "done"

    def data(self) -> dict[str, Any]:
        data = {
            "answer": self.answer,
            "iterations": self.iterations,
            "usage": dict(self.usage),
            "elapsed": round(self.elapsed, 4),
            "status": self.status,
            "error": self.error,
            "pending_injections": list(self.pending_injections),
        }
        if self.model is not None:
            data["model"] = self.model
        return data


EngineEvent = (
    ThinkingStarted
    | ThinkingDone
    | IterationStarted
    | IterationDone
    | AnswerSignalled
    | AnswerStarted
    | AnswerDelta
    | AnswerDone
    | Compacted
    | PhaseChanged
    | FellBack
    | RunResumed
    | RunQueued
    | RunWaiting
    | Injected
    | ApprovalRequested
    | ApprovalDecided
    | RunDone
)

EventSink = Callable[[EngineEvent], Awaitable[None]]
"""Where the engine delivers its events; the run manager passes one that publishes to the bus."""
