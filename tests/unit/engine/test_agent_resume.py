"""Checkpoints and resume (RUNS.md R-01, R-02, R-04, R-05, R-06): a run stopped at any checkpoint
and carried on by a new agent from its folded checkpoints ends exactly as the run that was never
stopped, and no tool call is silently repeated."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import orjson
import pytest

from app.engine import prompts
from app.engine.agent import AgentConfig, AgentResult, ReActAgent
from app.engine.events import AnswerDelta, IterationDone, IterationStarted, Usage
from app.engine.state import Checkpointer, RunCheckpoint
from app.llm.base import ChatMessage, ChatResult, StreamEnd, StreamItem, TextDelta, TokenUsage, ToolCall
from app.tools.registry import Tool, ToolInvocation, ToolRegistry
from tests.unit.engine.agent_support import EventLog, PushQueue

ANSWER = ["The ", "sum ", "is ", "done."]
INTERRUPTED = prompts.interrupted_call("send")


class Crash(BaseException):
    """A worker's death: nothing after it runs (not an Exception, so nothing catches it)."""


class PlanningLLM:
    """A model whose reply depends only on the messages: the same conversation gives the same
    calls, whichever attempt asks. Native or JSON mode; ``steps`` tool rounds, the second of
    them with a parallel ``send`` (a tool that must not run twice) beside ``add``."""

    def __init__(self, *, native: bool, steps: int = 3, ids: tuple[str, str] = ("call_0", "call_1")) -> None:
        self.native = native
        self.steps = steps
        self.ids = ids
        self.chat_calls = 0
        self.stream_calls = 0

    @property
    def abilities(self) -> Mapping[str, bool]:
        return {"tool_call": self.native, "json_mode": False, "streaming": True}

    @property
    def model_name(self) -> str:
        return "planner"

    def _rounds(self, messages: Sequence[ChatMessage]) -> int:
        if self.native:
            return sum(1 for m in messages if m.role == "assistant" and m.tool_calls)
        return sum(1 for m in messages if m.role == "user" and (m.content or "").startswith("Observation"))

    async def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResult:
        self.chat_calls += 1
        done = self._rounds(messages)
        usage = TokenUsage(10, 1, 11)
        if done >= self.steps:
            if self.native:
                return ChatResult(content="final", usage=usage)
            return ChatResult(content=json.dumps({"type": "final_answer", "answer": "final"}), usage=usage)
        if self.native:
            calls = [ToolCall(self.ids[0], "add", json.dumps({"a": done, "b": 1}))]
            if done == 1:
                calls.append(ToolCall(self.ids[1], "send", json.dumps({"to": "bob"})))
            return ChatResult(content=None, tool_calls=tuple(calls), usage=usage)
        name, args = ("send", {"to": "bob"}) if done == 1 else ("add", {"a": done, "b": 1})
        action = {"type": "tool_call", "tool_name": name, "tool_args": args, "reasoning": f"step {done}"}
        return ChatResult(content=json.dumps(action), usage=usage)

    def stream_chat(self, messages: Sequence[ChatMessage]) -> AsyncIterator[StreamItem]:
        self.stream_calls += 1
        return self._stream()

    async def _stream(self) -> AsyncIterator[StreamItem]:
        for delta in ANSWER:
            yield TextDelta(delta)
        yield StreamEnd(TokenUsage(20, 4, 24))


class Tools:
    """``add`` (idempotent) and ``send`` (must not run twice), counting executions by key."""

    def __init__(self, crash_in: str | None = None) -> None:
        self.runs: list[tuple[str, str]] = []
        self.keys: list[str] = []
        self.crash_in = crash_in

    def registry(self) -> ToolRegistry:
        async def add(a: int, b: int, invocation: ToolInvocation) -> str:
            self.runs.append(("add", invocation.idempotency_key))
            if self.crash_in == "add":
                self.crash_in = None
                raise Crash
            return str(a + b)

        async def send(to: str, invocation: ToolInvocation) -> str:
            self.runs.append(("send", invocation.idempotency_key))
            if self.crash_in == "send":
                self.crash_in = None
                raise Crash
            return f"sent to {to}"

        schema = {"type": "object", "properties": {}}
        return ToolRegistry.of(
            [
                Tool("add", "Add.", schema, add, idempotent=True, takes_invocation=True),
                Tool("send", "Send.", schema, send, takes_invocation=True),
            ]
        )


