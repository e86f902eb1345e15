"""Bad input on every route: always 4xx with ``{"error": {"code", "message"}}``, never 500, and nothing
stored changes (the caller's conversations, messages and runs are compared before and after)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from app.db.repositories import ConversationRepo
from app.errors import ShuttingDownError
from app.runs.manager import RunManager
from tests.integration.service.conftest import Api

MAX = 32_000


@dataclass(frozen=True)
class Bad:
    """One bad request body: JSON to encode, or raw bytes sent as they are."""

    body: Any = None
    raw: bytes | None = None
    content_type: str = "application/json"
    status: int = 422
    code: str | None = "invalid_request"

    def send(self, http: httpx.Client, path: str) -> httpx.Response:
        content = self.raw if self.raw is not None else json.dumps(self.body).encode()
        return http.post(path, content=content, headers={"content-type": self.content_type})


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# Bad bodies for any route whose body is {"<field>": text}: ``{field}`` is filled in per route.
TEXT_FIELD_CASES: dict[str, Bad] = {
    "missing-field": Bad({}),
    "int": Bad({"{field}": 5}),
    "null": Bad({"{field}": None}),
    "bool": Bad({"{field}": True}),
    "list": Bad({"{field}": ["hi"]}),
    "object": Bad({"{field}": {"text": "hi"}}),
    "empty": Bad({"{field}": ""}),
    "blank": Bad({"{field}": " \n\t "}),
    "too-long": Bad({"{field}": "x" * (MAX + 1)}),
    "nul": Bad({"{field}": "before\x00after"}),
    "unknown-field": Bad({"{field}": "hi", "priority": "high"}),
    "body-is-list": Bad(["hi"]),
    "body-is-string": Bad("hi"),
    "body-is-number": Bad(7),
    "body-is-null": Bad(None),
    "no-body": Bad(raw=b""),
    "malformed-json": Bad(raw=b'{"{field}": "hi"', status=400, code="invalid_json"),
    "trailing-garbage": Bad(raw=b'{"{field}": "hi"} x', status=400, code="invalid_json"),
    "single-quotes": Bad(raw=b"{'{field}': 'hi'}", status=400, code="invalid_json"),
    "non-utf8": Bad(raw=b'{"{field}": "caf\xe9"}', status=400, code="invalid_json"),
    "lone-surrogate": Bad(raw=b'{"{field}": "\\ud800"}'),
    "deep-nesting": Bad(raw=b'{"{field}": ' + deep(100_000) + b"}", status=400, code="invalid_json"),
    "nested-value": Bad(raw=b'{"{field}": ' + deep(500) + b"}"),
    "text-plain": Bad(raw=b'{"{field}": "hi"}', content_type="text/plain"),
    "form": Bad(raw=b"{field}=hi", content_type="application/x-www-form-urlencoded"),
    "two-megabytes": Bad({"{field}": "x" * 2_000_000}, status=413, code="too_large"),
}


def fill(bad: Bad, field: str) -> Bad:
    def sub(value: Any) -> Any:
        if isinstance(value, dict):
            return {k.replace("{field}", field): sub(v) for k, v in value.items()}
        return value

    raw = bad.raw.replace(b"{field}", field.encode()) if bad.raw is not None else None
    return Bad(sub(bad.body), raw, bad.content_type, bad.status, bad.code)


def assert_rejected(response: httpx.Response, bad: Bad, case: str = "") -> None:
    assert response.status_code == bad.status, (case, response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json"), case
    body = response.json()
    assert set(body) == {"error"}, case
    assert set(body["error"]) == {"code", "message"}, case
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], case
    if bad.code is not None:
        assert body["error"]["code"] == bad.code, (case, body)


@pytest.fixture
def used_conversation(alice: Api) -> str:
    """Alice's conversation with one finished run: there is something stored that must not change."""
    conv = alice.create_conversation({"title": "kept"})
    assert alice.run(conv["id"], "What is 9*9?").done["status"] == "completed"
    return str(conv["id"])


