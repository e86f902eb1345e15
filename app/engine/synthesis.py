"""Phase 2 of a run: one streaming call that turns the loop's trace into the user-facing answer.

E-01 (the trace, each result cut to ``result_chars``), E-03 (the synthesizer prompt) and E-04 (the
fallback): whatever fails, the run still ends with an answer and no token reaches the user twice.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.engine import prompts
from app.engine.context import text_tokens
from app.engine.events import AnswerDelta, AnswerDone, AnswerStarted, EventSink, Usage
from app.llm.base import LLM, ChatMessage, LLMError, StreamEnd, StreamItem, TextDelta, TokenUsage

logger = logging.getLogger(__name__)

NO_ANSWER = "I could not produce an answer."


@dataclass(frozen=True, slots=True)
class TraceStep:
    """One tool call of the loop as synthesis sees it: the observation is what the loop's LLM saw."""

    tool_name: str
    args: Mapping[str, Any]
    observation: str
    error: str | None


@dataclass(frozen=True, slots=True)
class SynthesisResult:
    answer: str
    """The concatenation of the deltas sent, or the loop's answer when synthesis failed mid-stream."""
    error: str | None
    """``"synthesis failed: ..."`` when the fallback was used; the run still completes."""


def truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n… [truncated {len(text) - limit} characters]"


def _step_entry(n: int, step: TraceStep, result_chars: int) -> str:
    args = truncate(json.dumps(dict(step.args), ensure_ascii=False, default=repr), result_chars)
    lines = [f"{n}. `{step.tool_name}` {args}"]
    if step.error is not None:
        lines.append(f"Error: {truncate(step.error, result_chars)}")
        if step.observation and step.observation != step.error:
            lines.append(f"Output: {truncate(step.observation, result_chars)}")
    else:
        lines.append(f"Result:\n{truncate(step.observation, result_chars)}")
    return "\n".join(lines)


def format_trace(steps: Sequence[TraceStep], result_chars: int, token_budget: int | None = None) -> str:
    """Every call with its arguments and result (each cut to ``result_chars``). Over
    ``token_budget`` (a long run), the newest calls keep their results and the older ones are named
    on one line each, so that the synthesis call still fits the model's context."""
    if not steps:
        return "No tools were used."
    entries = [_step_entry(n, step, result_chars) for n, step in enumerate(steps, 1)]
    if token_budget is not None:
        used = 0
        for index in range(len(entries) - 1, -1, -1):
            used += text_tokens(entries[index])
            if used > token_budget:
                older = [
                    f"{n}. `{step.tool_name}`: {'error' if step.error is not None else 'ok'}"
                    for n, step in enumerate(steps[: index + 1], 1)
                ]
                note = f"(The results of calls 1-{index + 1} are left out to fit the context.)"
                entries = [note, "\n".join(older), *entries[index + 1 :]]
                break
    return "\n\n".join(entries)


def synthesis_messages(
    question: str,
    steps: Sequence[TraceStep],
    loop_answer: str,
    *,
    result_chars: int,
    trace_tokens: int | None = None,
    follow_ups: Sequence[str] = (),
    instructions: str | None = None,
) -> list[ChatMessage]:
    parts = [f"## Question\n{question}"]
    if follow_ups:
        parts.append("## Follow-up messages from the user\n" + "\n".join(f"- {f}" for f in follow_ups))
    parts.append(f"## Tool calls and results\n{format_trace(steps, result_chars, trace_tokens)}")
    if loop_answer:
        parts.append(f"## Draft answer\n{loop_answer}")
    parts.append("Write the reply to the user now.")
    return [
        ChatMessage(role="system", content=prompts.synthesis_system_prompt(instructions)),
        ChatMessage(role="user", content="\n\n".join(parts)),
    ]


def _add_call(usage: Usage, tokens: TokenUsage | None, attempts: int) -> None:
    usage.add(
        Usage(
            prompt_tokens=tokens.prompt_tokens if tokens else 0,
            completion_tokens=tokens.completion_tokens if tokens else 0,
            total_tokens=tokens.total_tokens if tokens else 0,
            llm_calls=attempts,
        )
    )


async def synthesize(
    llm: LLM,
    *,
    question: str,
    steps: Sequence[TraceStep],
    loop_answer: str,
    sink: EventSink,
    usage: Usage,
    result_chars: int = 2000,
    trace_tokens: int | None = None,
    follow_ups: Sequence[str] = (),
    instructions: str | None = None,
) -> SynthesisResult:
    """Emit AnswerStarted, the deltas and AnswerDone; never raises except ``CancelledError``."""
    messages = synthesis_messages(
        question,
        steps,
        loop_answer,
        result_chars=result_chars,
        trace_tokens=trace_tokens,
        follow_ups=follow_ups,
        instructions=instructions,
    )
    fallback = loop_answer or NO_ANSWER
    sent: list[str] = []
    await sink(AnswerStarted())
    try:
        if llm.abilities.get("streaming", False):
            finish_reason = await _stream(llm, messages, sink, usage, sent)
        else:
            reply, finish_reason = await _chat_once(llm, messages, usage)
            if reply:
                sent.append(reply)
                await sink(AnswerDelta(reply))
        if not sent:
            raise _EmptyAnswerError("the model returned no text")
    except Exception as exc:
        reason = _reason(exc)
        logger.warning("synthesis failed deltas_sent=%d reason=%s", len(sent), reason)
        if not sent:
            # Nothing reached the user yet, so the loop's answer can stand in as the stream.
            await sink(AnswerDelta(fallback))
        await sink(AnswerDone())
        return SynthesisResult(answer=fallback, error=f"synthesis failed: {reason}")
    await sink(AnswerDone())
    # An answer the provider cut is never presented as complete: the user keeps the text, and
    # done.error says why it ends where it does.
    return SynthesisResult(answer="".join(sent), error=_CUT.get(finish_reason or ""))


_CUT = {
    "length": "the answer was cut off: the model reached its output token limit",
    "content_filter": "the answer was cut off by the provider's content filter",
    "error": "the answer was cut off: the provider reported an error",
}


class _EmptyAnswerError(Exception):
    pass


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _stream(
    llm: LLM, messages: list[ChatMessage], sink: EventSink, usage: Usage, sent: list[str]
) -> str | None:
    """Stream the answer into ``sent`` and the sink; the reason the provider gave for its end."""
    stream: AsyncIterator[StreamItem] = llm.stream_chat(messages)
    ended = False
    finish_reason: str | None = None
    try:
        async for item in stream:
            if isinstance(item, TextDelta):
                if item.text:
                    sent.append(item.text)
                    await sink(AnswerDelta(item.text))
            elif isinstance(item, StreamEnd):
                ended = True
                finish_reason = item.finish_reason
                _add_call(usage, item.usage, item.attempts)
    except LLMError as exc:
        ended = True
        _add_call(usage, None, getattr(exc, "attempts", 1))
        raise
    finally:
        if not ended:
            # The call was made even though it never reported its usage.
            _add_call(usage, None, 1)
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    return finish_reason


async def _chat_once(llm: LLM, messages: list[ChatMessage], usage: Usage) -> tuple[str, str | None]:
    try:
        reply = await llm.chat(messages)
    except LLMError as exc:
        _add_call(usage, None, getattr(exc, "attempts", 1))
        raise
    _add_call(usage, reply.usage, reply.attempts)
    return reply.content or "", reply.finish_reason