class Store:
    """Checkpoints kept as JSON text, as the database keeps them; ``crash_after`` stops the run
    right after that many were recorded (and made durable)."""

    def __init__(self, crash_after: int | None = None) -> None:
        self.rows: list[bytes] = []
        self.crash_after = crash_after
        self.durable_calls = 0

    def record(self, delta: dict[str, Any]) -> None:
        self.rows.append(orjson.dumps(delta))
        if self.crash_after is not None and len(self.rows) >= self.crash_after:
            raise Crash

    async def durable(self) -> None:
        self.durable_calls += 1

    def fold(self) -> RunCheckpoint:
        return RunCheckpoint.fold(orjson.loads(row) for row in self.rows)


def agent(llm: PlanningLLM, tools: Tools) -> ReActAgent:
    return ReActAgent(llm, tools.registry(), AgentConfig(completion_check=False))


async def run_once(
    llm: PlanningLLM, tools: Tools, store: Store, resume: RunCheckpoint | None = None
) -> tuple[AgentResult, EventLog]:
    log = EventLog()
    result = await agent(llm, tools).run(
        "add things",
        sink=log,
        run_id="run_1",
        checkpointer=store,
        resume=resume,
        usage=resume.usage() if resume is not None else None,
        interrupts=PushQueue(),
    )
    return result, log


def shape(messages: Sequence[ChatMessage]) -> list[tuple[Any, ...]]:
    return [(m.role, m.content, tuple((c.id, c.name, c.arguments) for c in m.tool_calls)) for m in messages]


async def reference(native: bool) -> tuple[AgentResult, int]:
    store = Store()
    result, _ = await run_once(PlanningLLM(native=native), Tools(), store)
    return result, len(store.rows)


@pytest.mark.parametrize("native", [True, False], ids=["native", "json"])
async def test_a_run_stopped_at_any_checkpoint_resumes_to_the_same_end(native: bool) -> None:
    expected, checkpoints = await reference(native)
    assert checkpoints >= 8  # replies, results, iteration ends, the outcome

    for crash_after in range(1, checkpoints + 1):
        tools = Tools()
        store = Store(crash_after=crash_after)
        with pytest.raises(Crash):
            await run_once(PlanningLLM(native=native), tools, store)
        store.crash_after = None
        resumed = store.fold()
        # Stopped right after "send" was recorded as started: it may have run, so it is not run
        # again and the model is told; otherwise the run ends exactly as the reference.
        pending = resumed.pending
        cut_off = pending is not None and any(c not in pending.results for c in pending.started)

        llm = PlanningLLM(native=native)
        result, log = await run_once(llm, tools, store, resumed)

        assert result.status == "completed", crash_after
        assert result.answer == "".join(ANSWER)
        want = shape(expected.messages)
        if cut_off:
            told = {
                "sent to bob": INTERRUPTED,
                prompts.json_observation("send", "sent to bob", failed=False): prompts.json_observation(
                    "send", INTERRUPTED, failed=True
                ),
            }
            want = [(role, told.get(content, content), calls) for role, content, calls in want]
        assert shape(result.messages) == want, crash_after
        assert result.iterations == expected.iterations
        # A call whose result was checkpointed never runs again; "send" runs at most once.
        sends = [key for name, key in tools.runs if name == "send"]
        assert len(sends) == (0 if cut_off else 1), (crash_after, tools.runs)
        # Usage adds up: what the checkpoints said, and every call of the new attempt.
        assert result.usage.llm_calls == resumed.usage().llm_calls + llm.chat_calls + llm.stream_calls
        # The answer is streamed again by the new attempt, whole.
        assert "".join(e.content for e in log.of(AnswerDelta)) == result.answer


