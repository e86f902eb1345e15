"""User interrupts during a run: drain points, merging, suppression, late arrivals (E-22 to E-25)."""

from __future__ import annotations

from typing import Any

from app.engine.events import Injected, IterationStarted, RunDone
from app.llm.base import ChatMessage, LLMUnavailableError
from tests.support.scripted import StreamScript, json_final, json_tool, native_tools, text
from tests.unit.engine.agent_support import (
    JSON_ONLY,
    NATIVE,
    EventLog,
    MakeLLM,
    PushQueue,
    answer,
    make_agent,
    roles,
)


def pushing(queue: PushQueue, reply: Any, *contents: str) -> Any:
    """A scripted reply that queues interrupts while the model is 'thinking'."""

    def respond(_messages: list[ChatMessage], _kwargs: dict[str, Any]) -> Any:
        queue.push(*contents)
        return reply

    return respond


async def test_interrupt_suppresses_pending_final_answer(scripted_llm: MakeLLM) -> None:
    queue = PushQueue()
    llm = scripted_llm(
        [
            pushing(queue, json_final("Berlin"), "actually, I meant Paris"),
            json_final("Paris"),
            answer("Paris."),
        ],
        abilities=JSON_ONLY,
    )
    log = EventLog()

    result = await make_agent(llm).run("Capital?", sink=log, interrupts=queue)

    assert result.iterations == 2
    second = llm.calls[1].messages
    assert roles(second)[-2:] == ["assistant", "user"]
    assert second[-1].content == "[USER INTERRUPT] actually, I meant Paris" and second[-1].pinned
    assert [e.content for e in log.of(Injected)] == ["actually, I meant Paris"]
    assert "actually, I meant Paris" in (llm.calls[2].messages[-1].content or "")  # synthesis knows
    assert result.answer == "Paris."


async def test_json_mode_drains_right_after_the_assistant_message_before_the_tool_runs(
    scripted_llm: MakeLLM,
) -> None:
    queue = PushQueue()
    llm = scripted_llm(
        [pushing(queue, json_tool("echo", {}), "also check B"), json_final("ok"), answer()],
        abilities=JSON_ONLY,
    )
    log = EventLog()

    await make_agent(llm).run("q", sink=log, interrupts=queue)

    kinds = log.kinds
    assert kinds.index("inject") == kinds.index("thinking_done") + 1
    assert kinds.index("inject") < kinds.index("iteration_start")
    second = llm.calls[1].messages
    assert roles(second)[-3:] == ["assistant", "user", "user"]
    assert (second[-2].content or "").startswith("[USER INTERRUPT]")
    assert (second[-1].content or "").startswith("Observation from `echo`")


async def test_one_drain_merges_all_messages_into_one_pinned_user_message(scripted_llm: MakeLLM) -> None:
    queue = PushQueue()
    llm = scripted_llm(
        [pushing(queue, native_tools(("echo", {})), "first", "second"), text("done"), answer()],
        abilities=NATIVE,
    )
    log = EventLog()

    await make_agent(llm).run("q", sink=log, interrupts=queue)

    injected = [m for m in llm.calls[1].messages if (m.content or "").startswith("[USER INTERRUPT]")]
    assert len(injected) == 1 and injected[0].pinned
    assert "1. first\n2. second" in (injected[0].content or "")
    assert [e.content for e in log.of(Injected)] == ["first\nsecond"]


async def test_native_final_reply_drains_after_the_assistant_message(scripted_llm: MakeLLM) -> None:
    queue = PushQueue()
    llm = scripted_llm(
        [pushing(queue, text("draft"), "one more thing"), text("final"), answer()],
        abilities=NATIVE,
    )

    result = await make_agent(llm).run("q", sink=EventLog(), interrupts=queue)

    second = llm.calls[1].messages
    assert roles(second)[-2:] == ["assistant", "user"]
    assert second[-2].content == "draft"
    assert result.iterations == 2


