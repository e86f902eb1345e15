"""Usage in ``done`` is the sum of what the provider reported over every call of the run (E-02, E-28)."""

from __future__ import annotations

from app.engine import prompts
from app.engine.events import PhaseChanged
from tests.integration.engine.wire import (
    MODEL,
    EventLog,
    MakeLLM,
    RecordingSleep,
    echo_tool,
    make_agent,
    registry,
)
from tests.support.fake_openai import FakeOpenAIServer, FakeReply


async def test_done_usage_sums_selection_loop_checklist_and_synthesis_and_counts_retries(
    fake_server: FakeOpenAIServer, make_llm: MakeLLM, retry_sleep: RecordingSleep
) -> None:
    tools = registry(*(echo_tool(f"echo_{n:02d}") for n in range(13)))
    reported = [(101, 1), (203, 2), (307, 3), (409, 4), (503, 5)]
    fake_server.script(
        FakeReply.tool_calls([("select_tools", {"tools": ["echo_01", "echo_02"]})], usage=reported[0]),
        FakeReply.tool_calls(
            [("echo_01", {"n": 1}), ("echo_02", {"n": 2}), ("echo_01", {"n": 3})], usage=reported[1]
        ),
        FakeReply.error(503, headers={"retry-after": "0"}),
        FakeReply.text("Draft.", usage=reported[2]),
        FakeReply.text("Checked.", usage=reported[3]),
        FakeReply.stream(["All ", "checked."], usage=reported[4]),
    )
    log = EventLog()

    await make_agent(make_llm(), tools).run("Echo three times.", sink=log)

    prompt = sum(p for p, _ in reported)
    completion = sum(c for _, c in reported)
    assert log.done.usage == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "llm_calls": 6,
    }
    assert retry_sleep.delays == [0.0]
    assert len(log.of(PhaseChanged)) == 1
    requests = fake_server.requests
    assert requests[4]["messages"][-1]["content"] == prompts.completion_checklist(json_mode=False)
    assert {body["model"] for body in requests} == {MODEL}  # one client for every call (E-02)
    assert log.done.answer == "All checked."
