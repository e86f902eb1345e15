"""The AG-UI translation of event logs a live service only makes when things go wrong (design note
D1.6, D3): a worker lost mid-run (``phase resumed``: what the lost attempt did after its
checkpoint is taken back) and a synthesis that failed mid-stream (ENGINE E-04: ``done.answer`` is
the fallback, not the text streamed). The translator is fed stored events as ``follow_run`` yields
them; its snapshots read the thread through a stand-in for the database. Every response must pass
``ag-ui-validate`` with nothing to say, and its last snapshot must be what a fresh read gives.

A response to a client that held the thread ends without a snapshot only where its events made the
client's messages exactly the run's (app.api.faces.agui.reducer): something taken back, a
follow-up folded in, a tool's error or an id the client's history holds already bring the
snapshot all the same.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

from ag_ui.core import UserMessage
from ag_ui_validate.pytest_plugin import assert_valid_agui

from app.api.faces.agui.reducer import ClientMessages
from app.api.faces.agui.snapshot import RunFold, Thread
from app.api.faces.agui.translate import Translator, parks_at
from app.db.repositories.approvals import ApprovalRecord
from app.streaming.bus import StoredEvent

RUN = "run_T"


class Log:
    """A run's stored events, made one by one with increasing ids."""

    def __init__(self) -> None:
        self.events: list[StoredEvent] = []

    def add(self, kind: str, **data: Any) -> str:
        event_id = f"1700000000000-{len(self.events)}"
        self.events.append(StoredEvent(event_id, kind, json.dumps({**data, "run_id": RUN}), RUN))
        return event_id


class StoredThread:
    """The database's side of a snapshot: the question, then the run's fold."""

    async def read(self, live: RunFold | None = None) -> Thread:
        assert live is not None
        messages = [UserMessage(id="q-1", content="what is 6*7?"), *live.messages({})]
        return Thread(messages, set())


def translate(
    log: Log, *, synced: bool = True, client: ClientMessages | None = None, protocol_1: bool = True
) -> list[dict[str, Any]]:
    """The response to a 1.0 client that sent the thread as it was (``synced``; ``client``: what
    follows the messages its history holds, none by default)."""

    async def run() -> list[dict[str, Any]]:
        translator = Translator(
            StoredThread(),  # type: ignore[arg-type]
            thread_id="t",
            run_id="r",
            protocol_1=protocol_1,
            fold=RunFold(RUN),
            synced=synced,
            client=client,
        )
        out = [translator.started()]
        for event in log.events:
            out += await translator.feed(event)
        return [json.loads(e.model_dump_json(by_alias=True)) for e in out]

    events = asyncio.run(run())
    assert_valid_agui(events, max_warnings=0)
    return events


def fresh_snapshot(log: Log) -> list[dict[str, Any]]:
    """What a later request's snapshot holds of the run: its stored events folded anew."""
    fold = RunFold(RUN)
    for event in log.events:
        fold.apply(event)
    thread = asyncio.run(StoredThread().read(fold))
    return [json.loads(m.model_dump_json(by_alias=True)) for m in thread.messages]


def first_iteration(log: Log) -> str:
    """The first thought and its calculator call; the id of the call's result."""
    log.add("step", type="thinking", status="start", iteration=1)
    log.add("step", type="thinking", status="done", iteration=1, reasoning="")
    return calculator(log)


def calculator(log: Log) -> str:
    args = {"expression": "6*7"}
    log.add(
        "step",
        type="iteration",
        status="start",
        iteration=1,
        tool_name="calculator",
        tool_args=args,
        call_id="c1",
    )
    return log.add(
        "step",
        type="iteration",
        status="done",
        iteration=1,
        tool_name="calculator",
        observation="6*7 = 42",
        error=None,
        iter_elapsed=0.01,
        call_id="c1",
    )


def answer(log: Log, *deltas: str) -> None:
    log.add("step", type="thinking", status="start", iteration=2)
    log.add("step", type="thinking", status="done", iteration=2, reasoning="")
    log.add("step", type="answer", status="start")
    log.add("answer", status="start")
    for delta in deltas:
        log.add("answer", status="delta", content=delta)


