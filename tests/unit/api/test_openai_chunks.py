"""The OpenAI-compatible stream of a run carried on by a new attempt (RUNS.md R-04): the answer text
a client already has is never contradicted by the restreamed one."""

from __future__ import annotations

from typing import Any

import orjson

from app.api.routes.openai_compat import ChunkEncoder, Completion
from app.streaming.bus import StoredEvent


def event(n: int, name: str, **data: Any) -> StoredEvent:
    return StoredEvent(f"{n}-0", name, orjson.dumps({**data, "run_id": "run_1"}).decode(), "run_1")


def content_of(chunks: list[bytes]) -> tuple[str, dict[str, Any]]:
    text, last = "", {}
    for chunk in chunks:
        line = chunk.decode().removeprefix("data: ").strip()
        if line == "[DONE]":
            continue
        obj = orjson.loads(line)
        for choice in obj["choices"]:
            text += choice["delta"].get("content") or ""
        last = obj.get("agentstream") or last
    return text, last


def run(answer_after_resume: str) -> tuple[str, dict[str, Any]]:
    encoder = ChunkEncoder(Completion("run_1", "conv_1", "agentstream"), include_usage=False)
    events = [
        event(1, "answer", status="delta", content="The answ"),
        event(2, "phase", phase="resumed", attempt=2, after="0-0"),
        event(3, "answer", status="start"),
        event(4, "answer", status="delta", content=answer_after_resume),
        event(5, "done", answer=answer_after_resume, status="completed", usage={}, iterations=1),
    ]
    return content_of([chunk for e in events for chunk in encoder.encode(e)])


def test_a_restreamed_answer_that_goes_on_from_the_sent_text_is_sent_as_its_remainder() -> None:
    text, outcome = run("The answer is 42.")
    assert text == "The answer is 42."
    assert "answer_replaced" not in outcome


def test_a_restreamed_answer_that_differs_from_the_sent_text_replaces_it_in_the_last_chunk() -> None:
    text, outcome = run("Forty-two.")
    assert text == "The answ"  # nothing of the new attempt was appended to the old text
    assert (outcome["answer"], outcome["answer_replaced"]) == ("Forty-two.", True)
