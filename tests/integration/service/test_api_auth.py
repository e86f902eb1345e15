"""API keys, single-user mode, and owner isolation: another owner's things are 404 on every route."""

from __future__ import annotations

import threading
from typing import Any

import httpx

from tests.integration.service.conftest import (
    ALICE_KEY,
    BOB_KEY,
    KEYS,
    Api,
    LogRecorder,
    Service,
    ServiceFactory,
)
from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer, FakeReply
from tests.support.sse import read_events

# Every route under /api, with a body that would be valid for it.
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/api/tools", None),
    ("POST", "/api/conversations", {"title": "t"}),
    ("GET", "/api/conversations", None),
    ("GET", "/api/conversations/{conv}", None),
    ("DELETE", "/api/conversations/{conv}", None),
    ("POST", "/api/conversations/{conv}/runs", {"message": "hi"}),
    ("GET", "/api/conversations/{conv}/stream", None),
    ("POST", "/api/conversations/{conv}/interrupt", {"content": "hi"}),
    ("POST", "/api/conversations/{conv}/cancel", None),
    ("GET", "/api/runs/{run}", None),
    ("GET", "/api/runs/{run}/events", None),
    ("POST", "/api/chat", {"message": "hi"}),
]


def call(
    http: httpx.Client, method: str, path: str, body: dict[str, Any] | None, **kw: Any
) -> httpx.Response:
    if body is None:
        return http.request(method, path, **kw)
    return http.request(method, path, json=body, **kw)


def assert_error(response: httpx.Response, status: int, code: str, what: str = "") -> None:
    assert response.status_code == status, (what, response.text)
    assert response.headers["content-type"].startswith("application/json"), what
    error = response.json()["error"]
    assert set(error) == {"code", "message"}, what
    assert error["code"] == code, what
    assert error["message"], what


BAD_CREDENTIALS: dict[str, dict[str, str]] = {
    "missing": {},
    "wrong": {"Authorization": "Bearer wrong"},
    "empty": {"Authorization": "Bearer"},
    "basic": {"Authorization": "Basic a2E="},
    "no-scheme": {"Authorization": "key-000"},
    "prefix-of-a-key": {"Authorization": "Bearer key-00"},
    "key-plus-more": {"Authorization": "Bearer key-000x"},
    "owner-name": {"Authorization": "Bearer owner0"},
}

SENT_A_KEY = {"wrong", "prefix-of-a-key", "key-plus-more", "owner-name"}


def test_every_api_route_is_401_without_a_valid_key_and_changes_nothing(
    shared_service: Service, alice: Api
) -> None:
    conv = alice.create_conversation()
    run = alice.run(conv["id"], "What is 1+1?")
    before = alice.snapshot()

    for name, headers in BAD_CREDENTIALS.items():
        with httpx.Client(base_url=shared_service.base_url, headers=headers, timeout=10) as anonymous:
            for method, path, body in ROUTES:
                response = call(anonymous, method, path.format(conv=conv["id"], run=run.run_id), body)
                assert_error(response, 401, "unauthorized", f"{name} {method} {path}")
                # RFC 6750 3.1: a key that was sent and refused is an invalid_token; a request
                # that sent none (or no bearer one) is told only the scheme.
                challenge = response.headers["www-authenticate"]
                if name in SENT_A_KEY:
                    assert challenge.startswith('Bearer error="invalid_token"'), (name, challenge)
                else:
                    assert challenge == "Bearer", (name, challenge)

    assert alice.snapshot() == before


def test_the_stream_accepts_the_key_as_access_token_and_no_other_route_does(
    shared_service: Service, alice: Api
) -> None:
    conv = alice.create_conversation()
    outcome = alice.run(conv["id"], "What is 2+2?")

    with httpx.Client(base_url=shared_service.base_url, timeout=10) as browser:
        path = f"/api/conversations/{conv['id']}/stream"
        with browser.stream("GET", path, params={"access_token": alice.key}) as response:
            assert response.status_code == 200
            events = read_events(response)
        wrong = browser.get(path, params={"access_token": "nope"})
        elsewhere = browser.get(f"/api/conversations/{conv['id']}", params={"access_token": alice.key})

    assert [(e.id, e.event, e.data) for e in events] == [(e.id, e.event, e.data) for e in outcome.events]
    assert_error(wrong, 401, "unauthorized")
    assert_error(elsewhere, 401, "unauthorized")