async def test_interrupt_messages_are_kept_in_the_result_messages(scripted_llm: MakeLLM) -> None:
    queue = PushQueue()
    llm = scripted_llm([pushing(queue, text("draft"), "hey"), text("final"), answer("F")], abilities=NATIVE)

    result = await make_agent(llm).run("q", sink=EventLog(), interrupts=queue)

    assert [(m.role, m.content) for m in result.messages] == [
        ("user", "q"),
        ("user", "[USER INTERRUPT] hey"),
        ("assistant", "F"),
    ]


async def test_interrupts_arriving_after_the_loop_are_pending_injections(scripted_llm: MakeLLM) -> None:
    queue = PushQueue()
    llm = scripted_llm(
        [text("done"), pushing(queue, StreamScript(["Answer."]), "too late", "also late")],
        abilities=NATIVE,
    )
    log = EventLog()

    result = await make_agent(llm).run("q", sink=log, interrupts=queue)

    assert result.pending_injections == ["too late", "also late"]
    assert log.done.pending_injections == ("too late", "also late")
    assert not log.of(Injected)
    assert queue.items == []


async def test_failed_run_hands_back_interrupts_that_arrived_during_the_failing_call(
    scripted_llm: MakeLLM,
) -> None:
    queue = PushQueue()
    llm = scripted_llm([pushing(queue, LLMUnavailableError("503"), "are you there?")], abilities=NATIVE)
    log = EventLog()

    result = await make_agent(llm).run("q", sink=log, interrupts=queue)

    assert result.status == "failed"
    assert result.pending_injections == ["are you there?"]
    assert log.done.pending_injections == ("are you there?",)


async def test_no_drain_without_an_interrupt_queue(scripted_llm: MakeLLM) -> None:
    llm = scripted_llm([json_tool("echo", {}), json_final("ok"), answer()], abilities=JSON_ONLY)
    log = EventLog()

    await make_agent(llm).run("q", sink=log)

    assert not log.of(Injected)
    assert len(log.of(IterationStarted)) == 1
    assert len(log.of(RunDone)) == 1


async def test_drain_happens_once_per_iteration_and_once_after_synthesis(scripted_llm: MakeLLM) -> None:
    queue = PushQueue()
    llm = scripted_llm([native_tools(("echo", {})), text("done"), answer()], abilities=NATIVE)

    await make_agent(llm).run("q", sink=EventLog(), interrupts=queue)

    assert queue.drains == 3


async def test_interrupt_after_checklist_is_handled_before_finishing(scripted_llm: MakeLLM) -> None:
    queue = PushQueue()
    replies: list[Any] = [native_tools(("echo", {"i": i})) for i in range(3)]
    replies += [text("draft"), pushing(queue, text("checked"), "wait"), text("final"), answer()]
    llm = scripted_llm(replies, abilities=NATIVE)

    result = await make_agent(llm).run("q", sink=EventLog(), interrupts=queue)

    # tools x3, draft (checklist injected), "checked" suppressed by the interrupt, final
    assert result.iterations == 6
    assert (llm.calls[5].messages[-1].content or "") == "[USER INTERRUPT] wait"


async def test_interrupt_on_the_last_iteration_keeps_the_answer_and_reaches_synthesis(
    scripted_llm: MakeLLM,
) -> None:
    queue = PushQueue()
    llm = scripted_llm(
        [pushing(queue, json_final("42"), "in words please"), answer("Forty-two.")], abilities=JSON_ONLY
    )
    log = EventLog()

    result = await make_agent(llm, max_iterations=1).run("q", sink=log, interrupts=queue)

    synthesis_prompt = llm.calls[1].messages[-1].content or ""
    assert "## Draft answer\n42" in synthesis_prompt
    assert "- in words please" in synthesis_prompt
    assert [e.content for e in log.of(Injected)] == ["in words please"]
    assert result.answer == "Forty-two." and result.pending_injections == []
