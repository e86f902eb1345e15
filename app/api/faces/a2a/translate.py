"""A run's stored events as an A2A task's stream (FACES.md N-04): a pure translation, so that a live
stream, a resubscription and a snapshot come out the same by construction.

- the run's steps, phases, decisions and follow-ups: ``TaskStatusUpdateEvent`` (``WORKING``, or
  ``SUBMITTED`` while it queues), whose message says what happened in a text part and carries the
  event itself (``{"event": name, ...payload}``) in a data part;
- ``phase waiting``: ``INPUT_REQUIRED``, a data part ``{approval_id, tool_name, tool_args,
  expires_at}`` per approval it waits for (``{call_id, ...}`` per call a client runs);
- the answer: ``TaskArtifactUpdateEvent`` chunks of the artifact ``answer`` (the first replaces,
  the next ``append``, the last ``lastChunk``). One delta is held back so that the last chunk
  carries text. A new attempt (``resumed``, RUNS.md R-04) streams the answer again from its start:
  its first chunk replaces what was sent; a fallback answer (E-04) replaces it at the end;
- ``done``: the final status, ``COMPLETED``, ``FAILED`` (with the error) or ``CANCELED``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from a2a.types.a2a_pb2 import (
    Artifact,
    Message,
    Part,
    Role,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from google.protobuf import json_format, struct_pb2, timestamp_pb2

from app.streaming.bus import StoredEvent

A2AEvent = TaskStatusUpdateEvent | TaskArtifactUpdateEvent

FACE = "a2a"
"""The face name under which the A2A face keeps its clients' context ids (``face_threads``)."""
ANSWER_ARTIFACT = "answer"
TERMINAL = frozenset(
    {TaskState.TASK_STATE_COMPLETED, TaskState.TASK_STATE_FAILED, TaskState.TASK_STATE_CANCELED}
)
RUN_STATES = {
    "queued": TaskState.TASK_STATE_SUBMITTED,
    "running": TaskState.TASK_STATE_WORKING,
    "waiting": TaskState.TASK_STATE_INPUT_REQUIRED,
    "completed": TaskState.TASK_STATE_COMPLETED,
    "failed": TaskState.TASK_STATE_FAILED,
    "cancelled": TaskState.TASK_STATE_CANCELED,
}


def data_part(value: Any) -> Part:
    part = Part()
    part.data.CopyFrom(json_format.ParseDict(value, struct_pb2.Value()))
    return part


def text_part(text: str) -> Part:
    return Part(text=text)


def timestamp_ms(ms: int) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromMilliseconds(ms)
    return stamp


def event_ms(event_id: str) -> int | None:
    """The time an event was published: its id is ``<milliseconds>-<seq>``."""
    head = event_id.partition("-")[0]
    return int(head) if head.isdigit() and len(head) <= 15 else None


def agent_message(message_id: str, task_id: str, context_id: str, parts: list[Part]) -> Message:
    return Message(
        message_id=message_id, task_id=task_id, context_id=context_id, role=Role.ROLE_AGENT, parts=parts
    )


def approval_data(requested: dict[str, Any]) -> dict[str, Any]:
    """What a client needs to decide an approval (N-04)."""
    return {
        "approval_id": requested.get("approval_id"),
        "tool_name": requested.get("tool_name"),
        "tool_args": requested.get("tool_args"),
        "expires_at": requested.get("expires_at"),
    }


def _call(tool: Any, args: Any) -> str:
    try:
        shown = json.dumps(args, ensure_ascii=False)
    except (TypeError, ValueError):
        shown = str(args)
    if len(shown) > 200:
        shown = shown[:200] + "…"
    return f"{tool}({shown})"