@pytest.mark.parametrize("native", [True, False], ids=["native", "json"])
async def test_a_call_cut_off_is_run_again_only_if_its_tool_is_idempotent(native: bool) -> None:
    # Cut off inside "add": it runs again, under the same idempotency key.
    tools = Tools(crash_in="add")
    store = Store()
    with pytest.raises(Crash):
        await run_once(PlanningLLM(native=native), tools, store)
    first_key = tools.runs[0][1]
    result, _ = await run_once(PlanningLLM(native=native), tools, store, store.fold())
    assert result.status == "completed"
    assert tools.runs[1] == ("add", first_key)
    assert first_key.startswith("run_1:")

    # Cut off inside "send": the model is told, and it does not run again.
    tools = Tools(crash_in="send")
    store = Store()
    with pytest.raises(Crash):
        await run_once(PlanningLLM(native=native), tools, store)
    assert store.durable_calls >= 1, "the start of a call that must not run twice was not made durable"
    resumed = store.fold()
    assert resumed.pending is not None and resumed.pending.started
    result, log = await run_once(PlanningLLM(native=native), tools, store, resumed)
    assert result.status == "completed"
    assert [name for name, _ in tools.runs].count("send") == 1
    interrupted = [e for e in log.of(IterationDone) if e.tool_name == "send"]
    assert len(interrupted) == 1 and interrupted[0].error is not None
    assert "may or may not have taken effect" in interrupted[0].observation
    observations = [m.content or "" for m in result.messages if m.role in ("tool", "user")]
    assert any("may or may not have taken effect" in text for text in observations)


async def test_results_already_checkpointed_are_not_run_or_announced_again() -> None:
    store = Store()
    await run_once(PlanningLLM(native=True), Tools(), store)
    # Keep the checkpoints up to the first result of the round with two parallel calls.
    for keep in range(1, len(store.rows) + 1):
        partial = RunCheckpoint.fold(orjson.loads(row) for row in store.rows[:keep])
        if partial.pending is not None and len(partial.pending.calls) == 2 and partial.pending.results:
            break
    else:
        raise AssertionError("no checkpoint holds one result of the parallel round")
    assert partial.pending is not None
    (finished,) = partial.pending.results
    store.rows = store.rows[:keep]

    tools = Tools()
    result, log = await run_once(PlanningLLM(native=True), tools, store, store.fold())

    assert result.status == "completed"
    round_two = [e for e in log.of(IterationStarted) if e.iteration == partial.pending.iteration]
    assert len(round_two) == 1, "only the call without a result runs (and is announced) again"
    ran_keys = {key for _, key in tools.runs}
    assert f"run_1:{finished}" not in ran_keys


async def test_a_checkpoint_holds_only_what_changed() -> None:
    store = Store()
    llm = PlanningLLM(native=True, steps=40)
    await agent(llm, Tools()).run(
        "add things", sink=EventLog(), run_id="r", checkpointer=store, usage=Usage()
    )
    sizes = [len(row) for row in store.rows]
    early, late = sizes[4:10], sizes[-12:-6]
    # The 40th round's checkpoints are about the size of the first rounds' (R-02).
    assert max(late) < 2 * max(early), (early, late)


async def test_a_run_without_checkpoints_behaves_as_before() -> None:
    tools = Tools()
    log = EventLog()
    result = await agent(PlanningLLM(native=True), tools).run("add things", sink=log, run_id="r")
    assert result.status == "completed"
    assert [name for name, _ in tools.runs] == ["add", "add", "send", "add"]


@pytest.mark.parametrize(
    "ids",
    [("call_0", "call_1"), ("", "")],
    ids=["repeated on every reply", "empty (the LLM layer leaves them)"],
)
async def test_call_ids_and_keys_are_unique_within_a_run_when_the_provider_repeats_them(
    ids: tuple[str, str],
) -> None:
    tools = Tools()
    result = await agent(PlanningLLM(native=True, ids=ids), tools).run(
        "add things", sink=EventLog(), run_id="r"
    )

    keys = [key for _, key in tools.runs]
    assert len(keys) == 4 and len(set(keys)) == 4, keys
    ids = [c.id for m in result.messages for c in m.tool_calls]
    assert len(ids) == len(set(ids)) == 4
    answered = [m.tool_call_id for m in result.messages if m.role == "tool"]
    assert answered == ids, "each tool message answers the call id its assistant message names"


async def test_a_keyed_call_runs_only_once_the_reply_that_names_it_is_stored() -> None:
    """A new attempt asks the model again when the reply was not stored: the idempotency key of a
    call of the old reply must not have been handed out (the new reply's call could get it)."""
    store = Store()
    durable_rows: list[int] = []
    checked: list[bool] = []

    async def durable() -> None:
        durable_rows.append(len(store.rows))

    store.durable = durable  # type: ignore[method-assign]
    tools = Tools()
    registry = tools.registry()

    async def watched_add(a: int, b: int, invocation: ToolInvocation) -> str:
        reply_row = max(i for i, row in enumerate(store.rows) if b'"p":{' in row)
        checked.append(bool(durable_rows) and durable_rows[-1] > reply_row)
        return str(a + b)

    add = registry.get("add")
    assert add is not None
    registry = ToolRegistry.of([replace(add, func=watched_add), *(t for t in registry if t.name != "add")])
    await ReActAgent(PlanningLLM(native=True), registry, AgentConfig(completion_check=False)).run(
        "add things", sink=EventLog(), run_id="r", checkpointer=store
    )

    assert checked and all(checked), checked


