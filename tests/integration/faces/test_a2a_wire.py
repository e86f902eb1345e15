"""The A2A face on the wire (FACES.md N-01, N-02): the agent card (1.0 and with 0.3 fields, ETag,
Cache-Control, the service's auth as security schemes), the 0.3 method names, the caller's
credentials, content types, and bodies no client should send: each answered in the binding's error
shape, never a 500, nothing started; ids the service could not have made (a NUL, which PostgreSQL
refuses) are not found before any query; and a failure nobody foresaw is an internal error that
quotes nothing of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.integration.faces.a2a_support import ALICE, KEYS, V1
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    FakeLLM,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.server import CLIENT_TLS, ServerThread

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def service(start_service: Callable[..., ServerThread]) -> ServerThread:
    return start_service(redis=False, api_keys=KEYS, public_base_url="https://agents.example.com/")


@pytest.fixture
def http(service: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.base_url, timeout=10, verify=CLIENT_TLS) as client:
        yield client


def runs_of_alice(http: httpx.Client) -> int:
    return len(http.get("/api/conversations", headers=ALICE).json()["items"])


def test_the_agent_card_names_the_bindings_the_auth_and_revalidates(http: httpx.Client) -> None:
    response = http.get("/.well-known/agent-card.json")  # public: no credentials
    assert response.status_code == 200
    card = response.json()
    assert card["name"] == "AgentStream" and card["version"]
    assert card["capabilities"]["streaming"] is card["capabilities"]["pushNotifications"] is True
    interfaces = {(i["protocolBinding"], i["protocolVersion"]): i["url"] for i in card["supportedInterfaces"]}
    assert interfaces == {
        ("JSONRPC", "1.0"): "https://agents.example.com/a2a",
        ("HTTP+JSON", "1.0"): "https://agents.example.com/a2a/rest",
        ("JSONRPC", "0.3"): "https://agents.example.com/a2a",
        ("HTTP+JSON", "0.3"): "https://agents.example.com/a2a/rest",
    }
    assert card["supportedInterfaces"][0]["protocolVersion"] == "1.0"  # preferred first
    assert card["securitySchemes"] == {
        "apiKey": {
            "httpAuthSecurityScheme": {
                "scheme": "Bearer",
                "description": card["securitySchemes"]["apiKey"]["httpAuthSecurityScheme"]["description"],
            }
        }
    }
    assert card["securityRequirements"] == [{"schemes": {"apiKey": {}}}]
    assert [s["id"] for s in card["skills"]] == ["default"]
    # 1.0's schema allows no 0.3 field; the legacy path has them for older clients.
    assert not {"url", "preferredTransport", "additionalInterfaces", "protocolVersion"} & card.keys()
    legacy = http.get("/.well-known/agent.json").json()
    assert (legacy["url"], legacy["preferredTransport"]) == ("https://agents.example.com/a2a", "JSONRPC")

    etag = response.headers["etag"]
    assert etag.startswith('W/"') and "max-age" in response.headers["cache-control"]
    again = http.get("/.well-known/agent-card.json", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.headers["etag"] == etag and not again.content


def test_the_0_3_method_names_go_through_the_sdk_compatibility_layer(http: httpx.Client) -> None:
    body = {
        "jsonrpc": "2.0",
        "id": "old",
        "method": "message/send",
        "params": {
            "message": {
                "kind": "message",
                "messageId": "m-03",
                "role": "user",
                "parts": [{"kind": "text", "text": "what is 6*7?"}],
            }
        },
    }
    answer = http.post("/a2a", json=body, headers=ALICE).json()  # 0.3 sends no A2A-Version
    task = answer["result"]
    assert task["kind"] == "task" and task["status"]["state"] == "completed", answer
    got = http.post(
        "/a2a",
        json={"jsonrpc": "2.0", "id": 2, "method": "tasks/get", "params": {"id": task["id"]}},
        headers=ALICE,
    ).json()["result"]
    assert got["id"] == task["id"] and got["artifacts"][0]["parts"][0]["text"]


def test_credentials_are_the_services_own(http: httpx.Client) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": {}}
    for path, kwargs in (("/a2a", {"json": body}), ("/a2a/rest/tasks", {})):
        method = http.post if path == "/a2a" else http.get
        refused = method(path, headers=V1, **kwargs)
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
        wrong = method(path, headers={**V1, "Authorization": "Bearer nope"}, **kwargs)
        assert wrong.status_code == 401 and 'error="invalid_token"' in wrong.headers["www-authenticate"]


def test_bodies_no_client_should_send_are_the_bindings_errors_and_start_nothing(http: httpx.Client) -> None:
    before = runs_of_alice(http)
    headers = {**ALICE, **V1}
    rpc = [
        (b"{not json", "application/json", -32700),
        (b"\xff\xfe\x00", "application/json", -32700),
        (b"[" * 5000 + b"]" * 5000, "application/json", -32700),
        (b"[]", "application/json", -32600),
        (
            b'{"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": 5}}',
            "application/json",
            -32602,
        ),
        (
            b'{"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": {"parts": []}}}',
            "application/json",
            -32602,
        ),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "Nope", "params": {}}', "application/json", -32601),
        (b"{'jsonrpc': '2.0'}", "text/plain", -32005),
    ]
    for body, content_type, code in rpc:
        response = http.post("/a2a", content=body, headers={**headers, "Content-Type": content_type})
        assert response.status_code == 200, (body[:40], response.text)
        assert response.json()["error"]["code"] == code, (body[:40], response.text)
    nul = {"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "a\u0000b"}]}}
    long_context = {
        "message": {"messageId": "m", "role": "ROLE_USER", "contextId": "c" * 300, "parts": [{"text": "hi"}]}
    }
    rest = [
        b"{not json",
        b"\xff\xfe",
        b'{"message": "no"}',
        b'{"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"data": {"decision": "maybe"}}]}}',
        httpx.Request("POST", "/", json=nul).content,
        httpx.Request("POST", "/", json=long_context).content,
    ]
    for body in rest:
        response = http.post(
            "/a2a/rest/message:send", content=body, headers={**headers, "Content-Type": "application/json"}
        )
        assert 400 <= response.status_code < 500, (body[:40], response.status_code, response.text)
        assert response.headers["content-type"].startswith("application/json")
        assert response.json()["error"]["status"], response.text
    for query in ("pageSize=0", "pageSize=101", "pageToken=bogus", "historyLength=-1", "status=NOPE"):
        response = http.get(f"/a2a/rest/tasks?{query}", headers=headers)
        assert response.status_code < 500, (query, response.text)
    assert runs_of_alice(http) == before


NUL_ID = "run_\u0000x"
"""No id the service makes: PostgreSQL refuses NUL in text, so a query with it fails (and quoted
the statement and its parameters to the caller)."""


def rpc_error(http: httpx.Client, method: str, params: dict[str, object]) -> dict[str, object]:
    response = http.post(
        "/a2a", json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params}, headers={**ALICE, **V1}
    )
    assert response.status_code == 200, response.text
    error: dict[str, object] = response.json()["error"]
    assert "SELECT" not in response.text and "sqlalchemy" not in response.text.lower(), response.text
    return error


def test_ids_the_service_could_not_have_made_name_no_task_and_never_reach_the_database(
    http: httpx.Client,
) -> None:
    nul_message = {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
    not_found = [
        ("GetTask", {"id": NUL_ID}),
        ("CancelTask", {"id": NUL_ID}),
        ("SubscribeToTask", {"id": NUL_ID}),
        ("CreateTaskPushNotificationConfig", {"taskId": NUL_ID, "url": "http://127.0.0.1:9/hook"}),
        ("GetTaskPushNotificationConfig", {"taskId": NUL_ID, "id": "c"}),
        ("ListTaskPushNotificationConfigs", {"taskId": NUL_ID}),
        ("DeleteTaskPushNotificationConfig", {"taskId": NUL_ID, "id": "c"}),
        ("SendMessage", {"message": {**nul_message, "taskId": NUL_ID}}),
        ("SendStreamingMessage", {"message": {**nul_message, "taskId": NUL_ID}}),
    ]
    for method, params in not_found:
        assert rpc_error(http, method, params)["code"] == -32001, method
    invalid = [
        ("ListTasks", {"contextId": "ctx-\u0000"}),
        ("SendMessage", {"message": {**nul_message, "contextId": "ctx-\u0000"}}),
        ("SendMessage", {"message": {**nul_message, "messageId": "m-\u0000"}}),
    ]
    for method, params in invalid:
        assert rpc_error(http, method, params)["code"] == -32602, (method, params)

    headers = {**ALICE, **V1}
    for method, path, body in (
        ("GET", "/a2a/rest/tasks/%00", None),
        ("POST", "/a2a/rest/tasks/%00:cancel", {}),
        ("GET", "/a2a/rest/tasks/%00:subscribe", None),
        ("POST", "/a2a/rest/tasks/%00/pushNotificationConfigs", {"url": "http://127.0.0.1:9/hook"}),
        ("GET", "/a2a/rest/tasks/%00/pushNotificationConfigs", None),
        ("GET", "/a2a/rest/tasks/%00/pushNotificationConfigs/c", None),
        ("DELETE", "/a2a/rest/tasks/%00/pushNotificationConfigs/c", None),
        ("POST", "/a2a/rest/message:send", {"message": {**nul_message, "taskId": NUL_ID}}),
    ):
        response = http.request(method, path, json=body, headers=headers)
        assert response.status_code == 404, (method, path, response.status_code, response.text)
        assert response.json()["error"]["status"] == "NOT_FOUND", response.text
    for method, path, body in (
        ("GET", "/a2a/rest/tasks?contextId=%00", None),
        ("POST", "/a2a/rest/message:send", {"message": {**nul_message, "messageId": "m-\u0000"}}),
    ):
        response = http.request(method, path, json=body, headers=headers)
        assert response.status_code == 400, (method, path, response.status_code, response.text)

    # A config id that could name no config: not found, and deleting it is no error (idempotent).
    task = http.post(
        "/a2a",
        json={"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": nul_message}},
        headers=headers,
    ).json()["result"]["task"]
    assert (
        rpc_error(http, "GetTaskPushNotificationConfig", {"taskId": task["id"], "id": "c\u0000"})["code"]
        == -32001
    )
    deleted = http.delete(f"/a2a/rest/tasks/{task['id']}/pushNotificationConfigs/c%00", headers=headers)
    assert deleted.status_code < 300, deleted.text


def test_an_unforeseen_failure_is_an_internal_error_that_says_nothing_of_it(
    service: ServerThread,
    http: httpx.Client,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken(owner: str, run_id: str) -> None:
        raise RuntimeError("SELECT * FROM runs WHERE token = 'secret-param'")

    monkeypatch.setattr(service.services.runs, "get", broken)
    with caplog.at_level(logging.ERROR, logger="app.api.faces.a2a"):
        error = rpc_error(http, "GetTask", {"id": "run_abc"})
        rest = http.get("/a2a/rest/tasks/run_abc", headers={**ALICE, **V1})
    assert (error["code"], error["message"]) == (-32603, "internal error")
    assert rest.status_code == 500, rest.text
    assert (rest.json()["error"]["status"], rest.json()["error"]["message"]) == ("INTERNAL", "internal error")
    assert "secret-param" not in rest.text
    failures = [r for r in caplog.records if r.getMessage() == "an A2A request failed"]
    assert len(failures) == 2 and all(getattr(r, "error", None) == "RuntimeError" for r in failures)
    assert not any("secret-param" in str(vars(r)) for r in caplog.records)