def describe(name: str, data: dict[str, Any]) -> str | None:
    """A line a person can read of a run's event (None: not worth a status update)."""
    kind, status = data.get("type"), data.get("status")
    if name == "step":
        if kind == "thinking":
            return f"thinking (iteration {data.get('iteration')})" if status == "start" else "thought"
        if kind == "iteration" and status == "start":
            return f"calling {_call(data.get('tool_name'), data.get('tool_args'))}"
        if kind == "iteration":
            return (
                f"{data.get('tool_name')} failed"
                if data.get("error")
                else f"{data.get('tool_name')} answered"
            )
        if kind == "answer":
            return "writing the answer"
        return None
    if name == "phase":
        phase = data.get("phase")
        if phase == "queued":
            return f"queued (position {data.get('position')})"
        if phase == "resumed":
            return f"carried on by another worker (attempt {data.get('attempt')})"
        if phase == "selecting_tools":
            return "selecting tools"
        if phase == "fallback":
            return f"the model {data.get('from_model')} is unavailable: going on with {data.get('to_model')}"
        if phase == "replay":
            return "replaying from a checkpoint"
        return None
    if name == "approval" and status in ("approved", "denied", "expired"):
        return f"approval {data.get('approval_id')} {status}"
    if name == "inject":
        return "follow-up taken in"
    return None


