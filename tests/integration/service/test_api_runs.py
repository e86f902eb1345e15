"""Runs through the API: start, the run record, its durable events, interrupt, cancel, history, usage.

A run the test must hold active waits on a blocked reply of the fake OpenAI server (or a tool that
waits for the test), never on a sleep.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from app.tools.registry import Tool
from tests.integration.service.conftest import Api, Service, ServiceFactory
from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer, FakeReply
from tests.support.services import REDIS_URL
from tests.support.sse import SseEvent

# Cancel must stop a run well before any LLM or tool timeout would.
PROMPT_S = 3.0


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set by the test (or at the end) to let a blocked fake reply or a waiting tool go on."""
    event = threading.Event()
    try:
        yield event
    finally:
        event.set()


def next_event(items: Iterator[SseEvent | str], kind: str) -> SseEvent:
    for item in items:
        if isinstance(item, SseEvent) and item.event == kind:
            return item
    raise AssertionError(f"the stream ended before a {kind} event")


def rest(items: Iterator[SseEvent | str]) -> list[SseEvent]:
    return [item for item in items if isinstance(item, SseEvent)]


def test_a_run_is_202_streams_to_done_and_its_record_and_events_match_the_stream(stack_api: Api) -> None:
    api = stack_api
    conv = api.create_conversation()

    response = api.http.post(f"/api/conversations/{conv['id']}/runs", json={"message": "What is 6*7?"})
    assert response.status_code == 202
    started = response.json()
    events = api.stream(conv["id"])

    assert started == {
        "run_id": started["run_id"],
        "conversation_id": conv["id"],
        "status": "running",
        "stream_url": f"/api/conversations/{conv['id']}/stream",
    }
    assert events[-1].event == "done"
    assert [e.event for e in events].count("done") == 1
    assert all(e.data["run_id"] == started["run_id"] for e in events)
    done = events[-1].data
    assert done["status"] == "completed"
    assert "42" in done["answer"]
    deltas = [e.data["content"] for e in events if e.event == "answer" and e.data["status"] == "delta"]
    assert "".join(deltas) == done["answer"]

    run = api.get_run(started["run_id"])
    assert set(run) == {
        "run_id", "conversation_id", "status", "answer", "iterations", "usage", "elapsed", "error",
        "created_at", "finished_at", "attempt", "model", "pending_approvals", "trace_id",
        "pending_tool_calls", "replay_of",
    }  # fmt: skip
    assert (run["attempt"], run["pending_approvals"], run["trace_id"]) == (1, [], None)
    assert (run["pending_tool_calls"], run["replay_of"]) == ([], None)
    # The configured model's name: without LLM_MODELS the one model is "default" (the demo here).
    assert run["model"] == "default" == done["model"]
    assert run["run_id"] == started["run_id"]
    assert run["conversation_id"] == conv["id"]
    assert run["status"] == "completed"
    assert run["answer"] == done["answer"]
    assert run["iterations"] == done["iterations"] >= 1
    assert run["usage"] == done["usage"]
    assert run["usage"]["llm_calls"] >= 2
    assert run["elapsed"] == done["elapsed"]
    assert run["error"] is None
    assert run["finished_at"] is not None and run["finished_at"] >= run["created_at"]

    stored = api.run_events(started["run_id"])
    assert stored == [{"id": e.id, "event": e.event, "data": e.data} for e in events]


def test_a_second_run_while_one_is_active_is_409_run_active(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, release: threading.Event
) -> None:
    fake_llm.script(FakeReply.blocked(release, FakeReply.text("first answer")))
    fake_llm.set_handler(EchoAgentBehaviour())
    api = service(llm=fake_llm).api()
    conv = api.create_conversation()
    first = api.start_run(conv["id"], "first question")
    fake_llm.wait_for_requests(1)

    second = api.http.post(f"/api/conversations/{conv['id']}/runs", json={"message": "second question"})
    during = api.conversation(conv["id"])
    running = api.get_run(first["run_id"])
    release.set()
    events = api.stream(conv["id"])

    assert second.status_code == 409
    assert second.json()["error"]["code"] == "run_active"
    assert [m["content"] for m in during["messages"]] == ["first question"]
    assert running["status"] == "running"
    assert (running["answer"], running["finished_at"], running["error"]) == (None, None, None)
    assert events[-1].data["run_id"] == first["run_id"]
    assert events[-1].data["status"] == "completed"
    # Once it is done, the conversation takes the next run.
    assert api.run(conv["id"], "second question").done["status"] == "completed"


