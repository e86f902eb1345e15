"""Synthesis: the prompt, streaming, the non-streaming path and the fallback (E-01, E-03, E-04)."""

from __future__ import annotations

import pytest

from app.engine.context import text_tokens
from app.engine.events import AnswerDelta, AnswerDone, AnswerStarted, Usage
from app.engine.prompts import SYNTHESIS_SYSTEM
from app.engine.synthesis import (
    NO_ANSWER,
    SynthesisResult,
    TraceStep,
    format_trace,
    synthesis_messages,
    synthesize,
)
from app.llm.base import ChatResult, LLMUnavailableError, TokenUsage
from tests.support.scripted import ScriptedLLM, StreamScript, native_tools, text
from tests.unit.engine.agent_support import NATIVE, EventLog, MakeLLM, make_agent

STEPS = [
    TraceStep("weather", {"city": "Oslo"}, "-3°C, snow", None),
    TraceStep("search", {"q": "x"}, "Error: timeout", "timeout"),
]


def deltas(log: EventLog) -> list[str]:
    return [d.content for d in log.of(AnswerDelta)]


async def run_synthesis(
    llm: ScriptedLLM, log: EventLog, usage: Usage | None = None, loop_answer: str = "draft"
) -> SynthesisResult:
    return await synthesize(
        llm,
        question="Wie ist das Wetter in Oslo?",
        steps=STEPS,
        loop_answer=loop_answer,
        sink=log,
        usage=usage or Usage(),
    )


def test_synthesis_prompt_makes_the_model_a_synthesizer() -> None:
    system, user = synthesis_messages("Wie ist das Wetter?", STEPS, "draft", result_chars=2000)

    assert system.role == "system" and system.content == SYNTHESIS_SYSTEM
    prompt = SYNTHESIS_SYSTEM.lower()
    assert "present the results directly" in prompt
    assert "markdown" in prompt
    assert "based on the tool output" in prompt  # named as forbidden meta talk
    assert "language of the user's question" in prompt
    assert user.role == "user"
    assert (user.content or "").startswith("## Question\nWie ist das Wetter?")


def test_trace_lists_every_call_with_its_result_or_error() -> None:
    trace = format_trace(STEPS, 2000)

    assert '1. `weather` {"city": "Oslo"}\nResult:\n-3°C, snow' in trace
    assert '2. `search` {"q": "x"}\nError: timeout\nOutput: Error: timeout' in trace


def test_trace_truncates_each_result() -> None:
    trace = format_trace([TraceStep("t", {}, "a" * 50, None)], 20)

    assert "a" * 20 + "\n… [truncated 30 characters]" in trace
    assert "a" * 21 not in trace


def test_a_trace_over_its_budget_keeps_the_newest_results_and_names_every_older_call() -> None:
    steps = [TraceStep(f"tool{n}", {"n": n}, f"result {n} " + "x" * 400, None) for n in range(1, 101)]
    steps[2] = TraceStep("tool3", {"n": 3}, "boom", "boom")

    trace = format_trace(steps, 2000, token_budget=2000)

    assert text_tokens(trace) < 2400  # one call's worth over the budget at the most, plus the list
    assert "result 100 " in trace and "result 1 " not in trace
    assert "1. `tool1`: ok" in trace and "3. `tool3`: error" in trace
    kept = [n for n in range(1, 101) if f"result {n} " in trace]
    assert kept == list(range(kept[0], 101)) and len(kept) < 100
    assert f"(The results of calls 1-{kept[0] - 1} are left out to fit the context.)" in trace
    assert format_trace(steps[:3], 2000, token_budget=2000) == format_trace(steps[:3], 2000)


def test_operator_instructions_reach_the_synthesizer() -> None:
    system, _ = synthesis_messages("q", [], "", result_chars=10, instructions="Reply in haiku.")

    assert (system.content or "").endswith("Reply in haiku.")


async def test_streamed_deltas_become_answer_events_and_the_answer(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([StreamScript(["Es ", "schneit ", "bei -3°C."])], abilities=NATIVE)
    log = EventLog()
    usage = Usage()

    result = await run_synthesis(llm, log, usage)

    assert log.kinds == ["answer_start", "answer_delta", "answer_delta", "answer_delta", "answer_done"]
    assert result.answer == "Es schneit bei -3°C." == "".join(deltas(log))
    assert result.error is None
    assert usage.as_dict() == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "llm_calls": 1,
    }