def done(log: Log, answer_text: str, error: str | None = None) -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "llm_calls": 2}
    log.add(
        "done", answer=answer_text, iterations=2, usage=usage, elapsed=0.1, status="completed", error=error
    )


def texts(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["messageId"], e.get("delta", "")) for e in events if e["type"].startswith("TEXT_MESSAGE_")]


def test_a_lost_attempt_mid_answer_is_taken_back_and_the_answer_restarts_under_a_new_id() -> None:
    log = Log()
    checkpoint = first_iteration(log)
    answer(log, "The ans")
    log.add("phase", phase="resumed", attempt=2, after=checkpoint)
    answer(log, "The answer", ".")
    log.add("answer", status="done")
    done(log, "The answer.")

    events = translate(log)

    assert texts(events) == [
        (f"ans_{RUN}_1", ""),
        (f"ans_{RUN}_1", "The ans"),
        (f"ans_{RUN}_1", ""),
        (f"ans_{RUN}_2", ""),
        (f"ans_{RUN}_2", "The answer"),
        (f"ans_{RUN}_2", "."),
        (f"ans_{RUN}_2", ""),
    ]
    kinds = [e["type"] for e in events]
    resumed_at = next(i for i, e in enumerate(events) if e["type"] == "CUSTOM")
    assert events[resumed_at]["name"] == "agentstream.phase" and events[resumed_at]["value"]["attempt"] == 2
    taken_back = events[resumed_at + 1]
    assert taken_back["type"] == "MESSAGES_SNAPSHOT"
    assert [m["id"] for m in taken_back["messages"]] == ["q-1", f"asst_{RUN}_1", "tool_c1"]
    assert kinds.count("TOOL_CALL_START") == 1 and kinds.count("TOOL_CALL_RESULT") == 1
    assert events[-2]["messages"] == fresh_snapshot(log)
    assert events[-2]["messages"][-1] == {"id": f"ans_{RUN}_2", "role": "assistant", "content": "The answer."}
    assert events[-1]["result"]["answer"] == "The answer."


def test_a_call_redone_after_a_lost_attempt_is_not_started_twice_and_its_result_comes_again() -> None:
    log = Log()
    log.add("step", type="thinking", status="start", iteration=1)
    checkpoint = log.add("step", type="thinking", status="done", iteration=1, reasoning="")
    calculator(log)
    log.add("phase", phase="resumed", attempt=2, after=checkpoint)
    calculator(log)
    answer(log, "Forty-two.")
    log.add("answer", status="done")
    done(log, "Forty-two.")

    events = translate(log)

    kinds = [e["type"] for e in events]
    assert kinds.count("TOOL_CALL_START") == 1 and kinds.count("TOOL_CALL_RESULT") == 2
    taken_back = next(e for e in events if e["type"] == "MESSAGES_SNAPSHOT")
    # The call this response showed stays (the new attempt's events for it need no second start),
    # its result is gone until it comes again.
    assert [m["id"] for m in taken_back["messages"]] == ["q-1", f"asst_{RUN}_1"]
    assert events[-2]["messages"] == fresh_snapshot(log)


def test_a_fallback_answer_replaces_the_partial_text_under_an_id_of_its_own() -> None:
    log = Log()
    first_iteration(log)
    answer(log, "The ans")
    log.add("answer", status="done")
    done(log, "6*7 is 42 (the answer could not be written).", error="synthesis failed")

    events = translate(log)

    assert texts(events)[-3:] == [
        (f"ans_{RUN}_1_f", ""),
        (f"ans_{RUN}_1_f", "6*7 is 42 (the answer could not be written)."),
        (f"ans_{RUN}_1_f", ""),
    ]
    snapshots = [e["messages"] for e in events if e["type"] == "MESSAGES_SNAPSHOT"]
    assert [m["id"] for m in snapshots[0]] == ["q-1", f"asst_{RUN}_1", "tool_c1"]  # the partial text gone
    assert snapshots[-1] == fresh_snapshot(log)
    assert snapshots[-1][-1]["id"] == f"ans_{RUN}_1_f"


def plain_run(log: Log) -> None:
    log.add("step", type="thinking", status="start", iteration=1)
    log.add("step", type="thinking", status="done", iteration=1, reasoning="Use calculator.")
    calculator(log)
    answer(log, "Forty", "-two.")
    log.add("answer", status="done")
    done(log, "Forty-two.")