@pytest.mark.parametrize("route", ["runs", "interrupt", "chat"])
def test_every_bad_body_is_rejected_and_changes_nothing(
    alice: Api, used_conversation: str, route: str
) -> None:
    path, field = {
        "runs": (f"/api/conversations/{used_conversation}/runs", "message"),
        "interrupt": (f"/api/conversations/{used_conversation}/interrupt", "content"),
        "chat": ("/api/chat", "message"),
    }[route]
    before = alice.snapshot()

    for case, template in TEXT_FIELD_CASES.items():
        bad = fill(template, field)
        assert_rejected(bad.send(alice.http, path), bad, case)

    assert alice.snapshot() == before


CREATE_CASES: dict[str, Bad] = {
    "title-int": Bad({"title": 5}),
    "title-newline": Bad({"title": "first\nsecond"}),
    "title-carriage-return": Bad({"title": "first\rsecond"}),
    "title-nul": Bad({"title": "a\x00b"}),
    "title-control": Bad({"title": "bell\x07"}),
    "title-too-long": Bad({"title": "t" * 201}),
    "agent-list": Bad({"agent": []}),
    "agent-string": Bad({"agent": "native"}),
    "mode-unknown": Bad({"agent": {"mode": "turbo"}}),
    "mode-case": Bad({"agent": {"mode": "JSON"}}),
    "tools-string": Bad({"agent": {"tools": "calculator"}}),
    "tools-unknown": Bad({"agent": {"tools": ["calculator", "rm_rf"]}}),
    "tools-nul": Bad({"agent": {"tools": ["calcul\x00ator"]}}),
    "tools-too-many": Bad({"agent": {"tools": ["calculator"] * 257}}),
    "iterations-zero": Bad({"agent": {"max_iterations": 0}}),
    "iterations-huge": Bad({"agent": {"max_iterations": 10**30}}),
    "iterations-fraction": Bad({"agent": {"max_iterations": 2.5}}),
    "iterations-bool": Bad({"agent": {"max_iterations": True}}),
    "iterations-string": Bad({"agent": {"max_iterations": "5"}}),
    "completion-check-string": Bad({"agent": {"completion_check": "yes"}}),
    "completion-check-int": Bad({"agent": {"completion_check": 1}}),
    "system-prompt-nul": Bad({"agent": {"system_prompt": "be\x00nice"}}),
    "system-prompt-too-long": Bad({"agent": {"system_prompt": "p" * 8001}}),
    "agent-unknown-field": Bad({"agent": {"temperature": 0.2}}),
    "unknown-field": Bad({"title": "t", "owner": "bob"}),
    "body-is-list": Bad([]),
    "body-is-string": Bad("title"),
    "malformed-json": Bad(raw=b'{"title": ', status=400, code="invalid_json"),
    "non-utf8": Bad(raw=b'{"title": "\xff\xfe"}', status=400, code="invalid_json"),
    "deep-nesting": Bad(raw=b'{"agent": ' + deep(100_000) + b"}", status=400, code="invalid_json"),
    "two-megabytes": Bad(
        {"title": "t", "agent": {"system_prompt": "p" * 2_000_000}}, status=413, code="too_large"
    ),
}


def test_every_bad_create_body_is_rejected_and_creates_nothing(alice: Api, used_conversation: str) -> None:
    before = alice.snapshot()

    for case, bad in CREATE_CASES.items():
        assert_rejected(bad.send(alice.http, "/api/conversations"), bad, case)

    assert alice.snapshot() == before


def test_a_bad_chat_conversation_id_is_422(alice: Api, used_conversation: str) -> None:
    before = alice.snapshot()

    for conversation_id in (5, "", "a" * 129, "conv\nx", "conv\x00x", ["conv_x"]):
        response = alice.http.post("/api/chat", json={"message": "hi", "conversation_id": conversation_id})
        assert_rejected(response, Bad(), repr(conversation_id))

    assert alice.snapshot() == before


