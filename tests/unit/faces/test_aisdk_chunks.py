"""A run's events as AI SDK chunks (app/api/faces/aisdk/chunks.py), folded by the service
(fold.py) and by the ``ai`` package's own ``readUIMessageStream`` (in Node): the two folds agree on
every log here, and the message is what a user should see. The logs are the hard ones: a worker's
death inside a step and between steps, the fallback answer of E-04, a denial, a failure, a cancel,
and a continuation after a park that starts where the earlier response ended."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from app.api.faces.aisdk.chunks import Chunk, MessageChunks
from app.api.faces.aisdk.continuation import ResponseChunks
from app.api.faces.aisdk.fold import fold
from app.streaming.bus import StoredEvent
from tests.support.node import run_node

RUN = "run_x"


class Log:
    """A run's events with increasing ids."""

    def __init__(self) -> None:
        self.events: list[StoredEvent] = []

    def add(self, event: str, **data: Any) -> str:
        cursor = f"{1000 + len(self.events)}-0"
        payload = json.dumps({**data, "run_id": RUN})
        self.events.append(StoredEvent(cursor, event, payload, RUN))
        return cursor

    def iteration(self, n: int, *calls: str, reasoning: str = "") -> str:
        self.add("step", type="thinking", status="start", iteration=n)
        last = self.add("step", type="thinking", status="done", iteration=n, reasoning=reasoning)
        for call in calls:
            self.add(
                "step",
                type="iteration",
                status="start",
                iteration=n,
                tool_name="calc",
                tool_args={"e": call},
                call_id=call,
            )
            last = self.add(
                "step",
                type="iteration",
                status="done",
                iteration=n,
                tool_name="calc",
                observation=f"{call}=1",
                error=None,
                iter_elapsed=0.1,
                call_id=call,
            )
        return last

    def answer(self, *deltas: str) -> str:
        self.add("step", type="answer", status="start")
        self.add("answer", status="start")
        last = ""
        for delta in deltas:
            last = self.add("answer", status="delta", content=delta)
        self.add("answer", status="done")
        return last

    def done(self, status: str = "completed", answer: str = "", error: str | None = None) -> None:
        usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3, "llm_calls": 1}
        self.add(
            "done",
            answer=answer,
            iterations=2,
            usage=usage,
            elapsed=1.0,
            status=status,
            error=error,
            pending_injections=[],
            model="m",
        )


def chunks_of(events: list[StoredEvent], client_outputs: dict[str, Any] | None = None) -> list[Chunk]:
    async def output(call_id: str) -> dict[str, Any] | None:
        return (client_outputs or {}).get(call_id)

    async def go() -> list[Chunk]:
        translator = MessageChunks(RUN, output)
        out = translator.start()
        for event in events:
            out += await translator.event(event)
        return out

    return asyncio.run(go())


