"""A run's stored events as AG-UI events, for one response (FACES.md G-03, G-04; design note D3).

``Translator`` is a small state machine over the events ``follow_run`` yields: what is open (a
step, the answer's text message), which calls this response has shown, and the run's ``RunFold``
(app.api.faces.agui.snapshot), whose ids every event uses. It reads the database for one thing
only, the whole-thread ``MESSAGES_SNAPSHOT``. A response that continues a parked run folds the
events before the park in silence (``settled``: the ids it settled) and starts speaking at the
``waiting`` event that names them, with a snapshot, so that a result for a call of an earlier
response names a call the client knows.

A whole-thread snapshot costs what the thread holds, so a response sends one only where the client
needs it: where the run parks (G-04), at the start of a continuation, where something is taken
back (a ``resumed`` phase, E-04's fallback answer), and before ``RUN_FINISHED`` unless the client
holds the thread already. It does when the history it sent was the thread (``synced``) and the
events of this response made, by the rules of the 1.0 client it declared itself
(app.api.faces.agui.reducer), exactly the run's messages as the snapshot would have them: a plain
run streamed from its start. A follow-up
folded in, a tool's error (a snapshot's tool message carries it, the result event only in its
metadata), a client's result or anything the events cannot say get the snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ag_ui.core import (
    AssistantMessage,
    BaseEvent,
    CustomEvent,
    FunctionCall,
    Interrupt,
    MessagesSnapshotEvent,
    ReasoningEndEvent,
    ReasoningMessageContentEvent,
    ReasoningMessageEndEvent,
    ReasoningMessageStartEvent,
    ReasoningStartEvent,
    RunErrorEvent,
    RunFinishedCancelledOutcome,
    RunFinishedEvent,
    RunFinishedInterruptOutcome,
    RunFinishedSuccessOutcome,
    RunStartedEvent,
    StepFinishedEvent,
    StepStartedEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    TokenUsage,
    ToolCall,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
)

from app.api.faces.agui.reducer import ClientMessages
from app.api.faces.agui.snapshot import (
    Call,
    RunFold,
    ThreadView,
    arguments_text,
    assistant_id,
    reasoning_id,
    tool_message_id,
)
from app.api.faces.follow import is_waiting, payload
from app.db.repositories.approvals import ApprovalRecord
from app.streaming.bus import StoredEvent

ANSWER_STEP = "answer"
RESPONSE_SCHEMA = {
    "type": "object",
    "properties": {
        "approved": {"type": "boolean"},
        "editedArgs": {"type": "object"},
        "reason": {"type": "string"},
    },
    "required": ["approved"],
}
"""What an approval's interrupt takes as its resume ``payload`` (G-04)."""


def now_ms() -> int:
    return int(time.time() * 1000)


def token_usage(done: Mapping[str, Any]) -> list[TokenUsage]:
    usage = done.get("usage") or {}
    return [
        TokenUsage(
            model=done.get("model"),
            input_tokens=int(usage.get("prompt_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens") or 0),
            total_tokens=int(usage.get("total_tokens") or 0),
        )
    ]


def interrupt_of(approval: ApprovalRecord) -> Interrupt:
    args = approval.tool_args
    return Interrupt(
        id=approval.id,
        reason="tool_call",
        tool_call_id=approval.call_id,
        message=f"Allow {approval.tool_name}({arguments_text(args)})?",
        expires_at=approval.expires_at.isoformat(),
        response_schema=RESPONSE_SCHEMA,
        metadata={"tool_name": approval.tool_name, "tool_args": args},
    )


def named(waiting: StoredEvent) -> set[str]:
    """The approval and call ids a ``waiting`` event names."""
    data = payload(waiting)
    return {str(i) for i in (*(data.get("approval_ids") or ()), *(data.get("call_ids") or ()))}


def parks_at(
    waiting: StoredEvent, approvals: Sequence[ApprovalRecord], calls: Sequence[ApprovalRecord]
) -> bool:
    """Whether the run still waits at ``waiting``, given what is pending for it now: it does while
    something the event names is pending. If nothing is (all settled since ``follow_run`` read
    them, or the run went on and parks again on new ones), the response follows on from there."""
    ids = named(waiting)
    return any(a.id in ids for a in approvals) or any(c.call_id in ids for c in calls)