def test_run_events_of_an_unknown_run_are_404(alice: Api) -> None:
    for path in ("/api/runs/run_missing", "/api/runs/run_missing/events"):
        response = alice.http.get(path)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"


def test_interrupt_is_202_with_the_queue_length_and_reaches_the_run_as_an_inject_event(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, release: threading.Event
) -> None:
    # The blocked first call asks for a tool; in native mode interrupts are drained after its result.
    fake_llm.script(FakeReply.blocked(release, FakeReply.tool_calls([("calculator", {"expression": "2+3"})])))
    fake_llm.set_handler(EchoAgentBehaviour())
    api = service(llm=fake_llm).api()
    conv = api.create_conversation()
    api.start_run(conv["id"], "add two and three")
    fake_llm.wait_for_requests(1)

    first = api.http.post(f"/api/conversations/{conv['id']}/interrupt", json={"content": "also multiply"})
    second = api.http.post(f"/api/conversations/{conv['id']}/interrupt", json={"content": "by ten"})
    release.set()
    events = api.stream(conv["id"])
    after = api.http.post(f"/api/conversations/{conv['id']}/interrupt", json={"content": "too late"})

    assert (first.status_code, first.json()) == (202, {"queued": 1})
    assert (second.status_code, second.json()) == (202, {"queued": 2})
    injects = [e.data for e in events if e.event == "inject"]
    assert len(injects) == 1
    assert injects[0]["type"] == "inject"
    assert "also multiply" in injects[0]["content"] and "by ten" in injects[0]["content"]
    assert events[-1].data["status"] == "completed"
    later_calls = [b for b in fake_llm.requests[1:] if not b.get("stream")]
    assert any("also multiply" in str(m.get("content")) for b in later_calls for m in b["messages"])
    assert after.status_code == 409
    assert after.json()["error"]["code"] == "no_active_run"