def snapshots(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    return [e["messages"] for e in events if e["type"] == "MESSAGES_SNAPSHOT"]


def test_a_run_its_events_told_a_client_that_held_the_thread_ends_without_a_snapshot() -> None:
    log = Log()
    plain_run(log)

    events = translate(log)
    stale = translate(log, synced=False)  # the client's history was not the thread
    older = translate(log, protocol_1=False)  # a client before 1.0 may not build every message

    assert snapshots(events) == [] and events[-1]["type"] == "RUN_FINISHED"
    for told in (stale, older):
        assert [e["type"] for e in told if e["type"] != "MESSAGES_SNAPSHOT"] == [e["type"] for e in events]
        assert snapshots(told) == [fresh_snapshot(log)] and told[-2]["type"] == "MESSAGES_SNAPSHOT"


def test_what_the_events_cannot_tell_the_client_comes_with_the_snapshot() -> None:
    follow_up = Log()
    follow_up.add("step", type="thinking", status="start", iteration=1)
    follow_up.add("inject", type="inject", content="also say hello")
    answer(follow_up, "Hello.")
    follow_up.add("answer", status="done")
    done(follow_up, "Hello.")
    failed_call = Log()
    failed_call.add("step", type="thinking", status="start", iteration=1)
    failed_call.add(
        "step",
        type="iteration",
        status="start",
        iteration=1,
        tool_name="calculator",
        tool_args={},
        call_id="c1",
    )
    failed_call.add(
        "step",
        type="iteration",
        status="done",
        iteration=1,
        tool_name="calculator",
        observation="Error: the expression is empty",
        error="the expression is empty",
        call_id="c1",
    )
    answer(failed_call, "No.")
    failed_call.add("answer", status="done")
    done(failed_call, "No.")
    for log in (follow_up, failed_call):
        events = translate(log)
        assert [e["type"] for e in events][-2:] == ["MESSAGES_SNAPSHOT", "RUN_FINISHED"]
        assert snapshots(events)[-1] == fresh_snapshot(log)


def test_ids_the_clients_history_holds_already_bring_the_snapshot() -> None:
    """A provider that numbers calls from 0 in every reply repeats a call id of an earlier run: the
    client adds the new call's arguments and result to the old one, and the snapshot puts it right."""
    log = Log()
    plain_run(log)

    calls = translate(log, client=ClientMessages(["q-0", "asst_old_1", "tool_c1"], ["c1"]))
    messages = translate(log, client=ClientMessages([f"ans_{RUN}_1"]))
    others = translate(log, client=ClientMessages(["q-0", "asst_old_1"], ["c0"]))

    assert snapshots(calls) == [fresh_snapshot(log)]
    assert snapshots(messages) == [fresh_snapshot(log)]
    assert snapshots(others) == []


def pending(approval_id: str, call_id: str, kind: str = "approval") -> ApprovalRecord:
    now = datetime.now(UTC)
    return ApprovalRecord(
        id=approval_id,
        run_id=RUN,
        conversation_id="conv_T",
        owner="alice",
        call_id=call_id,
        tool_name="calculator",
        tool_args={},
        iteration=1,
        status="pending",
        reason=None,
        decided_args=None,
        decided_by=None,
        created_at=now,
        expires_at=now,
        decided_at=None,
        kind=kind,
    )


def test_a_response_parks_only_while_something_its_waiting_names_is_pending() -> None:
    """What the response does at a ``waiting`` that still waited when ``follow_run`` stopped there,
    with what is pending when it reads again: parks, or follows on (all settled meanwhile, or the
    run went on and parks again on new ones: the events up to that park come first)."""
    log = Log()
    log.add("phase", phase="waiting", approval_ids=["apr_1"], call_ids=["call_0_get_location"])
    waiting = log.events[-1]
    approval = pending("apr_1", "call_0_calculator")
    call = pending("cli_1", "call_0_get_location", kind="client")

    assert parks_at(waiting, [approval], [call])
    assert parks_at(waiting, [approval], [])
    assert parks_at(waiting, [], [call])
    assert not parks_at(waiting, [], [])
    assert not parks_at(waiting, [pending("apr_2", "call_1_calculator")], [])
