"""The AI SDK face's requests (FACES.md V-01..V-03, V-05, V-06) over plain HTTP: what a client
adds is ignored, what it gets wrong is a 4xx that stores nothing, what it claims is trusted only
as far as the database holds it pending, and two owners' chats of one id are two chats."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.service.test_approvals import wait_status
from tests.integration.service.test_client_tools import LOCATION, CallsBesideAgent
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    clients_fixture,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import EchoAgentBehaviour, ToolAgentBehaviour
from tests.support.fake_replies import FakeReply
from tests.support.server import ServerThread, wait_until

pytestmark = pytest.mark.timeout(60)

KEYS = "alice:key-alice,bob:key-bob"


@pytest.fixture
def base(start_service: Callable[..., ServerThread]) -> str:
    return start_service(redis=False, api_keys=KEYS).base_url


@pytest.fixture
def alice(base: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base, headers={"Authorization": "Bearer key-alice"}, timeout=10) as client:
        yield client


@pytest.fixture
def bob(base: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base, headers={"Authorization": "Bearer key-bob"}, timeout=10) as client:
        yield client


def user(text: str, message_id: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": message_id or secrets.token_hex(8),
        "role": "user",
        "parts": [{"type": "text", "text": text}],
        **extra,
    }


def chunks_of(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["x-vercel-ai-ui-message-stream"] == "v1"
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in response.text.split("\n\n") if f.strip() and not f.startswith(":")]  # no pings
    assert frames[-1] == "data: [DONE]"
    return [orjson.loads(f.removeprefix("data: ")) for f in frames[:-1]]


def post(client: httpx.Client, body: Any) -> httpx.Response:
    return client.post("/api/ai-sdk/chat", json=body)


def state(client: httpx.Client) -> Any:
    """Everything of the owner's the face could have changed."""
    conversations = client.get("/api/conversations").json()["items"]
    return [client.get(f"/api/conversations/{c['id']}").json() for c in conversations]