def logs() -> Iterator[tuple[str, Log, str]]:
    """(name, log, the text the message must end with)."""
    plain = Log()
    plain.add("phase", phase="selecting_tools", total_tools=3)
    plain.iteration(1, "c1", "c2", reasoning="use calc")
    plain.iteration(2)
    plain.answer("The ", "answer")
    plain.done(answer="The answer")
    yield "plain", plain, "The answer"

    died_answering = Log()
    died_answering.iteration(1, "c1")
    checkpoint = died_answering.iteration(2)
    died_answering.answer("The ans")  # the worker dies here; the next attempt starts after the checkpoint
    died_answering.add("phase", phase="resumed", attempt=2, after=checkpoint)
    died_answering.answer("The ", "answer")
    died_answering.done(answer="The answer")
    yield "died answering", died_answering, "The answer"

    died_in_step = Log()
    died_in_step.add("step", type="thinking", status="start", iteration=1)
    died_in_step.add("step", type="thinking", status="done", iteration=1, reasoning="two calls")
    died_in_step.add(
        "step",
        type="iteration",
        status="start",
        iteration=1,
        tool_name="calc",
        tool_args={"e": "c1"},
        call_id="c1",
    )
    after = died_in_step.add(
        "step",
        type="iteration",
        status="done",
        iteration=1,
        tool_name="calc",
        observation="c1=1",
        error=None,
        iter_elapsed=0.1,
        call_id="c1",
    )
    died_in_step.add(
        "step",
        type="iteration",
        status="start",
        iteration=1,
        tool_name="calc",
        tool_args={"e": "c2"},
        call_id="c2",
    )
    died_in_step.add("phase", phase="resumed", attempt=2, after=after)
    died_in_step.add(
        "step",
        type="iteration",
        status="start",
        iteration=1,
        tool_name="calc",
        tool_args={"e": "c2"},
        call_id="c2",
    )
    died_in_step.add(
        "step",
        type="iteration",
        status="done",
        iteration=1,
        tool_name="calc",
        observation="c2=1",
        error=None,
        iter_elapsed=0.1,
        call_id="c2",
    )
    died_in_step.answer("Done")
    died_in_step.done(answer="Done")
    yield "died in a step", died_in_step, "Done"

    died_twice = Log()
    first = died_twice.iteration(1, "c1")
    died_twice.iteration(2, "c2")
    died_twice.add("phase", phase="resumed", attempt=2, after=first)
    second = died_twice.iteration(2, "c2")
    died_twice.answer("Part")
    died_twice.add("phase", phase="resumed", attempt=3, after=second)
    died_twice.answer("Whole")
    died_twice.done(answer="Whole")
    yield "died twice", died_twice, "Whole"

    fallback = Log()
    fallback.iteration(1)
    fallback.answer("The ans")
    fallback.done(answer="A fallback answer.", error="synthesis failed")
    yield "fallback", fallback, "A fallback answer."

    denied = Log()
    denied.add("step", type="thinking", status="start", iteration=1)
    denied.add(
        "approval",
        status="requested",
        approval_id="apr_1",
        call_id="c1",
        tool_name="rm",
        tool_args={"p": "/"},
        iteration=1,
        expires_at="2030-01-01T00:00:00Z",
    )
    denied.add("phase", phase="waiting", approval_ids=["apr_1"], call_ids=[])
    denied.add("approval", status="denied", approval_id="apr_1", reason="no", tool_args={"p": "/"})
    denied.add(
        "step",
        type="iteration",
        status="start",
        iteration=1,
        tool_name="rm",
        tool_args={"p": "/"},
        call_id="c1",
    )
    denied.add(
        "step",
        type="iteration",
        status="done",
        iteration=1,
        tool_name="rm",
        observation="denied: no",
        error="denied: no",
        iter_elapsed=0,
        call_id="c1",
    )
    denied.iteration(2)
    denied.answer("Not done.")
    denied.done(answer="Not done.")
    yield "denied", denied, "Not done."

    failed = Log()
    failed.iteration(1, "c1")
    failed.done(status="failed", error="the model is down")
    yield "failed", failed, ""

    cancelled = Log()
    cancelled.iteration(1, "c1")
    cancelled.answer("Half")
    cancelled.done(status="cancelled", answer="Half", error="cancelled by the user")
    yield "cancelled", cancelled, "Half"


CASES = list(logs())


def texts(message: dict[str, Any]) -> list[str]:
    return [p["text"] for p in message["parts"] if p["type"] == "text"]


@pytest.mark.parametrize(("name", "log", "text"), CASES, ids=[c[0] for c in CASES])
def test_the_message_shows_each_call_once_and_the_answer_as_it_ended(name: str, log: Log, text: str) -> None:
    message = fold(chunks_of(log.events))

    assert texts(message) == ([text] if text else [])
    calls = [p["toolCallId"] for p in message["parts"] if p["type"] == "dynamic-tool"]
    assert len(calls) == len(set(calls)), message["parts"]
    steps = [i for i, p in enumerate(message["parts"]) if p["type"] == "step-start"]
    assert all(b - a > 1 for a, b in pairwise(steps)), "an empty step"
    assert message["metadata"]["status"] == json.loads(log.events[-1].data)["status"]