async def test_model_without_streaming_answers_through_chat_in_one_delta(scripted_llm: MakeLLM) -> None:
    reply = ChatResult(content="Schnee.", usage=TokenUsage(7, 3, 10), attempts=2)
    llm = scripted_llm([reply], abilities={"tool_call": True, "streaming": False})
    log = EventLog()
    usage = Usage()

    result = await run_synthesis(llm, log, usage)

    assert llm.calls[0].kind == "chat"
    assert deltas(log) == ["Schnee."]
    assert result.answer == "Schnee."
    assert usage.llm_calls == 2 and usage.total_tokens == 10


async def test_synthesis_failure_before_any_delta_streams_the_loop_answer(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([LLMUnavailableError("connection refused", attempts=4)], abilities=NATIVE)
    log = EventLog()
    usage = Usage()

    result = await run_synthesis(llm, log, usage, loop_answer="-3°C and snow")

    assert deltas(log) == ["-3°C and snow"]
    assert log.kinds == ["answer_start", "answer_delta", "answer_done"]
    assert result.answer == "-3°C and snow"
    assert result.error == "synthesis failed: LLMUnavailableError: connection refused"
    assert usage.llm_calls == 4


async def test_synthesis_failure_mid_stream_does_not_resend_tokens(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([StreamScript(["Es ", "schn"], error=TimeoutError("read timeout"))], abilities=NATIVE)
    log = EventLog()
    usage = Usage()

    result = await run_synthesis(llm, log, usage, loop_answer="-3°C and snow")

    assert deltas(log) == ["Es ", "schn"]
    assert isinstance(log.events[-1], AnswerDone)
    assert result.answer == "-3°C and snow"
    assert (result.error or "").startswith("synthesis failed: TimeoutError")
    assert usage.llm_calls == 1


async def test_empty_synthesis_falls_back_to_the_loop_answer(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([StreamScript([])], abilities=NATIVE)
    log = EventLog()

    result = await run_synthesis(llm, log, loop_answer="draft answer")

    assert deltas(log) == ["draft answer"]
    assert (result.error or "").startswith("synthesis failed")


async def test_fallback_without_a_loop_answer_still_says_something(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([RuntimeError("boom")], abilities=NATIVE)
    log = EventLog()

    result = await run_synthesis(llm, log, loop_answer="")

    assert deltas(log) == [NO_ANSWER]
    assert result.answer == NO_ANSWER


async def test_run_with_mid_stream_synthesis_failure_completes_with_the_loop_answer(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm(
        [
            native_tools(("echo", {})),
            text("short loop answer"),
            StreamScript(["Hal"], error=ConnectionError("reset")),
        ],
        abilities=NATIVE,
    )
    log = EventLog()

    result = await make_agent(llm).run("q", sink=log)

    done = log.done
    assert (done.status, done.answer) == ("completed", "short loop answer")
    assert done.error is not None and done.error.startswith("synthesis failed: ConnectionError")
    assert deltas(log) == ["Hal"]
    assert result.answer == "short loop answer" and result.status == "completed"
    assert log.of(AnswerStarted) and log.kinds[-2:] == ["answer_done", "done"]


@pytest.mark.parametrize(
    ("finish_reason", "says"),
    [
        ("length", "output token limit"),
        ("content_filter", "content filter"),
        ("error", "provider reported an error"),
    ],
)
async def test_a_streamed_answer_the_provider_cut_keeps_its_text_and_says_it_was_cut(
    scripted_llm: MakeLLM, finish_reason: str, says: str
) -> None:
    llm = scripted_llm([StreamScript(["The answer ", "is cut"], finish_reason=finish_reason)])
    log = EventLog()
    result = await run_synthesis(llm, log)
    assert result.answer == "The answer is cut" == "".join(deltas(log))
    assert result.error is not None and says in result.error and "cut off" in result.error


async def test_a_non_streamed_answer_cut_at_the_output_limit_says_so(scripted_llm: MakeLLM) -> None:
    cut = ChatResult(content="Half an answ", usage=TokenUsage(10, 5, 15), finish_reason="length")
    llm = scripted_llm([cut], abilities={"tool_call": True, "json_mode": True, "streaming": False})
    log = EventLog()
    result = await run_synthesis(llm, log)
    assert result.answer == "Half an answ"
    assert result.error is not None and "output token limit" in result.error


async def test_an_answer_that_ended_normally_has_no_error(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([StreamScript(["Done."], finish_reason="stop")])
    result = await run_synthesis(llm, EventLog())
    assert (result.answer, result.error) == ("Done.", None)
