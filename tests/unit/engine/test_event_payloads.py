"""Every engine event's SSE name and payload, exactly as API.md's table (ENGINE.md E-28) gives them.

Clients are built against those names: a renamed, missing or extra key is a broken client.
"""

from __future__ import annotations

from typing import Any

import pytest

from app.engine.events import (
    AnswerDelta,
    AnswerDone,
    AnswerSignalled,
    AnswerStarted,
    Compacted,
    EngineEvent,
    Injected,
    IterationDone,
    IterationStarted,
    PhaseChanged,
    RunDone,
    ThinkingDone,
    ThinkingStarted,
)

USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "llm_calls": 2}

CASES: list[tuple[EngineEvent, str, dict[str, Any]]] = [
    (ThinkingStarted(1), "step", {"type": "thinking", "status": "start", "iteration": 1}),
    (
        ThinkingDone(1, "look it up"),
        "step",
        {"type": "thinking", "status": "done", "iteration": 1, "reasoning": "look it up"},
    ),
    (
        IterationStarted(2, "calculator", {"expression": "2+2"}),
        "step",
        {
            "type": "iteration",
            "status": "start",
            "iteration": 2,
            "tool_name": "calculator",
            "tool_args": {"expression": "2+2"},
        },
    ),
    (
        IterationDone(2, "calculator", "4", None, 0.123456),
        "step",
        {
            "type": "iteration",
            "status": "done",
            "iteration": 2,
            "tool_name": "calculator",
            "observation": "4",
            "error": None,
            "iter_elapsed": 0.1235,
        },
    ),
    (AnswerSignalled(), "step", {"type": "answer", "status": "start"}),
    (AnswerStarted(), "answer", {"status": "start"}),
    (AnswerDelta("Hel"), "answer", {"status": "delta", "content": "Hel"}),
    (AnswerDone(), "answer", {"status": "done"}),
    (Compacted(40, 12), "compact", {"original_messages": 40, "kept_messages": 12}),
    (PhaseChanged("selecting_tools", 30), "phase", {"phase": "selecting_tools", "total_tools": 30}),
    (Injected("[USER INTERRUPT] also"), "inject", {"type": "inject", "content": "[USER INTERRUPT] also"}),
    (
        RunDone("4", 2, USAGE, 1.23456, "completed", None, ("late",)),
        "done",
        {
            "answer": "4",
            "iterations": 2,
            "usage": USAGE,
            "elapsed": 1.2346,
            "status": "completed",
            "error": None,
            "pending_injections": ["late"],
        },
    ),
]


@pytest.mark.parametrize(("event", "name", "payload"), CASES, ids=[type(c[0]).__name__ for c in CASES])
def test_event_name_and_payload_are_api_mds(event: EngineEvent, name: str, payload: dict[str, Any]) -> None:
    assert event.channel == name
    assert event.data() == payload


def test_an_iteration_with_a_file_carries_its_artifact_besides_the_table_keys() -> None:
    artifact = {"filename": "plot.svg", "mime_type": "image/svg+xml", "content": "<svg/>"}
    data = IterationDone(1, "plot", "drawn", None, 0.5, artifact=artifact).data()
    assert data["artifact"] == artifact
    assert set(data) - {"artifact"} == set(CASES[3][2])
