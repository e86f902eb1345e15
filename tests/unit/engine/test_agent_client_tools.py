"""Tools the client runs (FACES.md C-01..C-03), in the engine: a call of one stops the run at a
checkpoint, like a call that waits for a person, with its start event marked ``client``; a new
attempt with the client's result (or with none in time) feeds it to the model as the call's
observation; the reply's other calls run at once and are kept; without anyone to answer, the model
is told; an approval policy never asks a person about a tool the client runs."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from app.engine import prompts
from app.engine.agent import AgentConfig, AgentResult, ReActAgent
from app.engine.approvals import ApprovalDecision, ApprovalTicket, RequireApproval
from app.engine.events import ApprovalRequested, IterationDone, IterationStarted, RunDone
from app.engine.hooks import HookRegistry, ToolCallContext
from app.engine.state import RunCheckpoint
from app.llm.base import ChatMessage
from app.runs.approvals import client_observation
from app.tools.registry import Tool, ToolRegistry, client_tool
from tests.support.scripted import ScriptedLLM, json_final, json_tool, native_tools, text
from tests.unit.engine.agent_support import JSON_ONLY, NATIVE, EventLog, MakeLLM, PushQueue, answer
from tests.unit.engine.test_agent_resume import Store

EXPIRES = "2026-12-05T00:00:00+00:00"
LOCATION_SCHEMA = {
    "type": "object",
    "properties": {"precision": {"type": "string", "enum": ["city", "street"]}},
    "required": ["precision"],
}
ARGS = {"precision": "city"}
CALL_ID = "call_0_get_location"
"""The id ``native_tools`` gives the first call of get_location."""


class Desk:
    """The run's approvals and client calls as a test keeps them: tickets recorded, decisions and
    results given by the test."""

    def __init__(self, decisions: Mapping[str, ApprovalDecision] | None = None) -> None:
        self.decisions = dict(decisions or {})
        self.tickets: list[tuple[str, str, dict[str, Any], int, bool]] = []

    def ticket(
        self,
        call_id: str,
        tool_name: str,
        tool_args: Mapping[str, Any],
        iteration: int,
        *,
        client: bool = False,
    ) -> ApprovalTicket:
        self.tickets.append((call_id, tool_name, dict(tool_args), iteration, client))
        return ApprovalTicket(f"{'tcl' if client else 'apr'}_{call_id}", EXPIRES)

    def decision(self, call_id: str) -> ApprovalDecision | None:
        return self.decisions.get(call_id)


class Adder:
    """A server tool ``add`` that counts its executions."""

    def __init__(self) -> None:
        self.runs: list[dict[str, int]] = []

    def tool(self) -> Tool:
        async def add(a: int, b: int) -> str:
            self.runs.append({"a": a, "b": b})
            return str(a + b)

        schema = {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        }
        return Tool("add", "Add two integers.", schema, add)


def tools(adder: Adder | None = None) -> ToolRegistry:
    return ToolRegistry.of(
        [(adder or Adder()).tool(), client_tool("get_location", "Where the user is.", LOCATION_SCHEMA)]
    )


async def run(
    llm: ScriptedLLM,
    desk: Desk | None,
    store: Store,
    *,
    registry: ToolRegistry | None = None,
    resume: RunCheckpoint | None = None,
    hooks: HookRegistry | None = None,
) -> tuple[AgentResult, EventLog]:
    log = EventLog()
    result = await ReActAgent(llm, registry or tools(), AgentConfig(completion_check=False), hooks).run(
        "where am I?",
        sink=log,
        run_id="run_1",
        checkpointer=store,
        resume=resume,
        usage=resume.usage() if resume is not None else None,
        interrupts=PushQueue(),
        approvals=desk,
    )
    return result, log


def tool_message(messages: list[ChatMessage], call_id: str) -> ChatMessage:
    (found,) = [m for m in messages if m.role == "tool" and m.tool_call_id == call_id]
    return found


@pytest.mark.parametrize("native", [True, False], ids=["native", "json"])
async def test_a_client_tool_call_stops_the_run_waiting_with_a_client_start_event(
    scripted_llm: MakeLLM, native: bool
) -> None:
    reply = native_tools(("get_location", ARGS)) if native else json_tool("get_location", ARGS)
    llm = scripted_llm([reply], abilities=NATIVE if native else JSON_ONLY)
    desk, store = Desk(), Store()

    result, log = await run(llm, desk, store)

    assert result.status == "waiting"
    (awaiting,) = result.awaiting
    call_id = CALL_ID if native else "call_run_1_1_0"  # made by the loop: the run id's tail, iteration, index
    assert (awaiting.call_id, awaiting.tool_name, awaiting.args, awaiting.client) == (
        call_id,
        "get_location",
        ARGS,
        True,
    )
    assert awaiting.approval_id == f"tcl_{call_id}" and awaiting.expires_at == EXPIRES
    assert desk.tickets == [(call_id, "get_location", ARGS, 1, True)]
    (started,) = log.of(IterationStarted)
    assert started.data() == {
        "type": "iteration",
        "status": "start",
        "iteration": 1,
        "tool_name": "get_location",
        "tool_args": ARGS,
        "call_id": call_id,
        "client": True,
        "expires_at": EXPIRES,
    }
    assert started.approval_id == f"tcl_{call_id}"  # kept by the service, never on the wire
    assert not log.of(ApprovalRequested) and not log.of(IterationDone) and not log.of(RunDone)
    # The model was offered the client's tool beside the server's, with its own schema.
    if native:
        offered = {t["function"]["name"]: t["function"] for t in llm.calls[0].kwargs["tools"]}
        assert sorted(offered) == ["add", "get_location"]
        assert offered["get_location"]["parameters"] == LOCATION_SCHEMA
        assert offered["get_location"]["description"] == "Where the user is."
    else:
        assert "get_location" in (llm.calls[0].messages[0].content or "")
    # The checkpoint knows the call waits for the client.
    state = store.fold()
    assert [(c.call_id, c.client) for c in state.undecided()] == [(call_id, True)]


@pytest.mark.parametrize(
    ("stored", "observation", "error"),
    [
        pytest.param({"output": "Paris, France"}, "Paris, France", None, id="string"),
        pytest.param(
            {"output": {"city": "Paris", "lat": 48.85, "tags": ["fr"]}},
            '{"city":"Paris","lat":48.85,"tags":["fr"]}',
            None,
            id="json-object",
        ),
        pytest.param({"output": [1, None, True]}, "[1,null,true]", None, id="json-array"),
        pytest.param({"output": ""}, "(the tool returned no output)", None, id="empty-string"),
        pytest.param(
            {"error": "the user did not allow location access"},
            "Error: the user did not allow location access",
            "the user did not allow location access",
            id="error",
        ),
    ],
)
async def test_the_clients_result_becomes_the_calls_observation_in_the_next_attempt(
    scripted_llm: MakeLLM, stored: dict[str, Any], observation: str, error: str | None
) -> None:
    desk, store = Desk(), Store()
    first, _ = await run(scripted_llm([native_tools(("get_location", ARGS))], abilities=NATIVE), desk, store)
    assert first.status == "waiting"
    output, failure = client_observation(stored)
    answered = ApprovalDecision(f"tcl_{CALL_ID}", "answered", output=output, error=failure)
    llm = scripted_llm([text("You are in Paris."), answer("You are ", "in Paris.")], abilities=NATIVE)
    again = Desk({CALL_ID: answered})

    result, log = await run(llm, again, store, resume=store.fold())

    assert result.status == "completed" and result.answer == "You are in Paris."
    sent = llm.calls[0].messages
    assert (sent[-1].role, sent[-1].tool_call_id, sent[-1].content) == ("tool", CALL_ID, observation)
    assert tool_message(result.messages, CALL_ID).content == observation
    (done,) = log.of(IterationDone)
    assert (done.call_id, done.client, done.tool_name) == (CALL_ID, True, "get_location")
    assert (done.observation, done.error) == (observation, error)
    assert done.data()["client"] is True and done.data()["call_id"] == CALL_ID
    # Its start was announced when it was asked for: not again, and nothing asked twice.
    assert not log.of(IterationStarted) and again.tickets == []
    assert result.tools_used == 1
    assert log.done.status == "completed"


async def test_no_result_in_time_tells_the_model_so_and_is_no_repeat_for_the_cycle_detector(
    scripted_llm: MakeLLM,
) -> None:
    desk, store = Desk(), Store()
    await run(scripted_llm([native_tools(("get_location", ARGS))], abilities=NATIVE), desk, store)
    expired = ApprovalDecision(f"tcl_{CALL_ID}", "expired", reason="no result came in time")
    llm = scripted_llm([text("I could not find out."), answer()], abilities=NATIVE)

    result, log = await run(llm, Desk({CALL_ID: expired}), store, resume=store.fold())

    told = prompts.client_call_expired("get_location")
    assert result.status == "completed"
    assert llm.calls[0].messages[-1].content == told
    assert tool_message(result.messages, CALL_ID).content == told
    (done,) = log.of(IterationDone)
    assert (done.call_id, done.client, done.observation, done.error) == (CALL_ID, True, told, told)
    assert result.tools_used == 0
    assert not any("get_location" in key for key in store.fold().cycles)
    # A client's call is no approval: nothing announces a decision.
    assert "approval_decided" not in log.kinds


async def test_a_new_attempt_before_the_result_waits_again_without_asking_or_announcing_twice(
    scripted_llm: MakeLLM,
) -> None:
    desk, store = Desk(), Store()
    await run(scripted_llm([native_tools(("get_location", ARGS))], abilities=NATIVE), desk, store)

    again, log = await run(scripted_llm([], abilities=NATIVE), desk, store, resume=store.fold())

    assert again.status == "waiting"
    assert [(c.call_id, c.client) for c in again.awaiting] == [(CALL_ID, True)]
    assert not log.of(IterationStarted) and not log.of(RunDone)
    assert len(desk.tickets) == 1


async def test_the_replys_server_call_runs_first_and_its_result_is_kept_for_the_client_result(
    scripted_llm: MakeLLM,
) -> None:
    adder, desk, store = Adder(), Desk(), Store()
    reply = native_tools(("add", {"a": 2, "b": 3}), ("get_location", ARGS))

    first, log = await run(scripted_llm([reply], abilities=NATIVE), desk, store, registry=tools(adder))

    assert first.status == "waiting"
    assert [c.tool_name for c in first.awaiting] == ["get_location"]
    assert adder.runs == [{"a": 2, "b": 3}]
    (added,) = log.of(IterationDone)
    assert (added.tool_name, added.call_id, added.observation) == ("add", "call_0_add", "5")
    assert not added.client
    started = [(e.tool_name, e.client) for e in log.of(IterationStarted)]
    assert started == [("add", False), ("get_location", True)]
    assert [t[0] for t in desk.tickets] == ["call_1_get_location"]

    answered = ApprovalDecision("tcl_call_1_get_location", "answered", output="Paris")
    llm = scripted_llm([text("5, in Paris."), answer()], abilities=NATIVE)
    result, log2 = await run(
        llm, Desk({"call_1_get_location": answered}), store, registry=tools(adder), resume=store.fold()
    )

    assert result.status == "completed"
    assert adder.runs == [{"a": 2, "b": 3}], "the server call ran again"
    # Both results follow the reply together, in call order.
    sent = llm.calls[0].messages
    assert [m.role for m in sent[-3:]] == ["assistant", "tool", "tool"]
    assert [c.id for c in sent[-3].tool_calls] == ["call_0_add", "call_1_get_location"]
    assert [(m.tool_call_id, m.content) for m in sent[-2:]] == [
        ("call_0_add", "5"),
        ("call_1_get_location", "Paris"),
    ]
    assert [(e.tool_name, e.client) for e in log2.of(IterationDone)] == [("get_location", True)]
    assert result.tools_used == 2


async def test_without_anyone_to_answer_the_model_is_told_the_client_tool_is_unavailable(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm([native_tools(("get_location", ARGS)), text("No idea."), answer()], abilities=NATIVE)

    result, log = await run(llm, None, Store())

    unavailable = prompts.client_call_unavailable("get_location")
    assert result.status == "completed" and not result.awaiting
    assert llm.calls[1].messages[-1].content == unavailable
    assert tool_message(result.messages, CALL_ID).content == unavailable
    (started,) = log.of(IterationStarted)
    assert (started.client, started.call_id) == (False, CALL_ID)
    (done,) = log.of(IterationDone)
    assert (done.observation, done.error) == (unavailable, unavailable)
    assert result.tools_used == 0


async def test_an_approval_policy_for_every_tool_asks_no_approval_for_a_client_tool(
    scripted_llm: MakeLLM,
) -> None:
    policy = RequireApproval(["*"])
    hooks = HookRegistry()
    hooks.add_pre(policy)
    adder, desk, store = Adder(), Desk(), Store()
    reply = native_tools(("add", {"a": 1, "b": 1}), ("get_location", ARGS))

    result, log = await run(
        scripted_llm([reply], abilities=NATIVE), desk, store, registry=tools(adder), hooks=hooks
    )

    assert result.status == "waiting"
    # The server tool waits for a person; the client's tool waits for its result, unasked.
    assert [(c.tool_name, c.client) for c in result.awaiting] == [("add", False), ("get_location", True)]
    (requested,) = log.of(ApprovalRequested)
    assert requested.tool_name == "add"
    assert [(e.tool_name, e.client) for e in log.of(IterationStarted)] == [("get_location", True)]
    assert [(t[1], t[4]) for t in desk.tickets] == [("add", False), ("get_location", True)]
    assert adder.runs == []

    def ctx(tool: Tool) -> ToolCallContext:
        return ToolCallContext("run_1", "conv_1", 1, tool.name, {}, tool)

    registry = tools()
    location, add = registry.get("get_location"), registry.get("add")
    assert location is not None and add is not None
    assert await policy.pre_tool_use(ctx(location)) is None
    asked = await policy.pre_tool_use(ctx(add))
    assert asked is not None and asked.ask


async def test_a_json_mode_client_result_reaches_the_model_as_its_observation(scripted_llm: MakeLLM) -> None:
    desk, store = Desk(), Store()
    await run(scripted_llm([json_tool("get_location", ARGS)], abilities=JSON_ONLY), desk, store)
    output, _ = client_observation({"output": {"city": "Paris"}})
    answered = ApprovalDecision("tcl_call_run_1_1_0", "answered", output=output)
    llm = scripted_llm([json_final("You are in Paris."), answer("You are in Paris.")], abilities=JSON_ONLY)

    result, _ = await run(llm, Desk({"call_run_1_1_0": answered}), store, resume=store.fold())

    assert result.status == "completed"
    compact = json.dumps({"city": "Paris"}, separators=(",", ":"))
    expected = prompts.json_observation("get_location", compact, failed=False)
    assert llm.calls[0].messages[-1].content == expected
