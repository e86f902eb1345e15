"""``POST /api/chat``: start a run and stream it in the same response."""

from __future__ import annotations

import threading

from tests.integration.service.conftest import Api, ServiceFactory
from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer, FakeReply
from tests.support.sse import SseEvent, read_events


def chat(api: Api, body: dict[str, object]) -> list[SseEvent]:
    with api.http.stream("POST", "/api/chat", json=body) as response:
        assert response.status_code == 200, response.read().decode(errors="replace")
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        return read_events(response)


def test_chat_without_a_conversation_creates_one_and_streams_the_run_to_done(alice: Api) -> None:
    before = {c["id"] for c in alice.snapshot()["conversations"]}

    events = chat(alice, {"message": "What is 12*12?"})

    assert events[-1].event == "done"
    done = events[-1].data
    assert done["status"] == "completed"
    assert "144" in done["answer"]
    run = alice.get_run(done["run_id"])
    assert run["status"] == "completed"
    assert run["conversation_id"] not in before
    conversation = alice.conversation(run["conversation_id"])
    assert conversation["messages"][0]["content"] == "What is 12*12?"
    assert conversation["title"]
    assert [e.id for e in events] == [e["id"] for e in alice.run_events(done["run_id"])]


def test_chat_in_an_existing_conversation_continues_it(alice: Api) -> None:
    conv = alice.create_conversation({"title": "maths"})
    first = alice.run(conv["id"], "What is 2+2?")

    events = chat(alice, {"message": "What is 3+3?", "conversation_id": conv["id"]})

    done = events[-1].data
    assert done["status"] == "completed"
    assert events[0].data["run_id"] == done["run_id"] != first.run_id
    assert all(e.data["run_id"] == done["run_id"] for e in events)  # nothing of the first run
    assert alice.get_run(done["run_id"])["conversation_id"] == conv["id"]
    users = [m["content"] for m in alice.conversation(conv["id"])["messages"] if m["role"] == "user"]
    assert users == ["What is 2+2?", "What is 3+3?"]


def test_chat_in_another_owners_or_an_unknown_conversation_is_404(alice: Api, bob: Api) -> None:
    conv = alice.create_conversation()
    before = alice.snapshot()

    for conversation_id in (conv["id"], "conv_does_not_exist"):
        response = bob.http.post("/api/chat", json={"message": "hi", "conversation_id": conversation_id})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
    assert alice.snapshot() == before


def test_chat_in_a_conversation_with_an_active_run_is_409(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    release = threading.Event()
    fake_llm.script(FakeReply.blocked(release, FakeReply.text("first")))
    fake_llm.set_handler(EchoAgentBehaviour())
    api = service(llm=fake_llm).api()
    conv = api.create_conversation()
    api.start_run(conv["id"], "first")
    fake_llm.wait_for_requests(1)

    try:
        response = api.http.post("/api/chat", json={"message": "second", "conversation_id": conv["id"]})
    finally:
        release.set()

    assert response.status_code == 409
    assert response.json()["error"]["code"] == "run_active"
    assert api.stream(conv["id"])[-1].data["status"] == "completed"


def test_chat_titles_the_new_conversation_with_the_first_line_that_has_text(alice: Api) -> None:
    events = chat(alice, {"message": "\n   \n\tWhat\x01 is 5+5?  \nShow the steps."})

    conversation = alice.conversation(alice.get_run(events[-1].data["run_id"])["conversation_id"])

    assert conversation["title"] == "What is 5+5?"