@pytest.mark.parametrize("bus", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_interrupts_beyond_100_waiting_are_429_and_queue_nothing(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, release: threading.Event, bus: str
) -> None:
    fake_llm.script(FakeReply.blocked(release, FakeReply.tool_calls([("calculator", {"expression": "2+3"})])))
    fake_llm.set_handler(EchoAgentBehaviour())
    api = service(llm=fake_llm, redis_url=REDIS_URL if bus == "redis" else None).api()
    conv = api.create_conversation()
    api.start_run(conv["id"], "add two and three")
    fake_llm.wait_for_requests(1)
    path = f"/api/conversations/{conv['id']}/interrupt"

    queued = [api.http.post(path, json={"content": f"note {n}"}) for n in range(100)]
    refused = api.http.post(path, json={"content": "one too many"})
    release.set()
    events = api.stream(conv["id"])

    assert [(r.status_code, r.json()["queued"]) for r in queued] == [(202, n + 1) for n in range(100)]
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "too_many_follow_ups"
    assert refused.headers["Retry-After"] == "1"
    injected = "".join(e.data["content"] for e in events if e.event == "inject")
    assert "note 0" in injected and "note 99" in injected and "one too many" not in injected
    assert events[-1].data["status"] == "completed"


def test_interrupt_and_cancel_without_any_run_are_409_no_active_run(alice: Api) -> None:
    conv = alice.create_conversation()
    before = alice.snapshot()

    interrupt = alice.http.post(f"/api/conversations/{conv['id']}/interrupt", json={"content": "hi"})
    cancel = alice.http.post(f"/api/conversations/{conv['id']}/cancel")

    for response in (interrupt, cancel):
        assert response.status_code == 409
        assert response.json()["error"]["code"] == "no_active_run"
    assert alice.snapshot() == before


def test_cancel_while_the_llm_call_is_in_flight_ends_the_run_cancelled_promptly(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, release: threading.Event
) -> None:
    fake_llm.script(FakeReply.blocked(release, FakeReply.text("never used")))
    api = service(llm=fake_llm).api()
    conv = api.create_conversation()
    started = api.start_run(conv["id"], "think hard")
    fake_llm.wait_for_requests(1)

    with api.open_stream(conv["id"]) as items:
        next_event(items, "step")
        t0 = time.monotonic()
        response = api.http.post(f"/api/conversations/{conv['id']}/cancel")
        done = next_event(items, "done")
        took = time.monotonic() - t0

    assert response.status_code == 202
    assert response.json()["run_id"] == started["run_id"]
    assert done.data["status"] == "cancelled"
    assert took < PROMPT_S
    run = api.get_run(started["run_id"])
    assert run["status"] == "cancelled"
    assert run["finished_at"] is not None
    again = api.http.post(f"/api/conversations/{conv['id']}/cancel")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "no_active_run"
    assert len(fake_llm.requests) == 1


def waiting_tool(entered: threading.Event) -> Tool:
    """A tool that says it started, then waits until it is cancelled (or times out, failing the test)."""

    async def wait_until_cancelled() -> str:
        entered.set()
        await asyncio.Event().wait()
        return "never"

    return Tool(
        name="wait_until_cancelled",
        description="Waits until the run is cancelled.",
        parameters={"type": "object", "properties": {}},
        func=wait_until_cancelled,
        timeout_s=10.0,
    )


def test_cancel_while_a_tool_runs_ends_the_run_cancelled_promptly(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    entered = threading.Event()
    fake_llm.script(FakeReply.tool_calls([("wait_until_cancelled", {})]))
    svc: Service = service(llm=fake_llm)
    svc.add_tool(waiting_tool(entered))
    api = svc.api()
    conv = api.create_conversation()
    started = api.start_run(conv["id"], "wait for it")
    assert entered.wait(10), "the tool never started"

    t0 = time.monotonic()
    response = api.http.post(f"/api/conversations/{conv['id']}/cancel")
    events = api.stream(conv["id"])
    took = time.monotonic() - t0

    assert response.status_code == 202
    assert events[-1].event == "done"
    assert events[-1].data["status"] == "cancelled"
    assert took < PROMPT_S
    assert api.get_run(started["run_id"])["status"] == "cancelled"
    fake_llm.assert_done()


def test_a_second_run_sees_the_first_runs_question_tool_calls_results_and_answer(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    fake_llm.script(
        FakeReply.tool_calls([("calculator", {"expression": "19*23"})]),
        FakeReply.text("It is 437."),
        FakeReply.stream(["The product ", "is 437."]),
        FakeReply.text("Yes, 437."),
        FakeReply.stream(["Still ", "437."]),
    )
    api = service(llm=fake_llm).api()
    conv = api.create_conversation()
    first = api.run(conv["id"], "What is 19*23?")
    requests_of_first = len(fake_llm.requests)

    second = api.run(conv["id"], "Are you sure?")

    fake_llm.assert_done()
    assert first.done["answer"] == "The product is 437."
    assert second.done["status"] == "completed"
    messages: list[dict[str, Any]] = fake_llm.requests[requests_of_first]["messages"]
    contents = [str(m.get("content") or "") for m in messages]
    asked = contents.index("What is 19*23?")
    call = next(m for m in messages[asked:] if m["role"] == "assistant" and m.get("tool_calls"))
    assert call["tool_calls"][0]["function"]["name"] == "calculator"
    result = next(m for m in messages if m["role"] == "tool")
    assert result["tool_call_id"] == call["tool_calls"][0]["id"]
    assert "437" in result["content"]
    assert any(m["role"] == "assistant" and "437" in str(m.get("content")) for m in messages[asked:-1])
    assert messages[-1] == {"role": "user", "content": "Are you sure?"}


def test_done_usage_adds_up_what_the_provider_reported_for_every_call(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    fake_llm.script(
        FakeReply.tool_calls([("calculator", {"expression": "1+1"})], usage=(101, 7)),
        FakeReply.text("Two.", usage=(211, 13)),
        FakeReply.stream(["It ", "is ", "two."], usage=(307, 17)),
    )
    api = service(llm=fake_llm).api()
    conv = api.create_conversation()

    outcome = api.run(conv["id"], "What is 1+1?")

    fake_llm.assert_done()
    expected = {"prompt_tokens": 619, "completion_tokens": 37, "total_tokens": 656, "llm_calls": 3}
    assert outcome.done["usage"] == expected
    assert api.get_run(outcome.run_id)["usage"] == expected


def test_every_event_is_in_the_run_events_as_soon_as_done_arrives(alice: Api) -> None:
    # A client that saw done reads the durable log next; nothing of the run may still be on its way.
    conv = alice.create_conversation()
    for i in range(8):
        outcome = alice.run(conv["id"], f"What is {i}+{i}?")
        stored = alice.run_events(outcome.run_id)
        assert stored == [{"id": e.id, "event": e.event, "data": e.data} for e in outcome.events], i


def test_of_concurrent_starts_in_one_conversation_exactly_one_is_202(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, release: threading.Event
) -> None:
    fake_llm.set_handler(lambda body: FakeReply.blocked(release, FakeReply.text("done")))
    svc = service(llm=fake_llm)
    conv = svc.api().create_conversation()

    def start(i: int) -> httpx.Response:
        with httpx.Client(base_url=svc.base_url, timeout=15) as http:
            return http.post(f"/api/conversations/{conv['id']}/runs", json={"message": f"question {i}"})

    with ThreadPoolExecutor(max_workers=6) as pool:
        responses = list(pool.map(start, range(6)))

    statuses = sorted(r.status_code for r in responses)
    assert statuses == [202, 409, 409, 409, 409, 409]
    assert all(r.json()["error"]["code"] == "run_active" for r in responses if r.status_code == 409)
    users = [m for m in svc.api().conversation(conv["id"])["messages"] if m["role"] == "user"]
    assert len(users) == 1  # the refused starts stored nothing


def test_an_interrupt_too_late_for_the_loop_is_reported_in_done_and_kept_for_the_next_run(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, release: threading.Event
) -> None:
    fake_llm.script(
        FakeReply.text("Paris."),
        FakeReply.blocked(release, FakeReply.stream(["The capital ", "is Paris."])),
        FakeReply.text("Lyon is second."),
        FakeReply.stream(["Lyon."]),
    )
    api = service(llm=fake_llm).api()
    conv = api.create_conversation()
    api.start_run(conv["id"], "Capital of France?")
    fake_llm.wait_for_requests(2)  # the answer is being synthesised: the loop is over

    late = api.http.post(
        f"/api/conversations/{conv['id']}/interrupt", json={"content": "and the second city?"}
    )
    release.set()
    first = api.stream(conv["id"])
    second = api.run(conv["id"], "Go on.")

    assert (late.status_code, late.json()) == (202, {"queued": 1})
    assert first[-1].data["status"] == "completed"
    assert first[-1].data["pending_injections"] == ["and the second city?"]
    stored = [m for m in api.conversation(conv["id"])["messages"] if m["content"] == "and the second city?"]
    assert len(stored) == 1 and stored[0]["pinned"] and stored[0]["role"] == "user"
    assert second.done["status"] == "completed"
    third_call = fake_llm.requests[2]["messages"]
    assert any("and the second city?" in str(m.get("content")) for m in third_call)
    fake_llm.assert_done()


def test_a_run_whose_model_fails_ends_failed_and_the_conversation_takes_the_next_run(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    fake_llm.script(FakeReply.error(503, {"error": {"message": "overloaded"}}))
    api = service(llm=fake_llm).api()
    conv = api.create_conversation()

    failed = api.run(conv["id"], "Anyone there?")
    fake_llm.set_handler(EchoAgentBehaviour())
    after = api.run(conv["id"], "Try again.")

    assert failed.done["status"] == "failed"
    assert failed.done["error"]
    record = api.get_run(failed.run_id)
    assert (record["status"], record["error"]) == ("failed", failed.done["error"])
    assert record["finished_at"] is not None
    assert after.done["status"] == "completed"
    metrics = api.http.get("/metrics").text
    assert 'agentstream_runs_total{status="failed"} 1.0' in metrics