# ---- a whole-state checkpoint after the store lost some ------------------------------------------


class RecordingLLM(PlanningLLM):
    """``PlanningLLM`` that keeps the messages of every loop call and, when the registry is large
    enough for tool selection, picks both tools (counted in ``selections``)."""

    def __init__(self, *, native: bool) -> None:
        super().__init__(native=native)
        self.loop_messages: list[list[ChatMessage]] = []
        self.selections = 0

    async def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResult:
        if (messages[0].content or "").startswith("You choose which tools"):
            self.selections += 1
            picked = json.dumps({"tools": ["add", "send"]})
            if self.native:
                call = ToolCall("pick", "select_tools", picked)
                return ChatResult(content=None, tool_calls=(call,), usage=TokenUsage(5, 1, 6))
            return ChatResult(content=picked, usage=TokenUsage(5, 1, 6))
        self.loop_messages.append(list(messages))
        return await super().chat(messages, **kwargs)


class LossyStore(Store):
    """A store that loses the checkpoints recorded in ``lose`` (one batch the database never got).
    With ``whole`` it asks for a whole-state checkpoint once it knows (``wants_full``), as the
    service's checkpointer does, until it gets one; ``full_rows`` are where those were kept."""

    def __init__(self, lose: range, *, whole: bool) -> None:
        super().__init__()
        self.lose = lose
        self.whole = whole
        self.recorded = 0
        self.lost = False
        self.asked_full: list[int] = []
        self.full_rows: list[int] = []

    def wants_full(self) -> bool:
        if self.whole and self.lost:
            self.asked_full.append(self.recorded)
            return True
        return False

    def record(self, delta: dict[str, Any]) -> None:
        index, self.recorded = self.recorded, self.recorded + 1
        if delta.get("full"):
            self.lost = False
            self.full_rows.append(len(self.rows))
        if index in self.lose:
            # The batch is known lost once its last checkpoint is given up.
            self.lost = self.lost or index == self.lose[-1]
            return
        self.rows.append(orjson.dumps(delta))


async def run_with(
    llm: PlanningLLM,
    store: Store,
    resume: RunCheckpoint | None = None,
    *,
    select: bool = False,
    tools: Tools | None = None,
) -> AgentResult:
    config = AgentConfig(completion_check=False, tool_selection_threshold=1 if select else 12)
    return await ReActAgent(llm, (tools or Tools()).registry(), config).run(
        "add things",
        sink=EventLog(),
        run_id="run_1",
        checkpointer=cast(Checkpointer, store),  # wants_full is optional (Journal.checkpoint)
        resume=resume,
        usage=resume.usage() if resume is not None else None,
        interrupts=PushQueue(),
    )


def fold(rows: Sequence[bytes]) -> RunCheckpoint:
    return RunCheckpoint.fold(orjson.loads(row) for row in rows)


def folded_state(state: RunCheckpoint, initial: list[ChatMessage]) -> dict[str, Any]:
    """What a new attempt starts from, field by field (the messages as the model sees them)."""
    return {
        "messages": state.loop_state(initial).messages,
        "kept": state.kept,
        "steps": state.steps,
        "follow_ups": state.follow_ups,
        "cycles": state.cycles,
        "call_ids": state.call_ids,
        "pending": state.pending,
        "values": state.values,
        "outcome": state.outcome,
        "selected": state.selected,
    }


async def reference_rows(native: bool, *, select: bool = False) -> tuple[list[bytes], list[ChatMessage]]:
    """The checkpoints of a run that lost nothing, and the run's first messages (system, question)."""
    llm, store = RecordingLLM(native=native), Store()
    result = await run_with(llm, store, select=select)
    assert result.status == "completed"
    return store.rows, llm.loop_messages[0]


