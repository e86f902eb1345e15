"""A run's resumable state, and its checkpoints (RUNS.md R-01, R-02).

The tool loop keeps everything it needs to go on in a ``LoopState``: the messages the model sees,
the ones kept as history, the trace for synthesis, the follow-ups taken in, the drift guards'
counters, and the reply whose tool calls are in progress (``PendingReply``). At every safe point
the engine hands a ``Checkpointer`` what changed since the previous checkpoint (``Journal.delta``):
a small dict of JSON-ready values, so that the 50th checkpoint costs what the first one does.

``RunCheckpoint.fold`` reads a run's deltas back, in order, into the state a new attempt starts
from. Nothing here does I/O: where checkpoints are kept is the caller's business.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from app.engine.events import Usage
from app.engine.synthesis import TraceStep
from app.llm.base import ChatMessage, ToolCall

ReplyKind = Literal["tools", "final", "unparsed"]


class Checkpointer(Protocol):
    """Where the engine's checkpoints go (the run manager keeps them in the database)."""

    def record(self, delta: dict[str, Any]) -> None:
        """Queue one checkpoint (what changed since the previous one); never waits for I/O."""
        ...

    async def durable(self) -> None:
        """Return once every checkpoint recorded so far is stored: before a tool call that must
        not run twice, the record that it started has to survive the worker."""
        ...

    # Optionally ``wants_full() -> bool``: the next checkpoint must hold the whole state (the
    # store lost one, and what changed since then does not fold into the run's state any more).


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """A tool call the model asked for."""

    call_id: str
    tool_name: str
    args: dict[str, Any]
    args_error: str | None = None
    """Set when the model's arguments were unusable (not JSON, not an object): the call is not run."""


@dataclass(frozen=True, slots=True)
class CallRecord:
    """How one tool call ended, as the model sees it."""

    observation: str
    """Exactly what the LLM sees."""
    error: str | None
    ran: bool
    """The tool really executed (not blocked, arguments usable, tool exists): a "real" tool call."""
    counted: bool = True
    """The cycle detector counts it (E-20); a call a person refused is no repeat of a real call."""


@dataclass(frozen=True, slots=True)
class AwaitingCall:
    """A call that waits for a person's decision (RUNS.md A-02)."""

    call_id: str
    approval_id: str
    expires_at: str
    tool_name: str
    args: dict[str, Any]
    """The arguments it asks to run with (after the PreToolUse hooks' rewrites)."""
    iteration: int
    client: bool = False
    """It waits for the client's result of a tool the client runs, not for a decision (C-02)."""


@dataclass(slots=True)
class PendingReply:
    """An LLM reply of the loop whose iteration is not finished: its calls run or are about to.

    Checkpointed right after the reply (R-01), then once per finished call; a new attempt that
    finds it takes the recorded results as they are and runs only the calls without one (R-05).
    """

    iteration: int
    kind: ReplyKind
    reasoning: str
    answer: str
    calls: tuple[PlannedCall, ...]
    injected: bool
    """Follow-ups were taken in right after the reply (JSON mode drains before the tools)."""
    results: dict[str, CallRecord] = field(default_factory=dict)
    """By call id, the calls that finished."""
    started: set[str] = field(default_factory=set)
    """Calls of tools that must not run twice, recorded (and stored) just before they started."""
    awaiting: dict[str, AwaitingCall] = field(default_factory=dict)
    """By call id, the calls that asked for a person's approval or wait for a client's result
    (decided and answered ones included)."""
    decided: set[str] = field(default_factory=set)
    """Calls whose decision the run has announced (its ``approval`` event is out)."""


@dataclass(slots=True)
class LoopOutcome:
    answer: str
    iterations: int
    steps: list[TraceStep]
    tools_used: int
    follow_ups: list[str]
    """Interrupt texts injected during the loop, for synthesis."""
    error: str | None = None
    """Set when the loop could not reach a usable LLM: the run fails."""
    exhausted: bool = False
    """True when ``max_iterations`` ran out and ``answer`` is the E-15 fallback."""
    awaiting: tuple[AwaitingCall, ...] = ()
    """The loop stopped for these calls' decisions (A-02): the run waits, it has not ended."""


