"""The context guard over the wire: what the model receives after compaction (E-16, E-24)."""

from __future__ import annotations

from app.engine.context import SUMMARY_PREFIX
from app.engine.events import Compacted
from app.engine.interrupts import MemoryInterruptQueue
from app.llm.openai_client import OpenAICompatibleLLM
from tests.integration.engine.wire import (
    Body,
    EventLog,
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


class _Model:
    """Answers summary requests, synthesis and the loop (tool calls first, then a final answer)."""

    def __init__(self) -> None:
        self.loop_calls = 0

    def __call__(self, body: Body) -> FakeReply:
        if _is_summary_request(body):
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
    summary_at = next(i for i, body in enumerate(requests) if _is_summary_request(body))
    summary_request, before, after = requests[summary_at], requests[summary_at - 1], requests[summary_at + 1]
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