@dataclass
class TaskEvents:
    """The translation of one run's events, in order; ``event()`` gives each one's A2A events, and
    the state is what a client that received them all holds (``snapshot()``)."""

    task_id: str
    context_id: str
    state: int = TaskState.TASK_STATE_SUBMITTED
    status_message: Message | None = None
    status_ms: int | None = None
    sent: str = ""
    """The answer's text as the client holds it."""
    pending: str | None = None
    """The latest delta, held back so that the last chunk carries text."""
    chunks: int = 0
    """Chunks sent of the current answer (0: the next one replaces the artifact)."""
    answer_closed: bool = False
    requested: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What the run asked for, by approval id and by client call id."""

    # -- the translation ---------------------------------------------------------------------

    def event(self, event: StoredEvent, *, waits: bool) -> list[A2AEvent]:
        """The A2A events of ``event``; ``waits``: for a ``waiting`` phase, whether what it names
        still waits (one settled meanwhile is passed by: the run goes on)."""
        data: dict[str, Any] = json.loads(event.data)
        ms = event_ms(event.id)
        name = event.event
        if name == "answer":
            return self._answer(data)
        if name == "done":
            return self._done(event, data, ms)
        if name == "approval" and data.get("status") == "requested":
            self.requested[str(data.get("approval_id"))] = data
            return []
        if name == "step" and data.get("client") and data.get("type") == "iteration":
            if data.get("status") == "start":
                self.requested[str(data.get("call_id"))] = data
        if name == "phase" and data.get("phase") == "waiting":
            return self._waiting(event, data, ms) if waits else []
        if name == "phase" and data.get("phase") == "resumed":
            self._restart_answer()
        text = describe(name, data)
        if text is None:
            return []
        state = (
            TaskState.TASK_STATE_SUBMITTED if data.get("phase") == "queued" else TaskState.TASK_STATE_WORKING
        )
        return [self._status(event, state, [text_part(text), data_part({"event": name, **data})], ms)]

    def _status(
        self, event: StoredEvent, state: int, parts: list[Part], ms: int | None
    ) -> TaskStatusUpdateEvent:
        message = agent_message(f"{self.task_id}-{event.id}", self.task_id, self.context_id, parts)
        self.state, self.status_message, self.status_ms = state, message, ms
        status = TaskStatus(state=state, message=message)  # type: ignore[arg-type]
        if ms is not None:
            status.timestamp.CopyFrom(timestamp_ms(ms))
        return TaskStatusUpdateEvent(task_id=self.task_id, context_id=self.context_id, status=status)

    def _waiting(self, event: StoredEvent, data: dict[str, Any], ms: int | None) -> list[A2AEvent]:
        approvals = [self.requested.get(str(a), {"approval_id": a}) for a in data.get("approval_ids") or ()]
        calls = [self.requested.get(str(c), {"call_id": c}) for c in data.get("call_ids") or ()]
        lines = [
            f"waiting for a person to approve {_call(a.get('tool_name'), a.get('tool_args'))}"
            for a in approvals
        ]
        lines += [
            f"waiting for the client's result of {_call(c.get('tool_name'), c.get('tool_args'))}"
            for c in calls
        ]
        parts = [text_part("; ".join(lines) or "waiting")]
        parts += [data_part(approval_data(a)) for a in approvals]
        parts += [
            data_part(
                {
                    "call_id": c.get("call_id"),
                    "tool_name": c.get("tool_name"),
                    "tool_args": c.get("tool_args"),
                    "expires_at": c.get("expires_at"),
                }
            )
            for c in calls
        ]
        return [self._status(event, TaskState.TASK_STATE_INPUT_REQUIRED, parts, ms)]

    def _answer(self, data: dict[str, Any]) -> list[A2AEvent]:
        status = data.get("status")
        if status == "start":
            self.answer_closed = False
            return []
        if status == "delta" and isinstance(data.get("content"), str) and data["content"]:
            held, self.pending = self.pending, data["content"]
            return [self._chunk(held)] if held is not None else []
        if status == "done":
            return self._close_answer()
        return []

    def _close_answer(self) -> list[A2AEvent]:
        if self.answer_closed:
            return []
        self.answer_closed = True
        held, self.pending = self.pending, None
        if held is not None:
            return [self._chunk(held, last=True)]
        if self.chunks:
            return [self._chunk("", last=True)]
        return []

    def _restart_answer(self) -> None:
        self.pending, self.chunks, self.answer_closed = None, 0, False

    def _chunk(self, text: str, *, last: bool = False, replace: bool = False) -> TaskArtifactUpdateEvent:
        append = self.chunks > 0 and not replace
        self.sent = self.sent + text if append else text
        self.chunks += 1
        return TaskArtifactUpdateEvent(
            task_id=self.task_id,
            context_id=self.context_id,
            artifact=Artifact(artifact_id=ANSWER_ARTIFACT, name="answer", parts=[text_part(text)]),
            append=append,
            last_chunk=last,
        )

    def _done(self, event: StoredEvent, data: dict[str, Any], ms: int | None) -> list[A2AEvent]:
        out: list[A2AEvent] = []
        status = data.get("status")
        if status == "completed":
            out += self._close_answer()
            answer = data["answer"] if isinstance(data.get("answer"), str) else ""
            if self.sent != answer or not self.chunks:
                # Nothing streamed, or the fallback answer (E-04) in place of the partial text.
                out.append(self._chunk(answer, last=True, replace=True))
            state, parts = TaskState.TASK_STATE_COMPLETED, [text_part("completed")]
        elif status == "cancelled":
            self.pending = None
            state, parts = TaskState.TASK_STATE_CANCELED, [text_part("cancelled")]
        else:
            self.pending = None
            state, parts = (
                TaskState.TASK_STATE_FAILED,
                [text_part(str(data.get("error") or "the run failed"))],
            )
        parts.append(data_part({"event": "done", **data}))
        out.append(self._status(event, state, parts, ms))
        return out

    # -- what the client holds ---------------------------------------------------------------

    def answer_text(self) -> str | None:
        """The answer as the client holds it, the held-back delta included (None: none yet)."""
        if not self.chunks and self.pending is None:
            return None
        return self.sent + (self.pending or "")

    def caught_up(self) -> None:
        """A snapshot went out with the held-back delta: it counts as sent."""
        if self.pending is not None:
            self.sent = self.sent + self.pending if self.chunks else self.pending
            self.chunks += 1
            self.pending = None

    def snapshot(self, question: Message | None) -> Task:
        status = TaskStatus(state=self.state)  # type: ignore[arg-type]
        if self.status_message is not None:
            status.message.CopyFrom(self.status_message)
        if self.status_ms is not None:
            status.timestamp.CopyFrom(timestamp_ms(self.status_ms))
        task = Task(id=self.task_id, context_id=self.context_id, status=status)
        answer = self.answer_text()
        if answer is not None:
            task.artifacts.append(
                Artifact(artifact_id=ANSWER_ARTIFACT, name="answer", parts=[text_part(answer)])
            )
        if question is not None:
            task.history.append(question)
        return task
