"""Tools the client runs (FACES.md C-01..C-03), through the real service: the fake model over a
socket, SQLite and PostgreSQL, the in-process bus and Redis, a real HTTP client.

A conversation declares ``agent.client_tools``; the model is offered them; a call of one is
published (``step`` iteration start with ``client: true`` and its ``call_id``), parks the run
``waiting`` with the call in ``pending_tool_calls``, and the client's result, posted through any
worker, carries the run on with the result as the call's observation. No result in time, cancel,
a client call beside an approval, bad bodies and other owners are covered too.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from app.engine import prompts
from tests.integration.service.test_approvals import decide, observation, play, wait_done, wait_status
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    as_stored,
    clients_fixture,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import EchoAgentBehaviour, ToolAgentBehaviour, _has_tool_result
from tests.support.fake_replies import FakeReply
from tests.support.server import ServerThread, wait_until

pytestmark = pytest.mark.timeout(60)

BUSES = [pytest.param(False, id="memory"), pytest.param(True, id="redis", marks=pytest.mark.redis)]

LOCATION = {
    "name": "get_location",
    "description": "Where the user is, as the browser knows it.",
    "parameters": {
        "type": "object",
        "properties": {"precision": {"type": "string", "enum": ["city", "street"]}},
        "required": ["precision"],
    },
}
ARGS = {"precision": "city"}
CALL_ID = "call_0_get_location"
"""The id the fake model gives the first call of a reply, when it is get_location."""


class CallsBesideAgent(EchoAgentBehaviour):
    """Asks for ``first`` and then get_location in one reply, then answers."""

    def __init__(self, first: tuple[str, dict[str, Any]]) -> None:
        super().__init__()
        self.first = first

    def loop_reply(self, body: dict[str, Any]) -> FakeReply:
        if _has_tool_result(body) or not body.get("tools"):
            return super().loop_reply(body)
        return FakeReply.tool_calls([self.first, ("get_location", ARGS)])


def locating(
    api: Api, llm: FakeLLM, *, behaviour: EchoAgentBehaviour | None = None, **agent: Any
) -> tuple[str, str, dict[str, Any]]:
    """A run that called get_location (alone, or as ``behaviour`` has it), waiting for its result:
    (conv, run, its run record)."""
    play(llm, behaviour or ToolAgentBehaviour("get_location", ARGS))
    conv = api.create_conversation(client_tools=[LOCATION], **agent)
    run_id = api.start_run(conv, "where am I?")
    return conv, run_id, wait_status(api, run_id, "waiting")


def post_result(api: Api, conv: str, call_id: str, body: Any) -> httpx.Response:
    return api.http.post(f"/api/conversations/{conv}/tool-results/{call_id}", json=body)


def client_steps(events: list[dict[str, Any]], status: str) -> list[dict[str, Any]]:
    return [
        e["data"]
        for e in events
        if e["event"] == "step"
        and e["data"].get("type") == "iteration"
        and e["data"]["status"] == status
        and e["data"]["tool_name"] == "get_location"
    ]


def tool_messages_sent(llm: FakeLLM, call_id: str) -> list[str]:
    """What the model was sent, in any request, as the tool message of ``call_id``."""
    return [
        str(m.get("content"))
        for body in list(llm.agent.requests)
        for m in body.get("messages", ())
        if m.get("role") == "tool" and m.get("tool_call_id") == call_id
    ]


def loop_requests_after_tool_results(llm: FakeLLM) -> int:
    return sum(1 for body in list(llm.agent.requests) if not body.get("stream") and _has_tool_result(body))


def refused(response: httpx.Response, status: int, code: str) -> bool:
    return response.status_code == status and response.json()["error"]["code"] == code


def seconds_from_now(stamp: str) -> float:
    return (datetime.fromisoformat(stamp) - datetime.now(UTC)).total_seconds()


@pytest.mark.parametrize("redis_bus", BUSES)
def test_a_client_tool_call_parks_the_run_and_its_result_carries_it_on_as_the_observation(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
) -> None:
    api = clients(start_service(redis=redis_bus).base_url)
    conv, run_id, run = locating(api, gated_llm)

    (pending,) = run["pending_tool_calls"]
    assert (pending["call_id"], pending["tool_name"], pending["tool_args"]) == (CALL_ID, "get_location", ARGS)
    assert 3500 < seconds_from_now(pending["expires_at"]) <= 3600  # CLIENT_TOOL_TIMEOUT_S's default
    assert run["pending_approvals"] == []
    detail = api.http.get(f"/api/conversations/{conv}").json()
    assert detail["pending_tool_calls"] == [pending] and detail["pending_approvals"] == []
    assert detail["active_run_id"] == run_id
    # A call of the client's tool is nobody's approval: the approvals inbox does not list it.
    assert api.http.get("/api/approvals", params={"status": "pending"}).json()["items"] == []
    # The model was offered the client's tool beside the server's, with its schema.
    first_ask = next(b for b in gated_llm.agent.requests if b.get("tools"))
    offered = {t["function"]["name"]: t["function"] for t in first_ask["tools"]}
    assert "calculator" in offered
    assert offered["get_location"]["parameters"] == LOCATION["parameters"]
    assert offered["get_location"]["description"] == LOCATION["description"]

    with api.stream(conv) as stream:
        seen = stream.read(until=lambda e: e.event == "step" and e.data.get("client") is True)
        (start,) = [e.data for e in seen if e.event == "step" and e.data.get("tool_name") == "get_location"]
        assert start == {
            "type": "iteration",
            "status": "start",
            "iteration": 1,
            "tool_name": "get_location",
            "tool_args": ARGS,
            "call_id": CALL_ID,
            "client": True,
            "expires_at": pending["expires_at"],
            "run_id": run_id,
        }
        assert not [e for e in seen if e.event == "done"]

        answered = post_result(api, conv, CALL_ID, {"output": {"city": "Paris", "lat": 48.85}})

        assert answered.status_code == 200, answered.text
        assert answered.json() == {"call_id": CALL_ID, "status": "answered", "run_id": run_id}
        seen += stream.read(until=lambda e: e.event == "done")

    sent = '{"city":"Paris","lat":48.85}'
    (done,) = client_steps(as_stored(seen), "done")
    assert (done["call_id"], done["client"], done["observation"], done["error"]) == (
        CALL_ID,
        True,
        sent,
        None,
    )
    assert seen[-1].data["status"] == "completed"
    assert tool_messages_sent(gated_llm, CALL_ID) == [sent]
    finished = wait_done(api, run_id)
    assert finished["status"] == "completed" and finished["pending_tool_calls"] == []
    assert api.http.get(f"/api/conversations/{conv}").json()["pending_tool_calls"] == []
    messages = api.http.get(f"/api/conversations/{conv}").json()["messages"]
    assert [(m["role"], m["content"]) for m in messages if m["role"] == "tool"] == [("tool", sent)]


@pytest.mark.redis
def test_a_result_posted_through_another_worker_carries_on_the_run_whose_server_call_ran_first(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    a, b = start_service(redis=True), start_service(redis=True)
    api_a, api_b = clients(a.base_url), clients(b.base_url)
    beside = CallsBesideAgent(("word_count", {"text": "one two three"}))
    conv, run_id, run = locating(api_a, gated_llm, behaviour=beside)
    call_id = "call_1_get_location"

    # word_count (a server tool) ran while get_location waits; its result is kept.
    before = api_a.events(run_id)
    assert observation(before, "word_count").startswith("words: 3,")
    assert [s["call_id"] for s in client_steps(before, "start")] == [call_id]
    assert client_steps(before, "done") == []
    assert [c["call_id"] for c in run["pending_tool_calls"]] == [call_id]

    with api_a.stream(conv) as stream:
        stream.read(until=lambda e: e.event == "step" and e.data.get("client") is True)
        answered = post_result(api_b, conv, call_id, {"output": "Paris, France"})
        assert answered.status_code == 200, answered.text
        seen = stream.read(until=lambda e: e.event == "done")

    assert seen[-1].data["status"] == "completed"
    (done,) = client_steps(as_stored(seen), "done")
    assert (done["tool_name"], done["call_id"], done["observation"]) == (
        "get_location",
        call_id,
        "Paris, France",
    )
    assert wait_done(api_b, run_id)["status"] == "completed"
    events = api_b.wait_stored(run_id)
    # The server call ran once: its result was kept, not made again.
    word_counts = [e for e in events if e["event"] == "step" and e["data"].get("tool_name") == "word_count"]
    assert [e["data"]["status"] for e in word_counts] == ["start", "done"]
    assert tool_messages_sent(gated_llm, call_id) == ["Paris, France"]
    messages = api_b.http.get(f"/api/conversations/{conv}").json()["messages"]
    i = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
    assert [c["function"]["name"] for c in messages[i]["tool_calls"]] == ["word_count", "get_location"]
    follow = messages[i + 1 : i + 3]
    assert [m["tool_call_id"] for m in follow] == [c["id"] for c in messages[i]["tool_calls"]]
    assert follow[1]["content"] == "Paris, France"


def test_an_error_result_reaches_the_model_as_the_calls_error(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False).base_url)
    conv, run_id, _ = locating(api, gated_llm)

    answered = post_result(api, conv, CALL_ID, {"error": "the user did not allow location access"})

    assert answered.status_code == 200, answered.text
    assert wait_done(api, run_id)["status"] == "completed"
    (done,) = client_steps(api.wait_stored(run_id), "done")
    told = "Error: the user did not allow location access"
    assert (done["observation"], done["error"]) == (told, "the user did not allow location access")
    assert done["client"] is True and done["call_id"] == CALL_ID
    assert tool_messages_sent(gated_llm, CALL_ID) == [told]


def test_no_result_in_time_tells_the_model_and_a_late_result_is_call_closed(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False, client_tool_timeout_s=1.0).base_url)
    play(gated_llm, ToolAgentBehaviour("get_location", ARGS))
    conv = api.create_conversation(client_tools=[LOCATION])
    run_id = api.start_run(conv, "where am I?")
    created_at = api.run(run_id)["created_at"]

    # Nobody answers: the claim loop expires the call, and the run goes on without it.
    assert wait_done(api, run_id)["status"] == "completed"
    events = api.wait_stored(run_id)
    (start,) = client_steps(events, "start")
    assert start["call_id"] == CALL_ID and start["client"] is True
    asked_for = datetime.fromisoformat(start["expires_at"]) - datetime.fromisoformat(created_at)
    assert 1.0 <= asked_for.total_seconds() < 10.0  # CLIENT_TOOL_TIMEOUT_S after the call
    (done,) = client_steps(events, "done")
    told = prompts.client_call_expired("get_location")
    assert (done["call_id"], done["client"], done["observation"], done["error"]) == (
        CALL_ID,
        True,
        told,
        told,
    )
    assert tool_messages_sent(gated_llm, CALL_ID) == [told]
    assert api.run(run_id)["pending_tool_calls"] == []

    late = post_result(api, conv, CALL_ID, {"output": "Paris"})

    assert refused(late, 409, "call_closed"), late.text
    assert client_steps(api.events(run_id), "done") == [done]


@pytest.mark.parametrize("redis_bus", BUSES)
def test_cancel_while_a_client_call_waits_ends_the_run_and_closes_the_call(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
) -> None:
    api = clients(start_service(redis=redis_bus).base_url)
    conv, run_id, _ = locating(api, gated_llm)

    assert api.cancel(conv).status_code == 202

    finished = wait_done(api, run_id)
    assert finished["status"] == "cancelled" and finished["pending_tool_calls"] == []
    events = api.wait_stored(run_id)
    assert (events[-1]["event"], events[-1]["data"]["status"]) == ("done", "cancelled")
    assert api.http.get(f"/api/conversations/{conv}").json()["pending_tool_calls"] == []

    late = post_result(api, conv, CALL_ID, {"output": "Paris"})

    assert refused(late, 409, "call_closed"), late.text
    assert api.run(run_id)["status"] == "cancelled"
    assert client_steps(api.events(run_id), "done") == []
    assert tool_messages_sent(gated_llm, CALL_ID) == []


@pytest.mark.parametrize("result_first", [True, False], ids=["result-first", "approval-first"])
def test_a_client_call_and_an_approval_of_one_reply_wait_together_until_both_are_settled(
    result_first: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
) -> None:
    api = clients(start_service(redis=False).base_url)
    beside = CallsBesideAgent(("calculator", {"expression": "6*7"}))
    conv, run_id, run = locating(api, gated_llm, behaviour=beside, require_approval=["calculator"])
    call_id = "call_1_get_location"

    (approval,) = run["pending_approvals"]
    (call,) = run["pending_tool_calls"]
    assert (approval["tool_name"], approval["call_id"]) == ("calculator", "call_0_calculator")
    assert (call["tool_name"], call["call_id"]) == ("get_location", call_id)
    # An approval's call takes no tool result: it is no call of a tool the client runs.
    assert refused(post_result(api, conv, "call_0_calculator", {"output": 1}), 404, "not_found")

    def settle_call() -> None:
        response = post_result(api, conv, call_id, {"output": "Paris"})
        assert response.status_code == 200, response.text

    def settle_approval() -> None:
        response = decide(api, conv, approval["approval_id"], decision="approve")
        assert response.status_code == 200, response.text

    first, second = (settle_call, settle_approval) if result_first else (settle_approval, settle_call)
    first()

    halfway = api.run(run_id)
    assert halfway["status"] == "waiting"
    if result_first:
        assert (halfway["pending_tool_calls"], halfway["pending_approvals"]) == ([], [approval])
    else:
        assert (halfway["pending_tool_calls"], halfway["pending_approvals"]) == ([call], [])
    assert loop_requests_after_tool_results(gated_llm) == 0

    second()

    assert wait_done(api, run_id)["status"] == "completed"
    events = api.wait_stored(run_id)
    assert observation(events, "calculator") == "6*7 = 42"
    assert observation(events, "get_location") == "Paris"
    # Once, when it stopped: the run waits for both, and names them.
    (waiting,) = [e["data"] for e in events if e["event"] == "phase" and e["data"]["phase"] == "waiting"]
    assert (waiting["approval_ids"], waiting["call_ids"]) == ([approval["approval_id"]], [call_id])
    # The model was asked again once, with both results after its reply, in call order.
    assert loop_requests_after_tool_results(gated_llm) == 1
    (body,) = [b for b in gated_llm.agent.requests if not b.get("stream") and _has_tool_result(b)]
    tools = [(m["tool_call_id"], m["content"]) for m in body["messages"] if m.get("role") == "tool"]
    assert tools == [("call_0_calculator", "6*7 = 42"), (call_id, "Paris")]


def test_bad_result_bodies_are_refused_and_leave_the_call_pending(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False).base_url)
    conv, run_id, run = locating(api, gated_llm)
    (pending,) = run["pending_tool_calls"]
    path = f"/api/conversations/{conv}/tool-results/{CALL_ID}"

    bad_bodies: list[Any] = [
        {"output": "Paris", "error": "no"},  # both
        {},  # neither
        {"error": 5},  # an error that is no string
        {"error": None},
        {"error": ""},
        {"error": ["no"]},
        {"output": "Paris", "extra": True},  # an unknown field
        {"result": "Paris"},
        ["Paris"],  # no object
        "Paris",
        {"output": "x" * (256 * 1024 + 1)},  # too large
    ]
    for body in bad_bodies:
        response = post_result(api, conv, CALL_ID, body)
        assert refused(response, 422, "invalid_request"), (str(body)[:80], response.text)
    # Not JSON at all: the service's answer to any body it cannot decode (README: 400 invalid_json).
    for raw in (b"Paris", b'{"output": "Paris"', b"{'output': 'Paris'}"):
        response = api.http.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert refused(response, 400, "invalid_json"), (raw, response.text)
    as_form = api.http.post(path, data={"output": "Paris"})
    assert refused(as_form, 422, "invalid_request"), as_form.text
    for raw in (b'{"output": NaN}', b'{"output": {"lat": Infinity}}'):  # no JSON: PostgreSQL refuses them
        response = api.http.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert refused(response, 422, "invalid_request"), (raw, response.text)

    # Nothing changed: the call still waits, and can then be answered (null is JSON too).
    still = api.run(run_id)
    assert still["status"] == "waiting" and still["pending_tool_calls"] == [pending]
    assert client_steps(api.events(run_id), "done") == []
    answered = post_result(api, conv, CALL_ID, {"output": None})
    assert answered.status_code == 200, answered.text
    assert wait_done(api, run_id)["status"] == "completed"
    assert tool_messages_sent(gated_llm, CALL_ID) == ["null"]


def test_only_the_owner_posts_a_result_once_and_unknown_calls_are_not_found(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM
) -> None:
    server = start_service(redis=False, api_keys="alice:key-alice,bob:key-bob")
    play(gated_llm, ToolAgentBehaviour("get_location", ARGS))
    with (
        httpx.Client(base_url=server.base_url, headers={"Authorization": "Bearer key-alice"}) as alice,
        httpx.Client(base_url=server.base_url, headers={"Authorization": "Bearer key-bob"}) as bob,
    ):
        created = alice.post("/api/conversations", json={"agent": {"client_tools": [LOCATION]}})
        assert created.status_code == 201, created.text
        conv = created.json()["id"]
        run_id = alice.post(f"/api/conversations/{conv}/runs", json={"message": "where?"}).json()["run_id"]
        wait_until(
            lambda: alice.get(f"/api/runs/{run_id}").json()["status"] == "waiting",
            timeout=15,
            interval=0.05,
            what="the run to wait",
        )
        bobs = bob.post("/api/conversations", json={"agent": {"client_tools": [LOCATION]}}).json()["id"]

        def post(client: httpx.Client, conversation: str, call_id: str) -> httpx.Response:
            url = f"/api/conversations/{conversation}/tool-results/{call_id}"
            return client.post(url, json={"output": "Paris"})

        assert refused(post(bob, conv, CALL_ID), 404, "not_found")
        assert refused(post(bob, bobs, CALL_ID), 404, "not_found")
        assert bob.get(f"/api/runs/{run_id}").status_code == 404
        for unknown in ("call_9_get_location", CALL_ID.upper(), "x" * 300, "%00", "%ff", "call%0a"):
            assert refused(post(alice, conv, unknown), 404, "not_found"), unknown
        assert alice.get(f"/api/runs/{run_id}").json()["pending_tool_calls"][0]["call_id"] == CALL_ID

        first = post(alice, conv, CALL_ID)
        second = post(alice, conv, CALL_ID)

        assert first.status_code == 200, first.text
        assert refused(second, 409, "call_closed"), second.text
        done = wait_until(
            lambda: (r := alice.get(f"/api/runs/{run_id}").json())["status"] == "completed" and r,
            timeout=15,
            interval=0.05,
            what="the run to end",
        )
        assert done["pending_tool_calls"] == []
    assert tool_messages_sent(gated_llm, CALL_ID) == ["Paris"]


def test_conversations_declare_client_tools_and_unusable_ones_are_refused(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False).base_url)
    other = {"name": "pick_file", "description": "The user picks a file.", "parameters": {"type": "object"}}

    good = api.http.post("/api/conversations", json={"agent": {"client_tools": [LOCATION, other]}})

    assert good.status_code == 201, good.text
    assert [t["name"] for t in good.json()["agent"]["client_tools"]] == ["get_location", "pick_file"]

    def with_parameters(parameters: Any) -> dict[str, Any]:
        return {**LOCATION, "parameters": parameters}

    bad: dict[str, list[dict[str, Any]]] = {
        "a server tool's name": [{**LOCATION, "name": "calculator"}],
        "declared twice": [LOCATION, {**other, "name": "get_location"}],
        "a type that is none": [with_parameters({"type": "object", "properties": {"x": {"type": "nope"}}})],
        "required not a list": [with_parameters({"type": "object", "required": "precision"})],
        "a pattern that is no regex": [
            with_parameters({"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}})
        ],
        "an array": [with_parameters({"type": "array", "items": {"type": "string"}})],
        "a string": [with_parameters({"type": "string"})],
        "parameters no object": [with_parameters(["precision"])],
        "a name with spaces": [{**LOCATION, "name": "get location"}],
        "no name": [{"description": "nameless", "parameters": {"type": "object"}}],
        "an unknown field": [{**LOCATION, "handler": "window.locate"}],
        # Nothing a client declares makes the service fetch a URL or read a file (a validator
        # resolving these would, blocking the worker): references within the schema only.
        "a $ref to a URL": [with_parameters({"type": "object", "$ref": f"{api.http.base_url}/healthz"})],
        "a $ref to a file": [
            with_parameters({"type": "object", "properties": {"x": {"$ref": "file:///etc/hostname"}}})
        ],
        "a $dynamicRef to a URL": [with_parameters({"type": "object", "$dynamicRef": "http://127.0.0.1:9/x"})],
    }
    for what, tools in bad.items():
        response = api.http.post("/api/conversations", json={"agent": {"client_tools": tools}})
        assert refused(response, 422, "invalid_request"), (what, response.text)
    # NaN is no JSON (PostgreSQL refuses it); Python's parser would take it.
    nan = b'{"agent": {"client_tools": [{"name": "n", "parameters": {"type": "object", "maximum": NaN}}]}}'
    response = api.http.post("/api/conversations", content=nan, headers={"Content-Type": "application/json"})
    assert refused(response, 422, "invalid_request"), response.text
    local = with_parameters(
        {"type": "object", "$defs": {"p": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/p"}}}
    )
    assert api.http.post("/api/conversations", json={"agent": {"client_tools": [local]}}).status_code == 201
    listed = api.http.get("/api/conversations").json()["items"]
    assert len(listed) == 2 and listed[-1]["id"] == good.json()["id"]
