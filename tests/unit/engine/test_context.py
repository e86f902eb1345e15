"""The context guard: cheap estimates, cached totals, and compaction that keeps conversations valid (E-16)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from app.engine import context
from app.engine.context import MARKER_PREFIX, SUMMARY_PREFIX, ContextGuard, estimate_tokens
from app.engine.events import Compacted, Usage
from app.llm.base import ChatMessage, ChatResult, LLMUnavailableError, TokenUsage, ToolCall
from tests.support.scripted import ScriptedLLM, text

MakeLLM = Callable[..., ScriptedLLM]


def system(content: str = "You are a helpful agent.") -> ChatMessage:
    return ChatMessage(role="system", content=content)


def user(content: str, *, pinned: bool = False) -> ChatMessage:
    return ChatMessage(role="user", content=content, pinned=pinned)


def assistant(content: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=content)


def tool_round(tag: str, *names: str, result_chars: int = 40) -> list[ChatMessage]:
    """An assistant message calling ``names`` in parallel, then one tool message each."""
    calls = tuple(
        ToolCall(id=f"{tag}_{i}", name=n, arguments=json.dumps({"q": tag})) for i, n in enumerate(names)
    )
    out = [ChatMessage(role="assistant", content=None, tool_calls=calls)]
    out += [
        ChatMessage(role="tool", content=f"{c.name}:{'r' * result_chars}", tool_call_id=c.id) for c in calls
    ]
    return out


def assert_valid_conversation(messages: Sequence[ChatMessage]) -> None:
    """OpenAI's rules: each tool message answers a call of the assistant message right before its run,
    and every call of an assistant message is answered before anything else follows."""
    pending: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "system":
            assert i == 0, "a system message only at the start"
        if m.role == "tool":
            assert m.tool_call_id in pending, f"orphan tool message at {i}"
            pending.discard(m.tool_call_id or "")
            continue
        assert not pending, f"tool results {pending} missing before message {i}"
        if m.role == "assistant" and m.tool_calls:
            pending = {c.id for c in m.tool_calls}
    assert not pending, f"tool results {pending} missing at the end"


def total(messages: Sequence[ChatMessage]) -> int:
    return sum(estimate_tokens(m) for m in messages)


# --- estimates ----------------------------------------------------------------------------------


def test_estimate_grows_with_content_and_has_a_per_message_overhead() -> None:
    empty = estimate_tokens(user(""))
    assert empty > 0
    assert estimate_tokens(user("x" * 400)) == empty + 100


def test_estimate_counts_tool_calls() -> None:
    bare = ChatMessage(role="assistant", content=None)
    with_call = tool_round("a", "web_search")[0]
    assert estimate_tokens(with_call) > estimate_tokens(bare) + len('{"q": "a"}') // 4


def test_estimate_counts_cjk_text_as_denser_than_ascii() -> None:
    assert estimate_tokens(user("今天天气怎么样" * 10)) > estimate_tokens(user("abcdefg" * 10)) * 3


# --- the under-budget check ---------------------------------------------------------------------


async def test_under_budget_returns_the_same_list_and_calls_no_llm(scripted_llm: MakeLLM) -> None:
    guard = ContextGuard(scripted_llm([]), budget_tokens=10_000)
    messages = [system(), user("hi"), *tool_round("a", "search")]

    out, event = await guard.check_and_compact(messages, Usage())

    assert out is messages
    assert event is None


async def test_unchanged_and_appended_lists_are_not_re_estimated_message_by_message(
    scripted_llm: MakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    estimated: list[ChatMessage] = []
    real = context.estimate_tokens

    def counting(message: ChatMessage) -> int:
        estimated.append(message)
        return real(message)

    monkeypatch.setattr(context, "estimate_tokens", counting)
    guard = ContextGuard(scripted_llm([]), budget_tokens=1_000_000)
    messages = [system(), user("question"), *tool_round("a", "search", "fetch")]

    await guard.check_and_compact(messages, Usage())
    assert len(estimated) == len(messages)

    estimated.clear()
    await guard.check_and_compact(messages, Usage())
    assert estimated == []

    new = assistant("thinking")
    messages.append(new)
    await guard.check_and_compact(messages, Usage())
    assert estimated == [new]

    estimated.clear()
    rebuilt = [system("a rebuilt system prompt"), *messages[1:]]
    await guard.check_and_compact(rebuilt, Usage())
    assert estimated == [rebuilt[0]]


async def test_running_total_matches_a_full_recount_as_the_list_grows(scripted_llm: MakeLLM) -> None:
    guard = ContextGuard(scripted_llm([]), budget_tokens=1_000_000)
    messages = [system(), user("q")]
    for i in range(30):
        messages += tool_round(f"r{i}", "search", result_chars=i * 7)
        assert guard.total_tokens(messages) == total(messages)
    assert guard.total_tokens(messages[:5]) == total(messages[:5])


async def test_check_cost_does_not_grow_with_history_length(
    scripted_llm: MakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Counts cache look-ups too, not only fresh estimates: an appended-to list must cost only its
    # new messages, however long the history.
    calls = 0
    real = ContextGuard._estimate

    def counting(self: ContextGuard, message: ChatMessage) -> int:
        nonlocal calls
        calls += 1
        return real(self, message)

    monkeypatch.setattr(ContextGuard, "_estimate", counting)
    guard = ContextGuard(scripted_llm([]), budget_tokens=10_000_000)
    messages = [system(), user("q")]
    per_iteration: list[int] = []
    for i in range(50):
        messages += tool_round(f"r{i}", "search")
        before = calls
        await guard.check_and_compact(messages, Usage())
        per_iteration.append(calls - before)

    assert per_iteration[1:] == [2] * 49


# --- compaction ---------------------------------------------------------------------------------


def long_run(rounds: int = 10, result_chars: int = 400) -> list[ChatMessage]:
    messages = [system(), user("Find the cheapest flight to Lisbon", pinned=True)]
    for i in range(rounds):
        messages.append(assistant(f"step {i}: I should search more"))
        messages += tool_round(f"r{i}", "flight_search", result_chars=result_chars)
    return messages


async def test_compaction_keeps_system_pinned_and_recent_and_summarises_the_middle(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm([text("The agent searched flights; cheapest so far is 80 EUR.")])
    messages = long_run()
    guard = ContextGuard(llm, budget_tokens=total(messages) // 2, keep_recent=6)

    out, event = await guard.check_and_compact(messages, Usage())

    assert out[0] is messages[0]
    assert out[1] is messages[1]
    assert out[2].role == "user"
    assert (out[2].content or "").startswith(SUMMARY_PREFIX)
    assert "cheapest so far is 80 EUR" in (out[2].content or "")
    assert out[3:] == messages[-6:]
    assert all(a is b for a, b in zip(out[3:], messages[-6:], strict=True))
    assert event == Compacted(original_messages=len(messages), kept_messages=len(out))
    assert total(out) <= guard.budget_tokens
    assert_valid_conversation(out)


async def test_summary_prompt_asks_to_keep_the_recent_reasoning_chain_and_sees_the_dropped_messages(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm([text("summary")])
    messages = long_run()
    guard = ContextGuard(llm, budget_tokens=total(messages) // 2, keep_recent=6)

    await guard.check_and_compact(messages, Usage())

    prompt = "\n".join(m.content or "" for m in llm.calls[0].messages)
    assert "recent reasoning chain" in prompt
    assert "user's goal" in prompt
    assert "tool results that are still needed" in prompt
    assert "Find the cheapest flight to Lisbon" in prompt
    assert "step 7: I should search more" in prompt
    assert "[tool result: flight_search]" in prompt
    assert "step 8: I should search more" not in prompt  # kept verbatim, not summarised
    assert llm.calls[0].kwargs.get("tools") is None


async def test_summary_request_for_a_huge_middle_keeps_the_newest_dropped_messages(
    scripted_llm: MakeLLM,
) -> None:
    llm = scripted_llm([text("summary")])
    messages = long_run(rounds=60, result_chars=1500)
    guard = ContextGuard(llm, budget_tokens=3000, keep_recent=2)

    await guard.check_and_compact(messages, Usage())

    request = llm.calls[0].messages[-1].content or ""
    assert len(request) < 3000 * 2 + 4000
    assert "older messages omitted" in request
    assert "step 58: I should search more" in request
    assert "step 0: I should search more" not in request
    assert "Find the cheapest flight to Lisbon" in request


async def test_summary_call_usage_is_added_to_the_run_usage(scripted_llm: MakeLLM) -> None:
    reply = text("summary", usage=TokenUsage(300, 40, 340))
    reply.attempts = 2
    messages = long_run()
    guard = ContextGuard(scripted_llm([reply]), budget_tokens=total(messages) // 2)
    usage = Usage(llm_calls=5)

    await guard.check_and_compact(messages, usage)

    assert usage == Usage(prompt_tokens=300, completion_tokens=40, total_tokens=340, llm_calls=7)


@pytest.mark.parametrize(
    "failure", [LLMUnavailableError("down", attempts=3), RuntimeError("bug"), text("   ")]
)
async def test_failed_summary_becomes_a_marker_naming_the_dropped_count_and_tools(
    scripted_llm: MakeLLM, failure: Exception | ChatResult
) -> None:
    messages = [system(), user("goal", pinned=True)]
    messages += tool_round("a", "weather")
    messages += tool_round("b", "geocode", "weather")
    messages += [assistant("now the recent part"), *tool_round("c", "calendar"), assistant("x" * 40)]
    guard = ContextGuard(scripted_llm([failure]), budget_tokens=total(messages) - 20, keep_recent=3)
    usage = Usage()

    out, event = await guard.check_and_compact(messages, usage)

    marker = out[2]
    assert marker.role == "user"
    assert (marker.content or "").startswith(MARKER_PREFIX)
    assert "6 earlier messages" in (marker.content or "")
    assert "weather, geocode" in (marker.content or "")
    assert "calendar" not in (marker.content or "")
    assert event is not None and event.kept_messages == len(out)
    assert usage.llm_calls == (3 if isinstance(failure, LLMUnavailableError) else 1)
    assert_valid_conversation(out)


async def test_boundary_inside_tool_results_moves_back_to_keep_the_assistant_message(
    scripted_llm: MakeLLM,
) -> None:
    messages = [system(), user("goal"), assistant("plan")]
    messages += tool_round("old", "a")
    parallel = tool_round("big", "a", "b", "c", "d")
    messages += parallel
    guard = ContextGuard(scripted_llm([text("summary")]), budget_tokens=total(messages) - 10, keep_recent=2)

    out, _ = await guard.check_and_compact(messages, Usage())

    assert out[-5:] == parallel
    assert all(a is b for a, b in zip(out[-5:], parallel, strict=True))
    assert_valid_conversation(out)


async def test_pinned_messages_in_the_middle_survive_in_order(scripted_llm: MakeLLM) -> None:
    messages = [system(), user("goal", pinned=True)]
    messages += tool_round("a", "search", result_chars=400)
    first_interrupt = user("[USER INTERRUPT] also check trains", pinned=True)
    messages.append(first_interrupt)
    messages += tool_round("b", "search", result_chars=400)
    second_interrupt = user("[USER INTERRUPT] and buses", pinned=True)
    messages.append(second_interrupt)
    messages += tool_round("c", "search", result_chars=400)
    messages += tool_round("d", "search", result_chars=400)
    guard = ContextGuard(scripted_llm([text("summary")]), budget_tokens=total(messages) // 2, keep_recent=2)

    out, event = await guard.check_and_compact(messages, Usage())

    assert event is not None
    pinned = [m for m in out if m.pinned]
    assert pinned == [messages[1], first_interrupt, second_interrupt]
    assert out.index(first_interrupt) < out.index(second_interrupt)
    assert out[-2:] == messages[-2:]
    assert_valid_conversation(out)


async def test_a_pinned_tool_result_keeps_its_whole_tool_call_round(scripted_llm: MakeLLM) -> None:
    messages = [system(), user("goal")]
    messages += tool_round("a", "search", result_chars=400)
    pinned_round = tool_round("b", "lookup", "search", result_chars=400)
    pinned_round[1] = ChatMessage(role="tool", content="key fact", tool_call_id="b_0", pinned=True)
    messages += pinned_round
    messages += tool_round("c", "search", result_chars=400)
    messages += tool_round("d", "search", result_chars=400)
    guard = ContextGuard(scripted_llm([text("summary")]), budget_tokens=total(messages) // 2, keep_recent=2)

    out, _ = await guard.check_and_compact(messages, Usage())

    start = out.index(pinned_round[0])
    assert out[start : start + 3] == pinned_round
    assert_valid_conversation(out)


async def test_when_recent_messages_alone_exceed_the_budget_the_best_valid_list_is_kept(
    scripted_llm: MakeLLM,
) -> None:
    messages = [system(), user("goal", pinned=True)]
    messages += tool_round("a", "search", result_chars=4000)
    messages += tool_round("b", "search", result_chars=4000)
    last_round = tool_round("c", "search", "fetch", result_chars=8000)
    messages += last_round
    guard = ContextGuard(scripted_llm([text("summary")]), budget_tokens=1000, keep_recent=8)

    out, event = await guard.check_and_compact(messages, Usage())

    assert event is not None
    assert out[0] is messages[0]
    assert out[1] is messages[1]
    assert (out[2].content or "").startswith(SUMMARY_PREFIX)
    assert out[3:] == last_round
    assert_valid_conversation(out)


async def test_nothing_to_drop_leaves_the_list_alone_without_an_llm_call(scripted_llm: MakeLLM) -> None:
    messages = [system("s" * 8000), user("u" * 8000, pinned=True), assistant("a" * 8000)]
    guard = ContextGuard(scripted_llm([]), budget_tokens=1000)

    out, event = await guard.check_and_compact(messages, Usage())

    assert out is messages
    assert event is None


async def test_conversation_without_system_prompt_compacts_from_the_start(scripted_llm: MakeLLM) -> None:
    messages = long_run()[1:]
    guard = ContextGuard(scripted_llm([text("summary")]), budget_tokens=total(messages) // 2, keep_recent=4)

    out, _ = await guard.check_and_compact(messages, Usage())

    assert out[0] is messages[0]  # the pinned question
    assert (out[1].content or "").startswith(SUMMARY_PREFIX)
    assert out[-4:] == messages[-4:]
    assert_valid_conversation(out)


async def test_repeated_compaction_in_a_growing_loop_stays_within_budget() -> None:
    llm = SummaryLLM(random.Random(7), fail_rate=0.0, max_chars=200)
    guard = ContextGuard(llm, budget_tokens=1500, keep_recent=4)
    messages = [system(), user("goal", pinned=True)]
    compactions = 0
    for i in range(40):
        messages, event = await guard.check_and_compact(messages, Usage())
        compactions += event is not None
        assert guard.total_tokens(messages) <= 1500
        assert total(messages) <= 1500
        assert_valid_conversation(messages)
        messages = [*messages, *tool_round(f"r{i}", "search", result_chars=600)]
    assert compactions == llm.calls
    assert compactions > 3


class SummaryLLM:
    """Answers every summary request; fails some of them, as a flaky provider would."""

    def __init__(self, rng: random.Random, *, fail_rate: float = 0.2, max_chars: int = 3000) -> None:
        self._rng = rng
        self._fail_rate = fail_rate
        self._max_chars = max_chars
        self.calls = 0

    @property
    def abilities(self) -> Mapping[str, bool]:
        return {"tool_call": True, "json_mode": True, "streaming": True}

    @property
    def model_name(self) -> str:
        return "summary"

    async def chat(self, messages: Sequence[ChatMessage], **_: Any) -> ChatResult:
        self.calls += 1
        if self._rng.random() < self._fail_rate:
            raise LLMUnavailableError("flaky")
        return text("s" * self._rng.randint(0, self._max_chars))

    def stream_chat(self, messages: Sequence[ChatMessage]) -> Any:
        raise AssertionError("the guard never streams")


def random_conversation(rng: random.Random) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    if rng.random() < 0.8:
        messages.append(system("sys " * rng.randint(1, 50)))
    messages.append(user("goal " * rng.randint(1, 30), pinned=rng.random() < 0.7))
    for i in range(rng.randint(0, 25)):
        kind = rng.random()
        if kind < 0.55:
            names = [rng.choice(["search", "fetch", "calc", "read"]) for _ in range(rng.randint(1, 4))]
            round_ = tool_round(f"t{i}", *names, result_chars=rng.randint(0, 1500))
            if rng.random() < 0.1:
                pick = rng.randrange(len(round_))
                m = round_[pick]
                round_[pick] = ChatMessage(
                    role=m.role,
                    content=m.content,
                    tool_calls=m.tool_calls,
                    tool_call_id=m.tool_call_id,
                    pinned=True,
                )
            messages += round_
        elif kind < 0.75:
            messages.append(assistant("think " * rng.randint(0, 200)))
        else:
            messages.append(user("more " * rng.randint(0, 100), pinned=rng.random() < 0.5))
    return messages


async def test_compaction_of_random_conversations_never_breaks_tool_call_pairs() -> None:
    rng = random.Random(20240611)
    compacted = 0
    for _ in range(400):
        messages = random_conversation(rng)
        assert_valid_conversation(messages)
        budget = rng.randint(50, max(60, total(messages)))
        guard = ContextGuard(SummaryLLM(rng), budget_tokens=budget, keep_recent=rng.randint(0, 10))

        out, event = await guard.check_and_compact(list(messages), Usage())

        assert_valid_conversation(out)
        assert out[-1] is messages[-1]
        if messages[0].role == "system":
            assert out[0] is messages[0]
        original_ids = {id(m) for m in messages}
        pinned_in = [m for m in messages if m.pinned]
        assert [m for m in out if m.pinned] == pinned_in
        assert all(a is b for a, b in zip([m for m in out if m.pinned], pinned_in, strict=True))
        kept_originals = [m for m in out if id(m) in original_ids]
        assert kept_originals == [m for m in messages if any(m is k for k in kept_originals)]
        if event is None:
            assert out is messages or out == messages
        else:
            compacted += 1
            assert event == Compacted(original_messages=len(messages), kept_messages=len(out))
            assert len(out) == len(kept_originals) + 1
    assert compacted > 100


def test_the_reasoning_kept_for_a_provider_counts_in_the_estimate() -> None:
    # DeepSeek's thinking is sent back with every later request: it takes context like content.
    plain = ChatMessage(role="assistant", content="ok")
    thinking = ChatMessage(role="assistant", content="ok", reasoning="x" * 4000)

    assert estimate_tokens(thinking) - estimate_tokens(plain) == 1000