def test_a_denied_call_is_output_denied_with_its_reason_and_no_output() -> None:
    denied = next(log for name, log, _ in CASES if name == "denied")
    (part,) = [p for p in fold(chunks_of(denied.events))["parts"] if p["type"] == "dynamic-tool"]
    assert part == {
        "type": "dynamic-tool",
        "toolName": "rm",
        "toolCallId": "c1",
        "state": "output-denied",
        "input": {"p": "/"},
        "toolMetadata": {"expires_at": "2030-01-01T00:00:00Z"},
        "approval": {"id": "apr_1", "approved": False, "reason": "no"},
    }


def responses(
    events: list[StoredEvent], until: int, settled: set[str], *, closed: bool = True
) -> list[Chunk]:
    """What a client reads in two responses: the first up to event ``until`` (closed where the run
    parked, or cut), then the continuation that settled ``settled``, given every event of the run."""

    async def go() -> list[Chunk]:
        first = ResponseChunks(MessageChunks(RUN))
        out = first.opening()
        for event in events[: until + 1]:
            out += await first.event(event)
        out += first.closing() if closed else []
        second = ResponseChunks(MessageChunks(RUN), frozenset(settled))
        out += second.opening()
        for event in events:
            out += await second.event(event)
        return out + second.closing()

    return asyncio.run(go())


def test_a_continuation_after_a_park_ends_with_the_message_a_whole_replay_gives() -> None:
    """What a useChat client holds after two responses (the one that parked, then the one that
    continued the same message) equals one fold of the whole run."""
    denied = next(log for name, log, _ in CASES if name == "denied")
    waiting_at = next(i for i, e in enumerate(denied.events) if '"waiting"' in e.data)

    client = fold(responses(denied.events, waiting_at, {"apr_1", "c1"}))

    assert client == fold(chunks_of(denied.events))
    assert texts(client) == ["Not done."]


def test_a_continuation_whose_waiting_never_came_takes_over_at_the_next_attempt() -> None:
    """The worker died after asking for the approval, before it said the run waits; the decision
    came, and the next attempt went on with it: the continuation must not stay silent."""
    log = Log()
    started = log.add("step", type="thinking", status="start", iteration=1)
    asked = log.add(
        "approval",
        status="requested",
        approval_id="apr_1",
        call_id="c1",
        tool_name="rm",
        tool_args={"p": "/"},
        iteration=1,
        expires_at="2030-01-01T00:00:00Z",
    )
    log.add("phase", phase="resumed", attempt=2, after=started)
    log.add(
        "approval",
        status="requested",
        approval_id="apr_1",
        call_id="c1",
        tool_name="rm",
        tool_args={"p": "/"},
        iteration=1,
        expires_at="2030-01-01T00:00:00Z",
    )
    log.add("approval", status="approved", approval_id="apr_1", reason=None, tool_args={"p": "/"})
    log.add(
        "step",
        type="iteration",
        status="start",
        iteration=1,
        tool_name="rm",
        tool_args={"p": "/"},
        call_id="c1",
    )
    log.add(
        "step",
        type="iteration",
        status="done",
        iteration=1,
        tool_name="rm",
        observation="gone",
        error=None,
        iter_elapsed=0,
        call_id="c1",
    )
    log.answer("Removed.")
    log.done(answer="Removed.")
    cut_at = next(i for i, e in enumerate(log.events) if e.id == asked)

    client = fold(responses(log.events, cut_at, {"apr_1", "c1"}, closed=False))

    assert client == fold(chunks_of(log.events))
    (part,) = [p for p in client["parts"] if p["type"] == "dynamic-tool"]
    assert (part["state"], part["output"]) == ("output-available", "gone")
    assert texts(client) == ["Removed."] and client["metadata"]["status"] == "completed"


@pytest.mark.slow
def test_the_ai_sdk_folds_every_log_to_the_same_message_as_the_service(tmp_path: Path) -> None:
    streams = {name: chunks_of(log.events) for name, log, _ in CASES}
    file = tmp_path / "chunks.json"
    file.write_text(json.dumps(streams))

    theirs = run_node(
        "aisdk_fold.mjs", {"CHUNKS_FILE": str(file), "AGENTSTREAM_BASE": "-", "AGENTSTREAM_KEY": "-"}
    )

    for name, chunks in streams.items():
        ours = fold(chunks)
        assert theirs[name]["message"] == ours, name
        assert theirs[name]["error"] == ("the model is down" if name == "failed" else None), name
