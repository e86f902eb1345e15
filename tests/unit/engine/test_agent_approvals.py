"""Calls that wait for a person (RUNS.md A-01..A-04), in the engine: the run stops at a checkpoint
with the calls that need a decision, the reply's other calls done; a new agent carries it on from
its checkpoints once the decisions are in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from app.engine import prompts
from app.engine.agent import AgentConfig, AgentResult, ReActAgent
from app.engine.approvals import ApprovalDecision, ApprovalTicket, RequireApproval
from app.engine.events import ApprovalDecided, ApprovalRequested, IterationStarted, RunDone
from app.engine.hooks import HookRegistry, PreToolDecision, ToolCallContext
from app.engine.state import RunCheckpoint
from tests.unit.engine.agent_support import EventLog, PushQueue
from tests.unit.engine.test_agent_resume import ANSWER, Crash, PlanningLLM, Store, Tools

EXPIRES = "2026-12-04T00:00:00+00:00"


class Gate:
    """The run's approvals as a test keeps them: tickets by call id, decisions given by the test."""

    def __init__(self, decisions: Mapping[str, ApprovalDecision] | None = None) -> None:
        self.decisions = dict(decisions or {})
        self.tickets: list[str] = []

    def ticket(
        self,
        call_id: str,
        tool_name: str,
        tool_args: Mapping[str, Any],
        iteration: int,
        *,
        client: bool = False,
    ) -> ApprovalTicket:
        self.tickets.append(call_id)
        return ApprovalTicket(f"apr_{call_id}", EXPIRES)

    def decision(self, call_id: str) -> ApprovalDecision | None:
        return self.decisions.get(call_id)


class Deny:
    async def pre_tool_use(self, ctx: ToolCallContext) -> PreToolDecision | None:
        return PreToolDecision(allow=False, reason="no sending today") if ctx.tool_name == "send" else None


async def run(
    llm: PlanningLLM,
    tools: Tools,
    store: Store,
    gate: Gate | None,
    *,
    resume: RunCheckpoint | None = None,
    extra_hooks: tuple[object, ...] = (),
) -> tuple[AgentResult, EventLog]:
    hooks = HookRegistry()
    hooks.add_pre(RequireApproval(["send"]))
    for hook in extra_hooks:
        hooks.add(hook)
    log = EventLog()
    result = await ReActAgent(llm, tools.registry(), AgentConfig(completion_check=False), hooks).run(
        "add things",
        sink=log,
        run_id="run_1",
        checkpointer=store,
        resume=resume,
        usage=resume.usage() if resume is not None else None,
        interrupts=PushQueue(),
        approvals=gate,
    )
    return result, log


def send_call_id(result: AgentResult) -> str:
    (awaiting,) = result.awaiting
    assert awaiting.tool_name == "send" and awaiting.args == {"to": "bob"}
    return awaiting.call_id


@pytest.mark.parametrize("native", [True, False], ids=["native", "json"])
async def test_a_call_that_needs_approval_stops_the_run_and_an_approval_carries_it_on(native: bool) -> None:
    tools, store = Tools(), Store()
    result, log = await run(PlanningLLM(native=native), tools, store, Gate())

    assert result.status == "waiting"
    call_id = send_call_id(result)
    assert not log.of(RunDone), "a waiting run has not ended"
    (requested,) = log.of(ApprovalRequested)
    assert (requested.approval_id, requested.call_id, requested.tool_name) == (
        f"apr_{call_id}",
        call_id,
        "send",
    )
    assert requested.tool_args == {"to": "bob"} and requested.expires_at == EXPIRES
    assert "send" not in [name for name, _ in tools.runs]
    if native:
        # The reply's other call ran at once, and is never run again.
        assert [name for name, _ in tools.runs].count("add") == 2
    state = store.fold()
    assert [c.call_id for c in state.undecided()] == [call_id]

    decision = ApprovalDecision(f"apr_{call_id}", "approved")
    result2, log2 = await run(
        PlanningLLM(native=native), tools, store, Gate({call_id: decision}), resume=state
    )

    assert result2.status == "completed"
    assert result2.answer == "".join(ANSWER)
    assert [name for name, _ in tools.runs].count("send") == 1
    if native:
        assert [name for name, _ in tools.runs].count("add") == 3  # one more round after the approval
    (decided,) = log2.of(ApprovalDecided)
    assert (decided.status, decided.tool_args) == ("approved", {"to": "bob"})
    assert log2.kinds.index("approval_decided") < log2.kinds.index("iteration_start")
    if native:
        # The reply's tool results follow it together, in call order (E-06).
        i = next(i for i, m in enumerate(result2.messages) if m.tool_calls and len(m.tool_calls) == 2)
        follow = result2.messages[i + 1 : i + 3]
        assert [m.tool_call_id for m in follow] == [c.id for c in result2.messages[i].tool_calls]
        assert follow[1].content == "sent to bob"