class Translator:
    """One response's AG-UI run (``runId``: the client's) over an AgentStream run's events."""

    def __init__(
        self,
        thread: ThreadView | None,
        *,
        thread_id: str,
        run_id: str,
        protocol_1: bool,
        fold: RunFold,
        settled: Collection[str] = (),
        held: Collection[str] = (),
        synced: bool = False,
        client: ClientMessages | None = None,
    ) -> None:
        """``settled``: approval and call ids this request settled (a continuation starts at the
        ``waiting`` event naming one); ``held``: client calls whose result the client holds as its
        own tool message (it gets no ``TOOL_CALL_RESULT`` for them); ``synced``: the client sent
        the thread as it was before this run (its messages, in order), and ``client`` follows what
        this response's events add to them: then a run that ends as its events told it ends
        without a snapshot."""
        self.thread = thread
        self.thread_id = thread_id
        self.run_id = run_id
        self.protocol_1 = protocol_1
        self.fold = fold
        self.settled = frozenset(settled)
        self.live = not self.settled
        self.held = set(held)
        self.step: str | None = None
        self.text: str | None = None
        self.shown: dict[str, tuple[int, str, str]] = {}
        """The calls this response showed (or its first snapshot held): (iteration, name, args)."""
        self.resulted: set[str] = set()
        self.ended = False
        self.unchanged = False
        """Nothing happened since the continuation's first snapshot (a park needs no second one)."""
        self.synced = synced
        self.client = client or ClientMessages()

    # ---- the response's frame -------------------------------------------------------------------

    def started(self) -> RunStartedEvent:
        return RunStartedEvent(
            thread_id=self.thread_id,
            run_id=self.run_id,
            protocol_version="1.0" if self.protocol_1 else None,
            timestamp=now_ms(),
        )

    def error(self, code: str, message: str, usage: list[TokenUsage] | None = None) -> list[BaseEvent]:
        """Close what is open, then ``RUN_ERROR``."""
        self.ended = True
        return [*self._close(), RunErrorEvent(message=message, code=code, usage=usage, timestamp=now_ms())]

    async def snapshot(self) -> MessagesSnapshotEvent:
        assert self.thread is not None, "a response without a thread has no snapshot"
        thread = await self.thread.read(self.fold)
        return MessagesSnapshotEvent(messages=thread.messages, timestamp=now_ms())

    def finished(self, **fields: Any) -> RunFinishedEvent:
        self.ended = True
        return RunFinishedEvent(thread_id=self.thread_id, run_id=self.run_id, timestamp=now_ms(), **fields)

    async def park(
        self, approvals: Sequence[ApprovalRecord], calls: Sequence[ApprovalRecord]
    ) -> list[BaseEvent]:
        """The run waits (G-04): for people (the interrupt outcome: an approval and a client call
        parked together come out as the interrupt), else for the client's tools."""
        out = self._close()
        if self.live and not self.unchanged:
            out.append(await self.snapshot())
        elif not self.live:  # a continuation that parks again at once: this snapshot is its first
            out += await self._go_live()
        if approvals:
            interrupts = [interrupt_of(a) for a in approvals]
            out.append(self.finished(outcome=RunFinishedInterruptOutcome(interrupts=interrupts)))
        elif self.protocol_1:
            pending = [c.call_id for c in calls]
            out.append(
                self.finished(outcome=RunFinishedSuccessOutcome(pending_tool_call_ids=pending or None))
            )
        else:
            out.append(self.finished())
        return out

    # ---- the run's events -----------------------------------------------------------------------

    async def feed(self, event: StoredEvent) -> list[BaseEvent]:
        if not self.live:
            if event.is_done:
                return [*(await self._go_live()), *(await self.feed(event))]
            self.fold.apply(event)
            if is_waiting(event) and self.settled & named(event):
                return await self._go_live()
            return []
        self.unchanged = False
        data = payload(event)
        if event.event == "phase" and data.get("phase") == "resumed":
            out = self._close()
            self.fold.apply(event)
            out.append(self._custom("phase", data))
            out.append(await self._resumed_snapshot())
            self.client.apply(out)
            return out
        self.fold.apply(event)
        kind = event.event
        if kind == "done":
            return await self._done(data)
        out = self._events(kind, data)
        self.client.apply(out)
        return out

    def _events(self, kind: str, data: Mapping[str, Any]) -> list[BaseEvent]:
        if kind == "step":
            return self._step(data)
        if kind == "approval":
            return self._approval(data)
        if kind == "answer":
            return self._answer(data)
        if kind in ("inject", "compact") or (kind == "phase" and data.get("phase") != "waiting"):
            return [self._custom(kind, data)]
        return []

    async def _go_live(self) -> list[BaseEvent]:
        """A continuation's start: the thread as the client held it, and what settled it."""
        self.live = True
        self.unchanged = True
        for number, iteration in self.fold.iterations.items():
            for call in iteration.calls.values():
                self.shown[call.call_id] = (number, call.name, call.arguments)
                if call.result is not None:
                    self.resulted.add(call.call_id)
        return [await self.snapshot()]

    async def _resumed_snapshot(self) -> MessagesSnapshotEvent:
        """After a lost attempt (D1.6): the thread as the fold has it now, plus the calls this
        response showed already, so that the new attempt's events for them need no second start
        (results the fold took back are shown again when they come again)."""
        snapshot = await self.snapshot()
        self.resulted &= {
            c.call_id
            for it in self.fold.iterations.values()
            for c in it.calls.values()
            if c.result is not None
        }
        assistants = {m.id: m for m in snapshot.messages if isinstance(m, AssistantMessage)}
        present = {c.id for m in assistants.values() for c in (m.tool_calls or ())}
        for call_id, (iteration, name, arguments) in self.shown.items():
            if call_id in present:
                continue
            call = ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments or "{}"))
            parent = assistant_id(self.fold.run_id, iteration)
            if parent not in assistants:
                assistants[parent] = AssistantMessage(id=parent, tool_calls=[])
                snapshot.messages.append(assistants[parent])
            else:  # a copy: the messages of a snapshot may be shared (finished runs' are kept)
                index = snapshot.messages.index(assistants[parent])
                assistants[parent] = snapshot.messages[index] = assistants[parent].model_copy()
            assistants[parent].tool_calls = [*(assistants[parent].tool_calls or ()), call]
        return snapshot

    def _client_holds_run(self) -> bool:
        """Whether the client holds the thread as a snapshot now would give it: it held the
        thread before the run, and this response's events made exactly the run's messages by the
        rules of a 1.0 client (an older one may not build messages of every event this face
        sends: it gets the snapshot); a run with client calls has results the client sent, which
        the snapshot names: it gets one."""
        return (
            self.synced
            and self.protocol_1
            and not self.settled
            and not self.fold.has_client_calls
            and self.client.holds(self.fold.messages({}))
        )

    def _custom(self, kind: str, data: Mapping[str, Any]) -> CustomEvent:
        return CustomEvent(name=f"agentstream.{kind}", value=dict(data), timestamp=now_ms())

    def _open_step(self, name: str) -> list[BaseEvent]:
        if self.step == name:
            return []
        out = self._close_step()
        self.step = name
        out.append(StepStartedEvent(step_name=name, timestamp=now_ms()))
        return out

    def _iteration_step(self) -> list[BaseEvent]:
        """The current iteration's step, opened if it is not (a continuation reopens it)."""
        if self.step is not None and self.step != ANSWER_STEP:
            return []
        return self._open_step(f"iteration-{self.fold.iteration}")

    def _close_step(self) -> list[BaseEvent]:
        out: list[BaseEvent] = []
        if self.step is not None:
            out.append(StepFinishedEvent(step_name=self.step, timestamp=now_ms()))
            self.step = None
        return out

    def _close(self) -> list[BaseEvent]:
        out: list[BaseEvent] = []
        if self.text is not None:
            out.append(TextMessageEndEvent(message_id=self.text, timestamp=now_ms()))
            self.text = None
        return out + self._close_step()

    def _step(self, data: Mapping[str, Any]) -> list[BaseEvent]:
        if data.get("type") == "thinking":
            if data.get("status") == "start":
                return self._open_step(f"iteration-{self.fold.iteration}")
            return self._reasoning(str(data.get("reasoning") or ""))
        if data.get("type") == "answer":
            return self._open_step(ANSWER_STEP)
        if data.get("type") != "iteration":
            return []
        call = self.fold.call(data)
        out = self._iteration_step() + self._show(call)
        if data.get("status") == "done" and call.call_id not in self.resulted:
            if call.client and call.call_id in self.held:
                return out  # the client has its own tool message for it
            self.resulted.add(call.call_id)
            observation, error = call.result or ("", None)
            out.append(
                ToolCallResultEvent(
                    message_id=tool_message_id(call.call_id),
                    tool_call_id=call.call_id,
                    content=observation,
                    role="tool",
                    metadata={"agentstream": {"error": error}} if error is not None else None,
                    timestamp=now_ms(),
                )
            )
        return out

    def _reasoning(self, reasoning: str) -> list[BaseEvent]:
        if not reasoning:
            return []
        message_id = reasoning_id(self.fold.run_id, self.fold.iteration)
        stamp = now_ms()
        return [
            *self._iteration_step(),
            ReasoningStartEvent(message_id=message_id, timestamp=stamp),
            ReasoningMessageStartEvent(message_id=message_id, role="reasoning", timestamp=stamp),
            ReasoningMessageContentEvent(message_id=message_id, delta=reasoning, timestamp=stamp),
            ReasoningMessageEndEvent(message_id=message_id, timestamp=stamp),
            ReasoningEndEvent(message_id=message_id, timestamp=stamp),
        ]

    def _show(self, call: Call) -> list[BaseEvent]:
        """``TOOL_CALL_START/ARGS/END`` once per call per response (D1.7)."""
        if call.call_id in self.shown:
            return []
        iteration = next(
            (n for n, it in self.fold.iterations.items() if call.call_id in it.calls), self.fold.iteration
        )
        self.shown[call.call_id] = (iteration, call.name, call.arguments)
        stamp = now_ms()
        return [
            ToolCallStartEvent(
                tool_call_id=call.call_id,
                tool_call_name=call.name,
                parent_message_id=assistant_id(self.fold.run_id, iteration),
                timestamp=stamp,
            ),
            ToolCallArgsEvent(tool_call_id=call.call_id, delta=call.arguments or "{}", timestamp=stamp),
            ToolCallEndEvent(tool_call_id=call.call_id, timestamp=stamp),
        ]

    def _approval(self, data: Mapping[str, Any]) -> list[BaseEvent]:
        if data.get("status") == "requested":
            return self._iteration_step() + self._show(self.fold.call(data))
        return [self._custom("approval", data)]

    def _answer(self, data: Mapping[str, Any]) -> list[BaseEvent]:
        status = data.get("status")
        answer = self.fold.answer
        if answer is None:
            return []
        out: list[BaseEvent] = []
        if status in ("start", "delta") and self.text != answer.id:
            out += self._open_step(ANSWER_STEP) if self.step is None else []
            if self.text is not None:
                out.append(TextMessageEndEvent(message_id=self.text, timestamp=now_ms()))
            self.text = answer.id
            out.append(TextMessageStartEvent(message_id=answer.id, role="assistant", timestamp=now_ms()))
        content = data.get("content")
        if status == "delta" and isinstance(content, str) and content:
            out.append(TextMessageContentEvent(message_id=answer.id, delta=content, timestamp=now_ms()))
        elif status == "done" and self.text is not None:
            out.append(TextMessageEndEvent(message_id=self.text, timestamp=now_ms()))
            self.text = None
        return out

    async def _done(self, data: Mapping[str, Any]) -> list[BaseEvent]:
        status = data.get("status")
        usage = token_usage(data)
        if status == "failed":
            return self.error("run_failed", str(data.get("error") or "the run failed"), usage)
        if status == "cancelled" and not self.protocol_1:
            return self.error("cancelled", "cancelled")
        out = self._close()
        answer = self.fold.answer
        if status == "completed" and answer is not None and answer.text and answer.text != self.fold.streamed:
            # The answer the run ends with is not the text streamed (E-04's fallback), or none
            # streamed: it comes as a message of its own, the partial one gone from the snapshot.
            if self.fold.streamed:
                retract = await self.snapshot()
                retract.messages = [m for m in retract.messages if m.id != answer.id]
                out.append(retract)
            stamp = now_ms()
            out += self._open_step(ANSWER_STEP)
            out += [
                TextMessageStartEvent(message_id=answer.id, role="assistant", timestamp=stamp),
                TextMessageContentEvent(message_id=answer.id, delta=answer.text, timestamp=stamp),
                TextMessageEndEvent(message_id=answer.id, timestamp=stamp),
            ]
            out += self._close_step()
        self.client.apply(out)
        if not self._client_holds_run():
            out.append(await self.snapshot())
        if status == "cancelled":
            out.append(self.finished(outcome=RunFinishedCancelledOutcome()))
            return out
        result = {
            "run_id": self.fold.run_id,
            "answer": data.get("answer") or "",
            "usage": data.get("usage") or {},
        }
        out.append(self.finished(result=result, usage=usage))
        return out
