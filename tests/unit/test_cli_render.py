"""Rendering recorded event sequences the way ``agentstream chat`` prints them."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

from app.cli.render import HumanRenderer, JsonRenderer
from app.cli.sse import ServerEvent

USAGE = {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150, "llm_calls": 3}


def ev(event: str, **data: Any) -> ServerEvent:
    return ServerEvent(event=event, data={"run_id": "r1", **data})


def done(answer: str, **overrides: Any) -> ServerEvent:
    fields: dict[str, Any] = {
        "answer": answer,
        "iterations": 1,
        "usage": USAGE,
        "elapsed": 1.5,
        "status": "completed",
        "error": None,
        "pending_injections": [],
    }
    return ev("done", **{**fields, **overrides})


CALCULATOR_RUN = [
    ev("phase", phase="selecting_tools", total_tools=14),
    ev("step", type="thinking", status="start", iteration=1),
    ev("step", type="thinking", status="done", iteration=1, reasoning="Multiply them."),
    ev(
        "step",
        type="iteration",
        status="start",
        iteration=1,
        tool_name="calculator",
        tool_args={"expression": "17*23"},
    ),
    ev(
        "step",
        type="iteration",
        status="done",
        iteration=1,
        tool_name="calculator",
        observation="391",
        error=None,
        iter_elapsed=0.0123,
    ),
    ev("step", type="answer", status="start"),
    ev("answer", status="start"),
    ev("answer", status="delta", content="17*23 "),
    ev("answer", status="delta", content="= 391."),
    ev("answer", status="done"),
    done("17*23 = 391."),
]


def render(events: list[ServerEvent], *, verbose: bool = False) -> str:
    out = io.StringIO()
    renderer = HumanRenderer(out, verbose=verbose)
    for event in events:
        renderer.handle(event)
    return out.getvalue()


def test_calculator_run_prints_tool_step_streamed_answer_and_footer() -> None:
    assert render(CALCULATOR_RUN) == (
        "· phase: selecting_tools (14 tools)\n"
        '→ calculator {"expression": "17*23"}\n'
        "  ← 391 (0.01s)\n"
        "17*23 = 391.\n"
        "── completed · 1 iteration · 150 tokens (120 in, 30 out) · 3 LLM calls · 1.50s\n"
    )


def test_a_fallback_says_which_model_gave_way_to_which() -> None:
    out = render([ev("phase", phase="fallback", from_model="cheap", to_model="strong")])

    assert out == "· model cheap unavailable: falling back to strong\n"


def test_answer_tokens_are_written_as_they_arrive_without_waiting_for_done() -> None:
    out = io.StringIO()
    renderer = HumanRenderer(out)
    for event in CALCULATOR_RUN[:8]:
        renderer.handle(event)
    assert out.getvalue().endswith("  ← 391 (0.01s)\n17*23 ")


def test_verbose_shows_the_reasoning_and_full_observation() -> None:
    long_observation = "line one\nline two " + "x" * 300
    events = [
        ev("step", type="thinking", status="done", iteration=1, reasoning="Look it up."),
        ev(
            "step",
            type="iteration",
            status="done",
            iteration=1,
            tool_name="t",
            observation=long_observation,
            error=None,
            iter_elapsed=1,
        ),
    ]
    assert render(events, verbose=True) == f"  … Look it up.\n  ← {long_observation} (1.00s)\n"


def test_long_observation_is_flattened_and_truncated() -> None:
    event = ev(
        "step",
        type="iteration",
        status="done",
        iteration=1,
        tool_name="t",
        observation="a\nb " + "y" * 400,
        error=None,
        iter_elapsed=0.5,
    )
    line = render([event]).rstrip("\n")
    assert line.startswith("  ← a b yyy")
    assert line.endswith("… (0.50s)")
    assert len(line) < 220


def test_failed_tool_step_prints_the_error() -> None:
    event = ev(
        "step",
        type="iteration",
        status="done",
        iteration=2,
        tool_name="calculator",
        observation="",
        error="division by zero",
        iter_elapsed=0.001,
    )
    assert render([event]) == "  ✗ division by zero (0.00s)\n"


def test_artifact_of_a_tool_step_is_named() -> None:
    event = ev(
        "step",
        type="iteration",
        status="done",
        iteration=1,
        tool_name="plot",
        observation="ok",
        error=None,
        iter_elapsed=0.2,
        artifact={"filename": "chart.svg", "mime_type": "image/svg+xml", "content": "<svg/>"},
    )
    assert render([event]) == "  ← ok (0.20s)\n  ⎘ chart.svg (image/svg+xml)\n"


def test_compact_and_inject_lines() -> None:
    events = [
        ev("compact", original_messages=40, kept_messages=12),
        ev("inject", type="inject", content="hurry"),
    ]
    assert render(events) == "· context compacted: 40 → 12 messages\n· injected: hurry\n"


def test_synthesis_failure_replaces_the_partial_text_with_done_answer() -> None:
    events = [
        ev("answer", status="start"),
        ev("answer", status="delta", content="The resu"),
        done("Fallback: 391", error="synthesis failed: stream broke"),
    ]
    assert render(events) == (
        "The resu\n"
        "(the streamed answer was incomplete; the final answer is:)\n"
        "Fallback: 391\n"
        "── completed · 1 iteration · 150 tokens (120 in, 30 out) · 3 LLM calls · 1.50s\n"
        "   error: synthesis failed: stream broke\n"
    )


def test_done_answer_without_any_streamed_text_is_printed_plainly() -> None:
    output = render([done("Only in done.", status="failed", error="LLM unavailable", iterations=0)])
    assert output.startswith("Only in done.\n── failed · 0 iterations · ")
    assert output.endswith("   error: LLM unavailable\n")


def test_pending_injections_are_listed_after_the_footer() -> None:
    output = render([done("", status="cancelled", pending_injections=["too late"])])
    assert output.splitlines()[-1] == "   not delivered: too late"
    assert output.startswith("── cancelled")


def test_unknown_event_kind_is_shown_rather_than_dropped() -> None:
    assert render([ServerEvent(event="mystery", data={"x": 1})]) == '· mystery: {"x": 1}\n'


def test_note_during_a_half_streamed_answer_starts_on_a_new_line() -> None:
    out = io.StringIO()
    renderer = HumanRenderer(out)
    renderer.handle(ev("answer", status="delta", content="partial"))
    renderer.info("· reconnecting")
    assert out.getvalue() == "partial\n· reconnecting\n"


def test_run_summary_prints_the_stored_answer_and_footer() -> None:
    out = io.StringIO()
    HumanRenderer(out).run_summary(
        {"answer": "42", "iterations": 2, "usage": USAGE, "elapsed": 3, "status": "completed", "error": None}
    )
    assert (
        out.getvalue()
        == "42\n── completed · 2 iterations · 150 tokens (120 in, 30 out) · 3 LLM calls · 3.00s\n"
    )


def test_json_renderer_prints_one_json_line_per_event_and_notes_on_stderr() -> None:
    out, err = io.StringIO(), io.StringIO()
    renderer = JsonRenderer(out, err)
    for event in CALCULATOR_RUN:
        renderer.handle(event)
    renderer.info("conversation: c1")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["event"], line["data"]) for line in lines] == [(e.event, e.data) for e in CALCULATOR_RUN]
    assert err.getvalue() == "conversation: c1\n"


# ---- a run carried on by another worker (RUNS.md) ----------------------------------


def at(cursor: str, event: ServerEvent) -> ServerEvent:
    return dataclasses.replace(event, id=cursor)


def tool_call(start: str, done_at: str, iteration: int, tool: str, observation: str) -> list[ServerEvent]:
    return [
        at(
            start,
            ev("step", type="iteration", status="start", iteration=iteration, tool_name=tool, tool_args={}),
        ),
        at(
            done_at,
            ev(
                "step",
                type="iteration",
                status="done",
                iteration=iteration,
                tool_name=tool,
                observation=observation,
                error=None,
                iter_elapsed=0.5,
            ),
        ),
    ]


def resumed(cursor: str, attempt: int, after: str) -> ServerEvent:
    return at(cursor, ev("phase", phase="resumed", attempt=attempt, after=after))


FOOTER = "── completed · 1 iteration · 150 tokens (120 in, 30 out) · 3 LLM calls · 1.50s\n"

RESUMED_MID_ANSWER = [
    *tool_call("1000-1", "1000-2", 1, "calculator", "391"),
    # The checkpoint covers the calculator; the lookup and the answer after it are lost.
    *tool_call("1000-3", "1000-4", 2, "lookup", "miles"),
    at("1000-5", ev("answer", status="start")),
    at("1000-6", ev("answer", status="delta", content="Stale par")),
    resumed("2000-0", 2, "1000-2"),
    *tool_call("2000-1", "2000-2", 2, "lookup", "miles"),
    at("2000-3", ev("answer", status="start")),
    at("2000-4", ev("answer", status="delta", content="17*23 ")),
    at("2000-5", ev("answer", status="delta", content="= 391.")),
    at("2000-6", ev("answer", status="done")),
    at("2000-7", done("17*23 = 391.")),
]


def test_resume_mid_answer_ends_the_partial_line_and_streams_the_answer_afresh() -> None:
    assert render(RESUMED_MID_ANSWER) == (
        "→ calculator {}\n"
        "  ← 391 (0.50s)\n"
        "→ lookup {}\n"
        "  ← miles (0.50s)\n"
        "Stale par\n"
        "· resumed on another worker (attempt 2): 1 tool call shown above is redone"
        " and the answer starts again\n"
        "→ lookup {}\n"
        "  ← miles (0.50s)\n"
        "17*23 = 391.\n" + FOOTER
    )


def test_final_answer_of_a_resumed_run_is_the_text_after_the_last_resume() -> None:
    renderer = HumanRenderer(io.StringIO())
    for event in RESUMED_MID_ANSWER:
        renderer.handle(event)
    assert renderer.final_answer == "17*23 = 391."


def test_resume_counts_redone_tool_calls_by_cursor_numbers_not_strings() -> None:
    # As strings "1000-10" < "1000-9"; as cursors (1000, 10) > (1000, 9): the second call is redone.
    events = [
        *tool_call("999-20", "1000-1", 1, "calculator", "391"),
        *tool_call("1000-2", "1000-9", 1, "lookup", "a"),
        *tool_call("1000-10", "1000-11", 2, "lookup", "b"),
        *tool_call("1000-12", "1000-13", 3, "lookup", "c"),
        resumed("1001-0", 2, "1000-9"),
    ]
    assert render(events).splitlines()[-1] == (
        "· resumed on another worker (attempt 2): 2 tool calls shown above are redone"
    )


def test_tool_call_finished_after_the_checkpoint_is_counted_as_redone() -> None:
    events = [
        *tool_call("1000-1", "1000-5", 1, "calculator", "391"),
        resumed("1001-0", 2, "1000-3"),
    ]
    assert render(events).splitlines()[-1] == (
        "· resumed on another worker (attempt 2): 1 tool call shown above is redone"
    )


def test_resume_with_nothing_shown_after_the_checkpoint_says_the_run_carries_on() -> None:
    events = [*tool_call("1000-1", "1000-2", 1, "calculator", "391"), resumed("1001-0", 2, "1000-2")]
    assert render(events).splitlines()[-1] == (
        "· resumed on another worker (attempt 2): it carries on from its last checkpoint"
    )


def test_resume_of_events_without_ids_says_steps_after_the_checkpoint_are_redone() -> None:
    events = [
        *CALCULATOR_RUN[3:5],
        ev("answer", status="delta", content="Half"),
        ev("phase", phase="resumed", attempt=2, after="1000-2"),
    ]
    assert render(events).splitlines()[-2:] == [
        "Half",
        "· resumed on another worker (attempt 2): any steps shown after its last checkpoint are redone"
        " and the answer starts again",
    ]


def test_run_resumed_twice_keeps_only_the_answer_after_the_last_resume() -> None:
    events = [
        at("1000-1", ev("answer", status="delta", content="first")),
        resumed("2000-0", 2, "1000-0"),
        at("2000-1", ev("answer", status="delta", content="second")),
        resumed("3000-0", 3, "1000-0"),
        at("3000-1", ev("answer", status="start")),
        at("3000-2", ev("answer", status="delta", content="third")),
        at("3000-3", done("third")),
    ]
    out = io.StringIO()
    renderer = HumanRenderer(out)
    for event in events:
        renderer.handle(event)
    assert out.getvalue() == (
        "first\n"
        "· resumed on another worker (attempt 2): the answer starts again\n"
        "second\n"
        "· resumed on another worker (attempt 3): the answer starts again\n"
        "third\n" + FOOTER
    )
    assert renderer.final_answer == "third"


def test_done_answer_replaces_what_the_resumed_attempt_streamed_when_they_differ() -> None:
    events = [
        at("1000-1", ev("answer", status="delta", content="Old text")),
        resumed("2000-0", 2, "1000-0"),
        at("2000-1", ev("answer", status="delta", content="The resu")),
        at("2000-2", done("Fallback: 391", error="synthesis failed")),
    ]
    output = render(events)
    assert output.startswith(
        "Old text\n"
        "· resumed on another worker (attempt 2): the answer starts again\n"
        "The resu\n"
        "(the streamed answer was incomplete; the final answer is:)\n"
        "Fallback: 391\n"
    )


def test_done_answer_is_printed_when_the_resumed_attempt_streamed_none_of_it() -> None:
    # The text printed before the resume is dropped, even when it reads the same.
    events = [
        at("1000-1", ev("answer", status="delta", content="391")),
        resumed("2000-0", 2, "1000-0"),
        at("2000-1", done("391")),
    ]
    out = io.StringIO()
    renderer = HumanRenderer(out)
    for event in events:
        renderer.handle(event)
    assert out.getvalue() == (
        "391\n· resumed on another worker (attempt 2): the answer starts again\n391\n" + FOOTER
    )
    assert renderer.final_answer == "391"


def test_run_summary_after_a_resume_prints_the_stored_answer() -> None:
    out = io.StringIO()
    renderer = HumanRenderer(out)
    renderer.handle(at("1000-1", ev("answer", status="delta", content="42")))
    renderer.handle(resumed("2000-0", 2, "1000-0"))
    renderer.run_summary(
        {"answer": "42", "iterations": 2, "usage": USAGE, "elapsed": 3, "status": "completed", "error": None}
    )
    assert out.getvalue().splitlines()[:3] == [
        "42",
        "· resumed on another worker (attempt 2): the answer starts again",
        "42",
    ]
    assert renderer.final_answer == "42"


def test_json_renderer_passes_the_resumed_phase_through_with_its_cursor() -> None:
    # Scripts get the events as they are: the resume, its cursor and done.answer are all there.
    out, err = io.StringIO(), io.StringIO()
    renderer = JsonRenderer(out, err)
    for event in RESUMED_MID_ANSWER:
        renderer.handle(event)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[6] == {
        "id": "2000-0",
        "event": "phase",
        "data": {"run_id": "r1", "phase": "resumed", "attempt": 2, "after": "1000-2"},
    }
    assert [(line["id"], line["event"], line["data"]) for line in lines] == [
        (e.id, e.event, e.data) for e in RESUMED_MID_ANSWER
    ]
    assert err.getvalue() == ""


def test_a_queued_run_says_its_place() -> None:
    out = render([ev("phase", phase="queued", position=3)])

    assert out == "· queued (position 3): starts when a worker has room\n"