def test_without_api_keys_the_service_says_single_user_mode_and_needs_no_key(
    service: ServiceFactory, app_logs: LogRecorder
) -> None:
    svc = service()
    api = svc.api()

    conv = api.create_conversation()
    outcome = api.run(conv["id"], "What is 3+3?")

    assert any("single-user mode" in line for line in app_logs.lines)
    assert outcome.done["status"] == "completed"
    assert [c["id"] for c in api.http.get("/api/conversations").json()["items"]] == [conv["id"]]
    # Whatever credentials a client (or a proxy in front) sends, it is the one local user.
    for header in ("Bearer anything", "Basic dXNlcjpwYXNz", "Bearer"):
        response = api.http.get(f"/api/conversations/{conv['id']}", headers={"Authorization": header})
        assert response.status_code == 200, (header, response.text)


def test_with_api_keys_the_start_up_log_does_not_claim_single_user_mode(
    service: ServiceFactory, app_logs: LogRecorder
) -> None:
    service(api_keys=KEYS, log_level="INFO")

    assert app_logs.lines, "nothing was logged"
    assert not any("single-user mode" in line for line in app_logs.lines)


def test_the_log_never_contains_an_api_key(service: ServiceFactory, app_logs: LogRecorder) -> None:
    secret_a, secret_b = "key-alice-5b1e0c", "key-bob-93af2d"
    svc = service(api_keys=f"alice:{secret_a},bob:{secret_b}", log_level="DEBUG")
    api = svc.api(secret_a)
    conv = api.create_conversation()
    api.run(conv["id"], "What is 4+4?")
    svc.api("wrong-key-7c2d").http.get("/api/conversations")

    text = "\n".join(app_logs.lines)
    assert "run finished" in text or "run started" in text  # the run was logged at all
    for secret in (secret_a, secret_b, "wrong-key-7c2d"):
        assert secret not in text


def holding_agent(release: threading.Event) -> Any:
    """Answers like an echo agent, but holds any loop call whose question mentions "hold"."""
    echo = EchoAgentBehaviour()

    def handle(body: dict[str, Any]) -> FakeReply:
        last = next((m for m in reversed(body["messages"]) if m["role"] == "user"), {})
        if "hold" in str(last.get("content")) and not body.get("stream"):
            return FakeReply.blocked(release, FakeReply.text("held answer"))
        return echo(body)

    return handle


def test_another_owner_gets_404_for_a_conversation_and_its_runs_on_every_route(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    release = threading.Event()
    fake_llm.set_handler(holding_agent(release))
    svc = service(api_keys=KEYS, llm=fake_llm)
    alice, bob = svc.api(ALICE_KEY), svc.api(BOB_KEY)
    conv = alice.create_conversation({"title": "alice's"})
    finished = alice.run(conv["id"], "first question")
    active = alice.start_run(conv["id"], "please hold")
    fake_llm.wait_for_requests(2)
    before = alice.snapshot()
    requests_before = len(fake_llm.requests)

    try:
        for method, path, body in ROUTES:
            if "{" not in path:
                continue
            for run_id in (finished.run_id, active["run_id"]):
                response = call(bob.http, method, path.format(conv=conv["id"], run=run_id), body)
                assert_error(response, 404, "not_found")
        by_token = bob.http.get(
            f"/api/conversations/{conv['id']}/stream",
            params={"access_token": BOB_KEY},
            headers={"Authorization": ""},
        )
        chat = bob.http.post("/api/chat", json={"message": "hi", "conversation_id": conv["id"]})
        unknown = bob.http.get("/api/conversations/conv_unknown")
        bob_list = bob.http.get("/api/conversations").json()
        after = alice.snapshot()
    finally:
        release.set()

    assert_error(by_token, 404, "not_found")
    assert_error(chat, 404, "not_found")
    # Not found and not yours look the same: nothing tells bob the conversation exists.
    assert by_token.json() == chat.json() == unknown.json()
    assert bob_list == {"items": [], "next_cursor": None}
    assert after == before
    assert after["details"][conv["id"]]["active_run_id"] == active["run_id"]
    assert len(fake_llm.requests) == requests_before  # bob started nothing
    assert alice.stream(conv["id"])[-1].data["status"] == "completed"
