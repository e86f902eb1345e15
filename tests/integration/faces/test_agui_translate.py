"""The AG-UI translation of event logs a live service only makes when things go wrong (design note
D1.6, D3): a worker lost mid-run (``phase resumed``: what the lost attempt did after its
checkpoint is taken back) and a synthesis that failed mid-stream (ENGINE E-04: ``done.answer`` is
the fallback, not the text streamed). The translator is fed stored events as ``follow_run`` yields
them; its snapshots read the thread through a stand-in for the database. Every response must pass
``ag-ui-validate`` with nothing to say, and its last snapshot must be what a fresh read gives.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

from ag_ui.core import UserMessage
from ag_ui_validate.pytest_plugin import assert_valid_agui

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


def translate(log: Log) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        translator = Translator(
            StoredThread(),  # type: ignore[arg-type]
            thread_id="t",
            run_id="r",
            protocol_1=True,
            fold=RunFold(RUN),
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