def test_a_chunked_body_over_the_limit_is_413_without_a_content_length(
    alice: Api, used_conversation: str
) -> None:
    before = alice.snapshot()

    def chunks() -> Iterator[bytes]:
        yield b'{"message": "'
        for _ in range(40):
            yield b"x" * 50_000
        yield b'"}'

    response = alice.http.post(
        f"/api/conversations/{used_conversation}/runs",
        content=chunks(),
        headers={"content-type": "application/json"},
    )

    assert "content-length" not in response.request.headers
    assert_rejected(response, Bad(status=413, code="too_large"))
    assert alice.snapshot() == before


def test_a_message_of_exactly_32000_characters_is_accepted(alice: Api) -> None:
    conv = alice.create_conversation()

    outcome = alice.run(conv["id"], "y" * MAX)

    assert outcome.done["status"] == "completed"
    assert alice.conversation(conv["id"])["messages"][0]["content"] == "y" * MAX


def test_cancel_ignores_its_body_and_answers_409_without_a_run(alice: Api, used_conversation: str) -> None:
    before = alice.snapshot()

    response = alice.http.post(
        f"/api/conversations/{used_conversation}/cancel",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )

    assert_rejected(response, Bad(status=409, code="no_active_run"))
    assert alice.snapshot() == before


def page_cursor(created_at: str, conversation_id: str) -> str:
    raw = json.dumps([created_at, conversation_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


BAD_LIST_QUERIES: dict[str, dict[str, str]] = {
    "limit-zero": {"limit": "0"},
    "limit-negative": {"limit": "-3"},
    "limit-over-100": {"limit": "101"},
    "limit-huge": {"limit": "9" * 40},
    "limit-text": {"limit": "ten"},
    "cursor-garbage": {"cursor": "not-a-cursor"},
    "cursor-too-long": {"cursor": "A" * 257},
    "cursor-nul": {"cursor": "abc\x00"},
    "cursor-object": {"cursor": base64.urlsafe_b64encode(b'{"a":1}').decode()},
    "cursor-naive-date": {"cursor": page_cursor("2024-01-01T00:00:00", "conv_a")},
    "cursor-id-with-nul": {"cursor": page_cursor("2024-01-01T00:00:00+00:00", "conv\x00a")},
    "cursor-year-one": {"cursor": page_cursor("0001-01-01T00:00:00+01:00", "conv_a")},
    "cursor-year-9999": {"cursor": page_cursor("9999-12-31T23:59:59-01:00", "conv_a")},
}


def test_bad_list_queries_are_4xx_on_every_stack(stack_api: Api) -> None:
    api = stack_api
    conv = api.create_conversation()

    for name, params in BAD_LIST_QUERIES.items():
        response = api.http.get("/api/conversations", params=params)
        assert 400 <= response.status_code < 500, (name, response.status_code, response.text[:300])
        assert set(response.json()["error"]) == {"code", "message"}, name
    assert [c["id"] for c in api.http.get("/api/conversations").json()["items"]] == [conv["id"]]


def test_an_empty_list_cursor_is_the_first_page(stack_api: Api) -> None:
    conv = stack_api.create_conversation()
    response = stack_api.http.get("/api/conversations", params={"cursor": ""})
    assert response.status_code == 200, response.text
    assert [c["id"] for c in response.json()["items"]] == [conv["id"]]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_422_saying_which_content_type_to_send(
    alice: Api, content_type: str | None
) -> None:
    """What `curl -d '{"message": "hi"}' .../api/chat` sends (a form's content type)."""
    headers = {"content-type": content_type} if content_type else {}
    before = alice.snapshot()
    response = alice.http.post("/api/chat", content=b'{"message": "hi"}', headers=headers)
    assert_rejected(response, Bad(raw=b""), "not json")
    assert "Content-Type: application/json" in response.json()["error"]["message"]
    assert alice.snapshot() == before


BAD_CURSORS = {
    "garbage": "abc",
    "no-sequence": "1700000000000",
    "negative": "-1-0",
    "fullwidth-digits": "\uff11\uff12-\uff10",
    "superscript": "\u00b2-0",
    "ms-over-int64": "9223372036854775808-0",
    "ms-20-digits": "99999999999999999999-0",
    "seq-huge": "1-99999999999999999999",
    "seq-over-int32": "1-2147483648",
    "spaces": " 1-0 ",
    "too-long": "1" * 70 + "-0",
}


def test_bad_stream_cursors_are_422_whether_after_or_last_event_id(stack_api: Api) -> None:
    api = stack_api
    conv = api.create_conversation()
    api.run(conv["id"], "What is 1+2?")
    path = f"/api/conversations/{conv['id']}/stream"

    for name, cursor in BAD_CURSORS.items():
        responses = [
            api.http.get(path, params={"after": cursor}),
            # A good Last-Event-ID is the position then, but a bad ?after= is still refused.
            api.http.get(path, params={"after": cursor}, headers={"Last-Event-ID": "0-0"}),
        ]
        if cursor.strip() == cursor:  # HTTP drops the spaces around a header's value
            responses.append(api.http.get(path, headers={"Last-Event-ID": cursor.encode()}))
        for response in responses:
            assert response.status_code == 422, (name, response.status_code, response.text[:300])
            assert response.json()["error"]["code"] == "invalid_request", name


BAD_IDS = {
    "nul": "conv%00x",
    "too-long": "c" * 129,
    "unicode": "conv_%C3%A9t%C3%A9",
    "invalid-utf8": "%ff%fe",
    "spaces": "conv%20x",
    "dot": "..",
}


def test_odd_ids_are_404_on_every_route_on_every_stack(stack_api: Api) -> None:
    api = stack_api
    conv = api.create_conversation()
    api.run(conv["id"], "What is 2+3?")
    before = api.snapshot()
    routes = [
        ("GET", "/api/conversations/{id}", None),
        ("DELETE", "/api/conversations/{id}", None),
        ("POST", "/api/conversations/{id}/runs", {"message": "hi"}),
        ("GET", "/api/conversations/{id}/stream", None),
        ("POST", "/api/conversations/{id}/interrupt", {"content": "hi"}),
        ("POST", "/api/conversations/{id}/cancel", None),
        ("GET", "/api/runs/{id}", None),
        ("GET", "/api/runs/{id}/events", None),
    ]

    for name, odd in BAD_IDS.items():
        for method, template, body in routes:
            url = template.replace("{id}", odd)
            response = api.http.request(method, url, json=body) if body else api.http.request(method, url)
            assert response.status_code == 404, (
                name,
                method,
                template,
                response.status_code,
                response.text[:300],
            )
            assert response.json()["error"]["code"] == "not_found"
    assert api.snapshot() == before


def test_unknown_routes_and_methods_answer_with_the_error_shape(alice: Api) -> None:
    cases = [
        (alice.http.get("/api/nothing-here"), 404, "not_found"),
        (alice.http.put("/api/conversations"), 405, "method_not_allowed"),
        (alice.http.patch("/api/runs/run_x"), 405, "method_not_allowed"),
    ]

    for response, status, code in cases:
        assert response.status_code == status
        assert response.json()["error"]["code"] == code


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/chat", {"message": "hi"}),
        ("/v1/chat/completions", {"model": "agentstream", "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_a_chat_whose_run_cannot_start_leaves_no_conversation_behind(
    alice: Api, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> None:
    async def refuse(*_: Any, **__: Any) -> None:
        raise ShuttingDownError("this worker is shutting down; retry on another worker")

    monkeypatch.setattr(RunManager, "start_run", refuse)
    before = alice.snapshot()

    response = alice.http.post(path, json=body)

    assert response.status_code == 503, response.text
    assert alice.snapshot() == before


def test_a_database_that_does_not_answer_in_time_is_503_not_500(
    alice: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL statements have a command timeout (a connection dropped without a reset)."""
    conv = alice.create_conversation()

    async def no_answer(*_: Any, **__: Any) -> None:
        raise TimeoutError

    monkeypatch.setattr(ConversationRepo, "get", no_answer)
    response = alice.http.get(f"/api/conversations/{conv['id']}")

    assert response.status_code == 503
    assert response.json()["error"]["code"] == "unavailable"
    assert response.headers["Retry-After"] == "1"
