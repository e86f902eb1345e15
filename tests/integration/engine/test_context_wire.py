"""The context guard over the wire: what the model receives after compaction (E-16, E-24)."""

from __future__ import annotations

from app.engine import prompts
from app.engine.context import MARKER_PREFIX, SUMMARY_PREFIX, estimate_tokens
from app.engine.events import Compacted
from app.engine.interrupts import MemoryInterruptQueue
from app.llm.base import ChatMessage, ToolCall
from app.llm.openai_client import OpenAICompatibleLLM
from tests.integration.engine.wire import (
    Body,
    EventLog,
    MakeLLM,
    assert_tool_messages_paired,
    make_agent,
    registry,
    tool,
)
from tests.support.fake_openai import FakeOpenAIServer, FakeReply

PAGE_CHARS = 2400
"""About 600 estimated tokens a tool result: three results overflow the budget below."""
BUDGET = 1500


def _is_summary_request(body: Body) -> bool:
    return "You compact the working memory" in (body["messages"][0].get("content") or "")


def _around_first_summary(requests: list[Body]) -> tuple[Body, Body, Body]:
    """The loop request before the first summary request, that request, and the loop request after it."""
    at = next(i for i, body in enumerate(requests) if _is_summary_request(body))
    return requests[at - 1], requests[at], requests[at + 1]


class _Model:
    """Answers summary requests, synthesis and the loop (tool calls first, then a final answer)."""

    def __init__(self, *, summary_fails: bool = False) -> None:
        self.loop_calls = 0
        self.summary_fails = summary_fails

    def __call__(self, body: Body) -> FakeReply:
        if _is_summary_request(body):
            if self.summary_fails:
                return FakeReply.error(503)
            return FakeReply.text("Fetched page 1 (mentions A); next: pages 2 and 3.")
        if body.get("stream"):
            return FakeReply.stream(["Pages read."])
        self.loop_calls += 1
        plan = {
            1: [("fetch", {"page": 1})],
            2: [("fetch", {"page": 2}), ("fetch", {"page": 3})],
            3: [("fetch", {"page": 4})],
        }
        calls = plan.get(self.loop_calls)
        return FakeReply.tool_calls(calls) if calls else FakeReply.text("Read four pages.")


async def test_compaction_keeps_system_prompt_and_pinned_interrupt_and_leaves_no_orphan_tool_message(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    queue = MemoryInterruptQueue()

    async def fetch(page: int) -> str:
        if page == 1:
            await queue.put("only the first lines matter")
        return f"page {page}: " + "lorem ipsum " * (PAGE_CHARS // 12)

    fake_server.set_handler(_Model())
    log = EventLog()

    await make_agent(
        llm, registry(tool("fetch", fetch)), context_token_budget=BUDGET, completion_check=False
    ).run("Read the pages.", sink=log, interrupts=queue)

    assert log.done.status == "completed"
    requests = fake_server.requests
    before, summary_request, after = _around_first_summary(requests)
    assert "recent reasoning chain" in summary_request["messages"][0]["content"]
    assert "[tool result: fetch] page 1:" in summary_request["messages"][1]["content"]

    assert after["messages"][0] == before["messages"][0]
    assert after["messages"][0]["role"] == "system"
    assert after["messages"][1] == {"role": "user", "content": "Read the pages."}
    user_texts = [m["content"] for m in after["messages"] if m["role"] == "user"]
    assert "[USER INTERRUPT] only the first lines matter" in user_texts
    assert any(text.startswith(SUMMARY_PREFIX) for text in user_texts)
    assert_tool_messages_paired(after)
    assert not any("page 1:" in (m.get("content") or "") for m in after["messages"])

    compacted = log.of(Compacted)[0]
    assert compacted.kept_messages == len(after["messages"])
    assert compacted.kept_messages < compacted.original_messages
    for body in requests:
        if not _is_summary_request(body) and not body.get("stream"):
            assert_tool_messages_paired(body)


async def test_failed_summary_call_is_replaced_by_a_marker_naming_the_dropped_tools(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM
) -> None:
    async def fetch(page: int) -> str:
        return f"page {page}: " + "lorem ipsum " * (PAGE_CHARS // 12)

    fake_server.set_handler(_Model(summary_fails=True))
    log = EventLog()

    await make_agent(
        make_llm(max_retries=0),
        registry(tool("fetch", fetch)),
        context_token_budget=BUDGET,
        completion_check=False,
    ).run("Read the pages.", sink=log)

    assert log.done.status == "completed"
    _, _, after = _around_first_summary(fake_server.requests)
    markers = [
        m["content"] for m in after["messages"] if m["content"] and m["content"].startswith(MARKER_PREFIX)
    ]
    assert len(markers) == 1 and "Tools involved: fetch." in markers[0]
    assert_tool_messages_paired(after)
    assert log.of(Compacted)


def _messages_at_overflow(question: str, big: str) -> list[ChatMessage]:
    """The loop's messages before its fifth call in the scenario below, as the engine holds them."""
    batch = tuple(ToolCall(f"call_{i}_fetch", "fetch", f'{{"page":{i}}}') for i in range(3))
    msgs = [
        ChatMessage(role="system", content=prompts.native_system_prompt()),
        ChatMessage(role="user", content=question),
        ChatMessage(role="assistant", content=None, tool_calls=batch),
        *(ChatMessage(role="tool", content=big, tool_call_id=c.id, name="fetch") for c in batch),
    ]
    for n in range(3):
        # The fake names every call call_0_ping; the engine makes ids unique within the run.
        call = ToolCall("call_0_ping" if n == 0 else f"call_{n + 2}_0", "ping", f'{{"n":{n}}}')
        msgs.append(ChatMessage(role="assistant", content=None, tool_calls=(call,)))
        msgs.append(ChatMessage(role="tool", content=f"pong {n}", tool_call_id=call.id, name="ping"))
    return msgs


async def test_compaction_never_splits_a_parallel_batch_when_the_recent_window_starts_inside_it(
    fake_server: FakeOpenAIServer, llm: OpenAICompatibleLLM
) -> None:
    question = "Read three pages, then ping three times."
    big = "x" * PAGE_CHARS

    async def fetch(page: int) -> str:
        return big

    async def ping(n: int) -> str:
        return f"pong {n}"

    overflow = _messages_at_overflow(question, big)
    # Over budget only once the 12th message is in: the 8 most recent then start inside the batch.
    budget = sum(estimate_tokens(m) for m in overflow) - 1
    assert budget >= sum(estimate_tokens(m) for m in overflow[:-2])
    script = iter(
        [
            FakeReply.tool_calls([("fetch", {"page": i}) for i in range(3)]),
            *(FakeReply.tool_calls([("ping", {"n": n})]) for n in range(3)),
            FakeReply.text("Done."),
        ]
    )

    def model(body: Body) -> FakeReply:
        if _is_summary_request(body):
            return FakeReply.text("Three pages of x were read.")
        if body.get("stream"):
            return FakeReply.stream(["Done."])
        return next(script)

    fake_server.set_handler(model)
    log = EventLog()

    await make_agent(
        llm,
        registry(tool("fetch", fetch), tool("ping", ping)),
        context_token_budget=budget,
        completion_check=False,
        self_reflection_interval=100,
    ).run(question, sink=log)

    (compacted,) = log.of(Compacted)
    assert compacted.original_messages == len(overflow)
    after = _around_first_summary(fake_server.requests)[2]
    assert_tool_messages_paired(after)
    assert compacted.kept_messages == len(after["messages"])
    assert not any(m.get("content") == big for m in after["messages"])
    assert log.done.status == "completed"