async def test_an_approval_with_edited_arguments_runs_them_and_the_model_reads_which_ran() -> None:
    tools, store = Tools(), Store()
    result, _ = await run(PlanningLLM(native=True), tools, store, Gate())
    call_id = send_call_id(result)
    edited = ApprovalDecision(f"apr_{call_id}", "approved", tool_args={"to": "alice"})

    result2, log2 = await run(
        PlanningLLM(native=True), tools, store, Gate({call_id: edited}), resume=store.fold()
    )

    assert result2.status == "completed"
    started = [e for e in log2.of(IterationStarted) if e.tool_name == "send"]
    assert [e.tool_args for e in started] == [{"to": "alice"}]
    observation = next(m.content for m in result2.messages if m.tool_call_id == call_id)
    assert observation == prompts.edited_call("send", {"to": "alice"}, "sent to alice")
    assert log2.of(ApprovalDecided)[0].tool_args == {"to": "alice"}


@pytest.mark.parametrize("status", ["denied", "expired"])
async def test_a_denied_or_expired_call_does_not_run_and_is_no_repeat_for_the_cycle_detector(
    status: str,
) -> None:
    tools, store = Tools(), Store()
    result, _ = await run(PlanningLLM(native=True), tools, store, Gate())
    call_id = send_call_id(result)
    decision = ApprovalDecision(f"apr_{call_id}", status, reason="not to bob")  # type: ignore[arg-type]

    result2, log2 = await run(
        PlanningLLM(native=True), tools, store, Gate({call_id: decision}), resume=store.fold()
    )

    assert result2.status == "completed"
    assert "send" not in [name for name, _ in tools.runs]
    observation = next(m.content for m in result2.messages if m.tool_call_id == call_id)
    assert observation == prompts.denied_call("send", "not to bob", expired=status == "expired")
    assert (log2.of(ApprovalDecided)[0].status, log2.of(ApprovalDecided)[0].reason) == (status, "not to bob")
    assert not any("send" in key for key in store.fold().cycles)


async def test_a_new_attempt_before_the_decision_waits_again_without_asking_twice() -> None:
    tools, store = Tools(), Store()
    gate = Gate()
    result, _ = await run(PlanningLLM(native=True), tools, store, gate)
    call_id = send_call_id(result)

    again, log = await run(PlanningLLM(native=True), tools, store, gate, resume=store.fold())

    assert again.status == "waiting" and [c.call_id for c in again.awaiting] == [call_id]
    assert not log.of(ApprovalRequested) and gate.tickets == [call_id]
    assert [name for name, _ in tools.runs].count("add") == 2


async def test_an_announced_decision_is_not_announced_again_by_a_later_attempt() -> None:
    tools, store = Tools(crash_in="send"), Store()
    result, _ = await run(PlanningLLM(native=True), tools, store, Gate())
    call_id = send_call_id(result)
    gate = Gate({call_id: ApprovalDecision(f"apr_{call_id}", "approved")})
    with pytest.raises(Crash):
        await run(PlanningLLM(native=True), tools, store, gate, resume=store.fold())

    # The call was cut off while it ran: it is not run again, and the decision's event is out.
    result3, log3 = await run(PlanningLLM(native=True), tools, store, gate, resume=store.fold())

    assert result3.status == "completed"
    assert not log3.of(ApprovalDecided)
    assert next(m.content for m in result3.messages if m.tool_call_id == call_id) == prompts.interrupted_call(
        "send"
    )


async def test_without_anyone_to_ask_the_call_does_not_run_and_the_model_is_told() -> None:
    tools, store = Tools(), Store()
    result, log = await run(PlanningLLM(native=True), tools, store, None)

    assert result.status == "completed"
    assert "send" not in [name for name, _ in tools.runs]
    assert not log.of(ApprovalRequested)
    observations = [m.content for m in result.messages if m.role == "tool"]
    assert prompts.approval_unavailable("send") in observations


async def test_a_blocking_hook_wins_over_a_request_for_approval() -> None:
    tools, store = Tools(), Store()
    result, log = await run(PlanningLLM(native=True), tools, store, Gate(), extra_hooks=(Deny(),))

    assert result.status == "completed"
    assert not log.of(ApprovalRequested)
    assert "no sending today" in [m.content for m in result.messages if m.role == "tool"]