@pytest.mark.parametrize("native", [True, False], ids=["native", "json"])
async def test_a_whole_state_checkpoint_after_lost_ones_folds_into_the_state_of_a_run_that_lost_none(
    native: bool,
) -> None:
    rows, initial = await reference_rows(native)
    checkpoints = len(rows)
    assert checkpoints >= 8
    assert [m.role for m in initial] == ["system", "user"]
    expected = folded_state(fold(rows), initial)
    pending_results = 0

    windows = [range(start, start + size) for size in (1, 2) for start in range(checkpoints - size)]
    for lose in windows:
        store = LossyStore(lose, whole=True)
        result = await run_with(RecordingLLM(native=native), store)
        assert result.status == "completed", lose
        # Asked once, for the checkpoint right after the lost batch, and that one holds everything:
        # the next safe point's, or, when a tool call's barrier (Journal.durable) comes first, one
        # of its own with the state as the last checkpoint left it.
        assert store.asked_full == [lose[-1] + 1], lose
        (full_row,) = store.full_rows
        at_barrier = len(store.rows) == checkpoints - len(lose) + 1
        assert len(store.rows) == checkpoints - len(lose) + at_barrier, lose
        assert folded_state(store.fold(), initial) == expected, lose

        # Stopped right after the whole-state checkpoint: the state is the reference's at that
        # point, and a new attempt from there ends exactly as one from the reference's.
        here = fold(store.rows[: full_row + 1])
        there = fold(rows[: lose[-1] + (1 if at_barrier else 2)])
        assert folded_state(here, initial) == folded_state(there, initial), lose
        pending_results += there.pending is not None and bool(there.pending.results)
        tools_here, tools_there = Tools(), Tools()
        resumed = await run_with(RecordingLLM(native=native), Store(), here, tools=tools_here)
        wanted = await run_with(RecordingLLM(native=native), Store(), there, tools=tools_there)
        assert resumed.status == wanted.status == "completed", lose
        assert resumed.answer == wanted.answer == "".join(ANSWER)
        assert shape(resumed.messages) == shape(wanted.messages), lose
        assert resumed.iterations == wanted.iterations and resumed.usage == wanted.usage
        assert [name for name, _ in tools_here.runs] == [name for name, _ in tools_there.runs], lose
    # States holding a reply's parallel calls with some results were compared (JSON mode has one
    # call a reply: its barrier comes before any result).
    assert pending_results >= (2 if native else 0)


@pytest.mark.parametrize("native", [True, False], ids=["native", "json"])
async def test_without_a_whole_state_checkpoint_the_kept_checkpoints_fold_into_another_state(
    native: bool,
) -> None:
    """What the whole-state checkpoint repairs: the deltas kept after a lost batch miss what it
    held (the checkpointer here never asks for a whole one)."""
    rows, initial = await reference_rows(native)
    expected = folded_state(fold(rows), initial)
    lost_messages = [i for i, row in enumerate(rows[:-1]) if b'"m":' in row]
    assert lost_messages

    for index in lost_messages:
        store = LossyStore(range(index, index + 1), whole=False)
        await run_with(RecordingLLM(native=native), store)
        assert store.asked_full == [] and store.full_rows == []
        state = folded_state(store.fold(), initial)
        assert state["messages"] != expected["messages"], index


@pytest.mark.parametrize("native", [True, False], ids=["native", "json"])
async def test_a_whole_state_checkpoint_says_again_which_tools_selection_kept(native: bool) -> None:
    rows, initial = await reference_rows(native, select=True)
    reference = fold(rows)
    assert reference.selected == ["add", "send"]
    assert b'"sel"' in rows[0] and all(b'"sel"' not in row for row in rows[1:])

    # The selection's own checkpoint is the one lost: the whole-state one after it names the tools.
    store = LossyStore(range(0, 1), whole=True)
    await run_with(RecordingLLM(native=native), store, select=True)
    (full_row,) = store.full_rows
    assert full_row == 0 and b'"sel"' in store.rows[0]
    assert folded_state(store.fold(), initial) == folded_state(reference, initial)

    # A new attempt from there uses that choice: it does not ask the model to select again.
    llm = RecordingLLM(native=native)
    resumed = await run_with(llm, Store(), fold(store.rows[:1]), select=True)
    assert llm.selections == 0
    assert resumed.status == "completed" and resumed.answer == "".join(ANSWER)
    expected = await run_with(RecordingLLM(native=native), Store(), select=True)
    assert shape(resumed.messages) == shape(expected.messages)