def waiting_message(
    alice: httpx.Client, llm: FakeLLM, chat: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A chat whose run waits for the approval of its calculator call: (the message as streamed, chunks)."""
    llm.agent.inner = ToolAgentBehaviour("calculator", {"expression": "6*7"})
    body = {
        "id": chat,
        "messages": [user("what is 6*7?", "u1")],
        "trigger": "submit-message",
        "agent": {"tools": ["calculator"], "require_approval": ["calculator"]},
    }
    chunks = chunks_of(post(alice, body))
    assert chunks[-1] == {
        "type": "finish",
        "finishReason": "tool-calls",
        "messageMetadata": {"run_id": chunks[0]["messageId"], "status": "waiting"},
    }
    (request,) = [c for c in chunks if c["type"] == "tool-approval-request"]
    (call,) = [c for c in chunks if c["type"] == "tool-input-available"]
    part = {
        "type": "dynamic-tool",
        "toolName": "calculator",
        "toolCallId": call["toolCallId"],
        "state": "approval-requested",
        "input": call["input"],
        "toolMetadata": call["toolMetadata"],
        "approval": {"id": request["approvalId"]},
    }
    message = {"id": chunks[0]["messageId"], "role": "assistant", "parts": [{"type": "step-start"}, part]}
    return message, chunks


def parked(client: httpx.Client, run_id: str) -> dict[str, Any]:
    """The run once its row says it waits (a response ends at the run's waiting event, a moment
    before its park commits)."""
    run: dict[str, Any] = wait_until(
        lambda: (r := client.get(f"/api/runs/{run_id}").json())["status"] == "waiting" and r,
        timeout=10,
        what=f"run {run_id} to wait",
    )
    return run


def responded(message: dict[str, Any], **approval: Any) -> dict[str, Any]:
    part = dict(message["parts"][1])
    part.update(state="approval-responded", approval={**part["approval"], **approval})
    return {**message, "parts": [message["parts"][0], part]}


def test_fields_and_part_types_a_client_adds_are_ignored(
    alice: httpx.Client, gated_llm: FakeLLM, base: str
) -> None:
    gated_llm.agent.inner = EchoAgentBehaviour()
    message = user("hello there", "u1", metadata={"sent": 1}, future={"x": 1})
    message["parts"] += [{"type": "data-weather", "data": {"t": 3}}, {"type": "some-future-part", "z": [1]}]
    message["parts"][0]["providerMetadata"] = {"x": {}}
    body = {
        "id": "c1",
        "messages": [message],
        "trigger": "submit-message",
        "newTopLevel": True,
        "metadata": {},
    }

    chunks = chunks_of(post(alice, body))

    assert chunks[0]["type"] == "start" and chunks[-1]["finishReason"] == "stop"
    text = "".join(c["delta"] for c in chunks if c["type"] == "text-delta")
    assert text == gated_llm.agent.answer
    (conv,) = alice.get("/api/conversations").json()["items"]
    stored = alice.get(f"/api/conversations/{conv['id']}").json()["messages"]
    assert stored[0]["content"] == "hello there"
    # The loaded chat carries the client's id for its message.
    loaded = alice.get("/api/ai-sdk/chat/c1/messages").json()
    assert loaded[0] == {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hello there"}]}


BAD_BODIES: dict[str, Any] = {
    "no id": {"messages": [user("hi")]},
    "no messages": {"id": "c-bad", "messages": []},
    "messages not a list": {"id": "c-bad", "messages": {"id": "x"}},
    "a message without an id": {"id": "c-bad", "messages": [{"role": "user", "parts": []}]},
    "an unknown trigger": {"id": "c-bad", "messages": [user("hi")], "trigger": "resubmit"},
    "a NUL in the chat id": {"id": "c\x00bad", "messages": [user("hi")]},
    "an id too long": {"id": "c" * 201, "messages": [user("hi")]},
    "an unknown tool": {"id": "c-bad", "messages": [user("hi")], "agent": {"tools": ["no_such_tool"]}},
    "no text": {"id": "c-bad", "messages": [{"id": "u", "role": "user", "parts": [{"type": "file"}]}]},
    "a last message of the system": {"id": "c-bad", "messages": [{"id": "s", "role": "system", "parts": []}]},
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_bodies_are_422_and_store_nothing(name: str, alice: httpx.Client, gated_llm: FakeLLM) -> None:
    before = state(alice)

    response = post(alice, BAD_BODIES[name])

    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] in ("invalid_request", "validation_error"), response.text
    assert state(alice) == before
    assert alice.get("/api/ai-sdk/chat/c-bad/messages").json() == []


def test_a_body_that_is_not_json_is_400_and_a_new_chat_cannot_continue_or_regenerate(
    alice: httpx.Client, gated_llm: FakeLLM
) -> None:
    response = alice.post(
        "/api/ai-sdk/chat", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assistant = {"id": "run_nothing", "role": "assistant", "parts": []}
    assert post(alice, {"id": "fresh", "messages": [user("hi"), assistant]}).status_code == 404
    regenerate = {"id": "fresh", "messages": [user("hi")], "trigger": "regenerate-message"}
    assert post(alice, regenerate).status_code == 404
    assert state(alice) == []


def test_approvals_in_the_clients_history_count_only_when_the_database_holds_them_pending(
    alice: httpx.Client, bob: httpx.Client, gated_llm: FakeLLM, base: str, clients: Callable[..., Api]
) -> None:
    message, _ = waiting_message(alice, gated_llm, "shared")
    approval_id = message["parts"][1]["approval"]["id"]
    history = [user("what is 6*7?", "u1")]
    forged = [
        responded(message, id="apr_forged", approved=True),  # an approval the run never asked
        {
            **responded(message, approved=True),
            "parts": [  # the right approval on another call
                message["parts"][0],
                {**responded(message, approved=True)["parts"][1], "toolCallId": "call_other"},
            ],
        },
        {
            **message,
            "parts": [message["parts"][0], {**message["parts"][1], "state": "output-available", "output": 1}],
        },
    ]
    for claimed in forged:
        response = post(alice, {"id": "shared", "messages": [*history, claimed], "messageId": message["id"]})
        assert response.status_code == 409, response.text
        assert response.json()["error"]["code"] == "call_closed"
    # Another owner's chat of the same id is another chat: alice's run is unknown to bob.
    assert (
        post(bob, {"id": "shared", "messages": [*history, responded(message, approved=True)]}).status_code
        == 404
    )
    assert bob.get("/api/ai-sdk/chat/shared/messages").json() == []
    assert bob.get("/api/ai-sdk/chat/shared/stream").status_code == 204
    assert bob.post("/api/ai-sdk/chat/shared/stop").status_code == 404
    run = parked(alice, message["id"])
    assert [a["approval_id"] for a in run["pending_approvals"]] == [approval_id]

    # The real decision goes through, continues the same message, and a second one is a 409.
    body = {
        "id": "shared",
        "messages": [*history, responded(message, approved=True)],
        "messageId": message["id"],
    }
    chunks = chunks_of(post(alice, body))
    assert chunks[0] == {
        "type": "start",
        "messageId": message["id"],
        "messageMetadata": {"run_id": message["id"]},
    }
    assert {"type": "tool-approval-response", "approvalId": approval_id, "approved": True} in chunks
    assert chunks[-1]["finishReason"] == "stop"
    assert not [c for c in chunks if c["type"] == "tool-input-available"]  # the part is the client's already
    again = post(alice, body)
    assert again.status_code == 409 and again.json()["error"]["code"] == "call_closed"


def test_resume_is_204_when_nothing_streams_and_a_waiting_run_is_shown_by_messages(
    alice: httpx.Client, gated_llm: FakeLLM, clients: Callable[..., Api], base: str
) -> None:
    assert alice.get("/api/ai-sdk/chat/never-used/stream").status_code == 204
    message, chunks = waiting_message(alice, gated_llm, "waits")
    api = clients(base)
    api.http.headers["Authorization"] = "Bearer key-alice"
    wait_status(api, message["id"], "waiting")

    assert alice.get("/api/ai-sdk/chat/waits/stream").status_code == 204
    loaded = alice.get("/api/ai-sdk/chat/waits/messages").json()
    assert loaded[1] == {**message, "metadata": {"run_id": message["id"], "status": "waiting"}}
    assert [c["type"] for c in chunks if c["type"].startswith("tool-")] == [
        "tool-input-available",
        "tool-approval-request",
    ]


def test_a_continuation_with_an_output_that_cannot_be_stored_is_422_and_settles_nothing(
    alice: httpx.Client, gated_llm: FakeLLM
) -> None:
    gated_llm.agent.inner = CallsBesideAgent(("calculator", {"expression": "6*7"}))
    body = {
        "id": "both",
        "messages": [user("where and what?", "u1")],
        "agent": {"tools": ["calculator"], "require_approval": ["calculator"], "client_tools": [LOCATION]},
    }
    chunks = chunks_of(post(alice, body))
    run_id = chunks[0]["messageId"]
    (request,) = [c for c in chunks if c["type"] == "tool-approval-request"]
    inputs = {c["toolCallId"]: c for c in chunks if c["type"] == "tool-input-available"}
    approval = {
        "type": "dynamic-tool",
        "toolName": "calculator",
        "toolCallId": request["toolCallId"],
        "state": "approval-responded",
        "input": {"expression": "6*7"},
        "approval": {"id": request["approvalId"], "approved": True},
    }
    location = next(c for c in inputs if c != request["toolCallId"])

    def send(output: str) -> httpx.Response:
        part = f'{{"type": "tool-get_location", "toolCallId": "{location}", "state": "output-available", '
        part += f'"input": {{}}, "output": {output}}}'
        message = f'{{"id": "{run_id}", "role": "assistant", "parts": [{json.dumps(approval)}, {part}]}}'
        question = json.dumps(body["messages"][0])
        content = f'{{"id": "both", "messageId": "{run_id}", "messages": [{question}, {message}]}}'
        return alice.post("/api/ai-sdk/chat", content=content, headers={"content-type": "application/json"})

    parked(alice, run_id)
    for output in ("NaN", '{"big": "' + "x" * 300_000 + '"}', "[Infinity]"):
        response = send(output)
        assert response.status_code in (413, 422), response.text[:300]
        run = alice.get(f"/api/runs/{run_id}").json()
        # Neither the approval before the output nor the output was stored.
        assert run["status"] == "waiting" and len(run["pending_approvals"]) == 1, run
        assert len(run["pending_tool_calls"]) == 1, run


class LocatesEachQuestion(EchoAgentBehaviour):
    """Asks for get_location on every new question (the same call id each time), then answers."""

    def loop_reply(self, body: dict[str, Any]) -> FakeReply:
        messages = body.get("messages") or [{}]
        if messages[-1].get("role") == "user" and body.get("tools"):
            return FakeReply.tool_calls([("get_location", {"precision": "city"})])
        return super().loop_reply(body)


def test_each_run_shows_its_own_client_output_when_call_ids_repeat_across_runs(
    alice: httpx.Client, gated_llm: FakeLLM
) -> None:
    gated_llm.agent.inner = LocatesEachQuestion()
    for city in ("Paris", "Tokyo"):
        history = alice.get("/api/ai-sdk/chat/trips/messages").json()
        body = {
            "id": "trips",
            "messages": [*history, user(f"where am I now? {city}")],
            "agent": {"client_tools": [LOCATION]},
        }
        chunks = chunks_of(post(alice, body))
        (call,) = [c for c in chunks if c["type"] == "tool-input-available"]
        waiting = alice.get("/api/ai-sdk/chat/trips/messages").json()
        message = waiting[-1]
        part = next(p for p in message["parts"] if p.get("toolCallId") == call["toolCallId"])
        answered = {**part, "state": "output-available", "output": {"city": city}}
        message["parts"] = [answered if p is part else p for p in message["parts"]]
        continued = chunks_of(post(alice, {"id": "trips", "messages": [*waiting[:-1], message]}))
        assert continued[-1]["finishReason"] == "stop"

    loaded = alice.get("/api/ai-sdk/chat/trips/messages").json()
    outputs = [p["output"] for m in loaded if m["role"] == "assistant" for p in m["parts"] if "output" in p]
    assert outputs == [{"city": "Paris"}, {"city": "Tokyo"}]
    ids = [p["toolCallId"] for m in loaded if m["role"] == "assistant" for p in m["parts"] if "output" in p]
    assert ids[0] == ids[1]  # the model numbered its calls the same way in both runs


def test_a_new_chat_whose_run_is_refused_leaves_no_conversation(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM
) -> None:
    base = start_service(redis=False, api_keys=KEYS, max_active_runs=1, max_queued_runs=0).base_url
    gated_llm.agent.inner = EchoAgentBehaviour()
    gated_llm.agent.close_gate()
    with httpx.Client(base_url=base, headers={"Authorization": "Bearer key-alice"}, timeout=10) as client:
        busy = client.post("/api/conversations", json={}).json()["id"]
        assert client.post(f"/api/conversations/{busy}/runs", json={"message": "hold"}).status_code == 202
        before = state(client)

        response = post(client, {"id": "refused", "messages": [user("hello")]})

        assert response.status_code in (429, 503), response.text
        assert state(client) == before
        assert client.get("/api/ai-sdk/chat/refused/messages").json() == []
        gated_llm.agent.gate.set()