@dataclass(slots=True)
class LoopState:
    """Everything the tool loop has done so far; a new attempt starts from a copy of it."""

    messages: list[ChatMessage]
    """What the LLM sees, system prompt first."""
    kept: list[ChatMessage]
    """The run's messages worth keeping as history: no engine nudges, no superseded answers."""
    steps: list[TraceStep] = field(default_factory=list)
    follow_ups: list[str] = field(default_factory=list)
    cycles: dict[str, int] = field(default_factory=dict)
    """The cycle detector's counts (E-20), by call fingerprint."""
    call_ids: set[str] = field(default_factory=set)
    """Every tool call id of the run: ids are made unique, so idempotency keys are too."""
    iteration: int = 0
    """The last iteration that finished."""
    bad_replies: int = 0
    last_unparsed: bool = False
    reflection_calls: int = 0
    checklist_fired: bool = False
    tools_used: int = 0
    pending: PendingReply | None = None
    follow_up_position: int | None = None
    """How far the run took its conversation's follow-ups (the queue's position, where it has one):
    a new attempt takes them from there."""


# ---- encoding ----------------------------------------------------------------------------------


def message_to_json(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            [c.id, c.name, c.arguments, dict(c.extra)] if c.extra else [c.id, c.name, c.arguments]
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    if message.pinned:
        out["pinned"] = True
    if message.reasoning:
        out["reasoning"] = message.reasoning
    return out


def message_from_json(data: Mapping[str, Any]) -> ChatMessage:
    return ChatMessage(
        role=data["role"],
        content=data.get("content"),
        tool_calls=tuple(
            ToolCall(id=c[0], name=c[1], arguments=c[2], extra=c[3] if len(c) > 3 else None)
            for c in data.get("tool_calls", ())
        ),
        tool_call_id=data.get("tool_call_id"),
        name=data.get("name"),
        pinned=bool(data.get("pinned", False)),
        reasoning=data.get("reasoning"),
    )


def _step_to_json(step: TraceStep) -> list[Any]:
    return [step.tool_name, dict(step.args), step.observation, step.error]


def _step_from_json(data: Sequence[Any]) -> TraceStep:
    return TraceStep(tool_name=data[0], args=data[1], observation=data[2], error=data[3])


def _call_to_json(call: PlannedCall) -> list[Any]:
    return [call.call_id, call.tool_name, call.args, call.args_error]


def _call_from_json(data: Sequence[Any]) -> PlannedCall:
    return PlannedCall(call_id=data[0], tool_name=data[1], args=dict(data[2]), args_error=data[3])


def _record_to_json(record: CallRecord) -> list[Any]:
    if record.counted:
        return [record.observation, record.error, record.ran]
    return [record.observation, record.error, record.ran, False]


def _record_from_json(data: Sequence[Any]) -> CallRecord:
    counted = bool(data[3]) if len(data) > 3 else True
    return CallRecord(observation=data[0], error=data[1], ran=bool(data[2]), counted=counted)


def _awaiting_to_json(call: AwaitingCall) -> list[Any]:
    out = [call.approval_id, call.expires_at, call.tool_name, call.args, call.iteration]
    if call.client:
        out.append(True)
    return out


def _awaiting_from_json(call_id: str, data: Sequence[Any]) -> AwaitingCall:
    client = bool(data[5]) if len(data) > 5 else False
    return AwaitingCall(call_id, data[0], data[1], data[2], dict(data[3]), int(data[4]), client)


def _pending_to_json(pending: PendingReply) -> dict[str, Any]:
    return {
        "iteration": pending.iteration,
        "kind": pending.kind,
        "reasoning": pending.reasoning,
        "answer": pending.answer,
        "calls": [_call_to_json(c) for c in pending.calls],
        "injected": pending.injected,
    }


def _pending_from_json(data: Mapping[str, Any]) -> PendingReply:
    return PendingReply(
        iteration=int(data["iteration"]),
        kind=data["kind"],
        reasoning=data["reasoning"],
        answer=data["answer"],
        calls=tuple(_call_from_json(c) for c in data["calls"]),
        injected=bool(data["injected"]),
    )


def _outcome_to_json(outcome: LoopOutcome) -> dict[str, Any]:
    return {
        "answer": outcome.answer,
        "iterations": outcome.iterations,
        "tools_used": outcome.tools_used,
        "error": outcome.error,
        "exhausted": outcome.exhausted,
    }


# ---- recording ---------------------------------------------------------------------------------


class Journal:
    """Turns the loop's state into checkpoints: each one holds only what changed since the last.

    Lists that only grow are recorded from where the previous checkpoint left off; the message
    list, which compaction replaces, is recorded whole once after each compaction (``base``).
    """

    def __init__(self, checkpointer: Checkpointer, state: LoopState, *, restored: bool = False) -> None:
        self._checkpointer = checkpointer
        self._state = state
        # A restored state is what the stored checkpoints already say, messages included.
        self._messages_ref: list[ChatMessage] | None = state.messages if restored else None
        self._messages = len(state.messages) if restored else 0
        self._kept = len(state.kept) if restored else 0
        self._steps = len(state.steps) if restored else 0
        self._follow_ups = len(state.follow_ups) if restored else 0
        self._cycles: dict[str, int] = dict(state.cycles) if restored else {}
        self._call_ids: set[str] = set(state.call_ids) if restored else set()
        self._pending: PendingReply | None = state.pending if restored else None
        self._results = len(state.pending.results) if restored and state.pending else 0
        self._started = len(state.pending.started) if restored and state.pending else 0
        self._awaiting = len(state.pending.awaiting) if restored and state.pending else 0
        self._decided = len(state.pending.decided) if restored and state.pending else 0
        self.selected: list[str] | None = None
        """The tools selection kept, if it ran: a whole-state checkpoint says it again."""
        self._usage: Usage | None = None

    def start(self, initial_messages: int) -> None:
        """The loop begins with ``initial_messages`` messages that need no recording."""
        self._messages_ref = self._state.messages
        # A new attempt rebuilds the run's first messages (system prompt, history, question)
        # itself: the checkpoints leave them out.
        self._messages = initial_messages

    def checkpoint(self, usage: Usage, **extra: Any) -> None:
        """Record what changed, with ``extra`` (``outcome=``, ``selected=``) as given; the whole
        state when the checkpointer asks for it."""
        self._usage = usage
        if self._wants_full():
            self._record_full(usage, **extra)
        else:
            self._checkpointer.record(self.delta(usage, **extra))

    def _wants_full(self) -> bool:
        wants_full = getattr(self._checkpointer, "wants_full", None)
        return wants_full is not None and bool(wants_full())

    def _record_full(self, usage: Usage, **extra: Any) -> None:
        self._forget()
        if self.selected is not None and "selected" not in extra:
            extra["selected"] = self.selected
        delta = self.delta(usage, **extra)
        delta["full"] = 1
        self._checkpointer.record(delta)

    def _forget(self) -> None:
        """As if nothing had been recorded: the next delta holds everything."""
        self._messages_ref = None
        self._messages = self._kept = self._steps = self._follow_ups = 0
        self._cycles = {}
        self._call_ids = set()
        self._pending = None
        self._results = self._started = self._awaiting = self._decided = 0

    async def durable(self) -> None:
        if self._usage is not None and self._wants_full():
            # The store lost a checkpoint: what is stored does not hold the run's state until a
            # whole-state checkpoint is, and that is what must survive the worker now.
            self._record_full(self._usage)
        await self._checkpointer.durable()

    def delta(self, usage: Usage, **extra: Any) -> dict[str, Any]:
        s = self._state
        out: dict[str, Any] = {
            "v": [
                s.iteration,
                s.bad_replies,
                s.last_unparsed,
                s.reflection_calls,
                s.checklist_fired,
                s.tools_used,
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.total_tokens,
                usage.llm_calls,
                s.follow_up_position,
            ]
        }
        if s.messages is not self._messages_ref:
            out["base"] = [message_to_json(m) for m in s.messages]
            self._messages_ref = s.messages
            self._messages = len(s.messages)
        elif len(s.messages) > self._messages:
            out["m"] = [message_to_json(m) for m in s.messages[self._messages :]]
            self._messages = len(s.messages)
        if len(s.kept) > self._kept:
            out["k"] = [message_to_json(m) for m in s.kept[self._kept :]]
            self._kept = len(s.kept)
        if len(s.steps) > self._steps:
            out["s"] = [_step_to_json(step) for step in s.steps[self._steps :]]
            self._steps = len(s.steps)
        if len(s.follow_ups) > self._follow_ups:
            out["f"] = s.follow_ups[self._follow_ups :]
            self._follow_ups = len(s.follow_ups)
        if len(s.cycles) != len(self._cycles) or s.cycles != self._cycles:
            out["c"] = {k: v for k, v in s.cycles.items() if self._cycles.get(k) != v}
            self._cycles = dict(s.cycles)
        if len(s.call_ids) > len(self._call_ids):
            out["i"] = sorted(s.call_ids - self._call_ids)
            self._call_ids = set(s.call_ids)
        self._pending_delta(out)
        for key, value in extra.items():
            if key == "outcome":
                out["o"] = _outcome_to_json(value)
            elif key == "selected":
                out["sel"] = list(value)
            else:
                raise TypeError(f"unknown checkpoint field {key!r}")
        return out

    def _pending_delta(self, out: dict[str, Any]) -> None:
        pending = self._state.pending
        if pending is not self._pending:
            out["p"] = _pending_to_json(pending) if pending is not None else None
            self._pending = pending
            self._results = self._started = self._awaiting = self._decided = 0
        if pending is None:
            return
        if len(pending.results) > self._results:
            # Results are added in completion order; dicts keep it.
            out["r"] = {k: _record_to_json(v) for k, v in list(pending.results.items())[self._results :]}
            self._results = len(pending.results)
        if len(pending.started) > self._started:
            out["st"] = sorted(pending.started)
            self._started = len(pending.started)
        if len(pending.awaiting) > self._awaiting:
            added = list(pending.awaiting.values())[self._awaiting :]
            out["aw"] = {call.call_id: _awaiting_to_json(call) for call in added}
            self._awaiting = len(pending.awaiting)
        if len(pending.decided) > self._decided:
            out["dc"] = sorted(pending.decided)
            self._decided = len(pending.decided)


# ---- restoring ---------------------------------------------------------------------------------


@dataclass(slots=True)
class RunCheckpoint:
    """A run's state as its stored checkpoints say, folded in order: where a new attempt starts.

    ``messages_base`` is the model's message list as of the last compaction (None: the run's own
    first messages, which the agent rebuilds), ``messages_added`` what followed it.
    """

    selected: list[str] | None = None
    messages_base: list[ChatMessage] | None = None
    messages_added: list[ChatMessage] = field(default_factory=list)
    kept: list[ChatMessage] = field(default_factory=list)
    steps: list[TraceStep] = field(default_factory=list)
    follow_ups: list[str] = field(default_factory=list)
    cycles: dict[str, int] = field(default_factory=dict)
    call_ids: set[str] = field(default_factory=set)
    values: list[Any] | None = None
    pending: PendingReply | None = None
    outcome: dict[str, Any] | None = None
    """The loop's outcome once it ended (synthesis comes next)."""
    checkpoints: int = 0

    @classmethod
    def fold(cls, deltas: Iterable[Mapping[str, Any]]) -> RunCheckpoint:
        state = cls()
        for delta in deltas:
            state.apply(delta)
        return state

    @property
    def empty(self) -> bool:
        return self.checkpoints == 0

    def apply(self, delta: Mapping[str, Any]) -> None:
        if delta.get("full"):
            # The whole state: what came before (the store may have lost some of it) is replaced.
            fresh = RunCheckpoint(selected=self.selected, checkpoints=self.checkpoints)
            for name in self.__dataclass_fields__:
                setattr(self, name, getattr(fresh, name))
        self.checkpoints += 1
        self.values = list(delta["v"])
        if "sel" in delta:
            self.selected = list(delta["sel"])
        if "base" in delta:
            self.messages_base = [message_from_json(m) for m in delta["base"]]
            self.messages_added = []
        if "m" in delta:
            self.messages_added.extend(message_from_json(m) for m in delta["m"])
        if "k" in delta:
            self.kept.extend(message_from_json(m) for m in delta["k"])
        if "s" in delta:
            self.steps.extend(_step_from_json(step) for step in delta["s"])
        if "f" in delta:
            self.follow_ups.extend(delta["f"])
        if "c" in delta:
            self.cycles.update(delta["c"])
        if "i" in delta:
            self.call_ids.update(delta["i"])
        if "p" in delta:
            self.pending = _pending_from_json(delta["p"]) if delta["p"] is not None else None
        if self.pending is not None:
            for call_id, record in delta.get("r", {}).items():
                self.pending.results[call_id] = _record_from_json(record)
            self.pending.started.update(delta.get("st", ()))
            for call_id, call in delta.get("aw", {}).items():
                self.pending.awaiting[call_id] = _awaiting_from_json(call_id, call)
            self.pending.decided.update(delta.get("dc", ()))
        if "o" in delta:
            self.outcome = dict(delta["o"])

    def undecided(self) -> list[AwaitingCall]:
        """The calls the run waits on: asked for approval, with no decision taken in yet (A-02)."""
        p = self.pending
        if p is None:
            return []
        return [call for key, call in p.awaiting.items() if key not in p.results and key not in p.decided]

    def usage(self) -> Usage:
        if self.values is None:
            return Usage()
        return Usage(*self.values[6:10])

    def iterations(self) -> int:
        return int(self.values[0]) if self.values is not None else 0

    def follow_up_position(self) -> int | None:
        return self.values[10] if self.values is not None else None

    def encode(self) -> dict[str, Any]:
        """The whole state as one delta (what a new attempt stores as its first checkpoint)."""
        out: dict[str, Any] = {"v": list(self.values) if self.values is not None else _ZERO_VALUES}
        if self.selected is not None:
            out["sel"] = list(self.selected)
        if self.messages_base is not None:
            out["base"] = [message_to_json(m) for m in self.messages_base]
        if self.messages_added:
            out["m"] = [message_to_json(m) for m in self.messages_added]
        if self.kept:
            out["k"] = [message_to_json(m) for m in self.kept]
        if self.steps:
            out["s"] = [_step_to_json(step) for step in self.steps]
        if self.follow_ups:
            out["f"] = list(self.follow_ups)
        if self.cycles:
            out["c"] = dict(self.cycles)
        if self.call_ids:
            out["i"] = sorted(self.call_ids)
        if self.pending is not None:
            out["p"] = _pending_to_json(self.pending)
            if self.pending.results:
                out["r"] = {k: _record_to_json(v) for k, v in self.pending.results.items()}
            if self.pending.started:
                out["st"] = sorted(self.pending.started)
            if self.pending.awaiting:
                out["aw"] = {k: _awaiting_to_json(v) for k, v in self.pending.awaiting.items()}
            if self.pending.decided:
                out["dc"] = sorted(self.pending.decided)
        if self.outcome is not None:
            out["o"] = dict(self.outcome)
        return out

    def loop_state(self, initial: list[ChatMessage]) -> LoopState:
        """The live state of the loop, on the run's first messages ``initial`` (system prompt,
        history, question), rebuilt by the caller as the first attempt built them."""
        base = list(self.messages_base) if self.messages_base is not None else list(initial)
        values = self.values if self.values is not None else _ZERO_VALUES
        kept = list(self.kept) if self.kept else [m for m in initial[-1:]]
        return LoopState(
            messages=base + list(self.messages_added),
            kept=kept,
            steps=list(self.steps),
            follow_ups=list(self.follow_ups),
            cycles=dict(self.cycles),
            call_ids=set(self.call_ids),
            iteration=int(values[0]),
            bad_replies=int(values[1]),
            last_unparsed=bool(values[2]),
            reflection_calls=int(values[3]),
            checklist_fired=bool(values[4]),
            tools_used=int(values[5]),
            pending=self.pending,
            follow_up_position=values[10],
        )

    def loop_outcome(self) -> LoopOutcome | None:
        if self.outcome is None:
            return None
        o = self.outcome
        return LoopOutcome(
            answer=o["answer"],
            iterations=int(o["iterations"]),
            steps=list(self.steps),
            tools_used=int(o["tools_used"]),
            follow_ups=list(self.follow_ups),
            error=o["error"],
            exhausted=bool(o["exhausted"]),
        )


_ZERO_VALUES: list[Any] = [0, 0, False, 0, False, 0, 0, 0, 0, 0, None]
