"""Hostile request bodies the API tests of ``tests/integration/service`` do not cover yet: the
OpenAI-compatible route, numbers JSON allows but no field can hold, text a database cannot store,
and CR/LF in every text field (kept where text may span lines, refused where it may not).

Whatever is refused is a 4xx in the route's error shape and changes nothing stored.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.integration.service.conftest import Api, ServiceFactory

DEEP = b"[" * 10_000 + b"]" * 10_000
HUGE_INT = b"1" + b"0" * 5000


def user_message(content: Any, **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra}).encode()


V1_REFUSED: dict[str, tuple[bytes, str, int]] = {
    "lone-surrogate": (
        b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "json",
        400,
    ),
    "lone-surrogate-system": (
        b'{"model": "m", "messages": [{"role": "system", "content": "\\udfff"},'
        b' {"role": "user", "content": "hi"}]}',
        "json",
        400,
    ),
    "lone-surrogate-part": (
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        "json",
        400,
    ),
    "lone-surrogate-stream": (
        b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "\\ud800"}]}',
        "json",
        400,
    ),
    "nul-in-prior-turn": (
        b'{"model": "m", "messages": [{"role": "assistant", "content": "a\\u0000"},'
        b' {"role": "user", "content": "hi"}]}',
        "json",
        400,
    ),
    "non-utf8": (b'{"model": "m", "messages": [{"role": "user", "content": "caf\xe9"}]}', "json", 400),
    "deep-nesting": (b'{"model": "m", "x": ' + DEEP + b', "messages": []}', "json", 400),
    "huge-integer": (b'{"model": "m", "n": ' + HUGE_INT + b', "messages": []}', "json", 400),
    "text-plain": (user_message("hi"), "text/plain", 400),
    "form": (b"model=m&messages=hi", "application/x-www-form-urlencoded", 400),
    "empty": (b"", "json", 400),
    "two-megabytes": (user_message("x" * 2_000_000), "json", 413),
}


@pytest.mark.parametrize("database_backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_bodies_the_openai_route_cannot_take_are_4xx_and_store_nothing(service: ServiceFactory) -> None:
    api = service(api_keys="alice:ka").api("ka")

    for case, (body, kind, status) in V1_REFUSED.items():
        content_type = "application/json" if kind == "json" else kind
        response = api.http.post("/v1/chat/completions", content=body, headers={"content-type": content_type})
        assert response.status_code == status, (case, response.status_code, response.text[:300])
        error = response.json()["error"]
        assert error["message"], case
        if status == 400:  # OpenAI's shape; 413 comes from the app's body limit, in the app's shape
            assert error["type"] == "invalid_request_error", case

    assert api.http.get("/api/conversations").json()["items"] == []


def test_a_question_with_control_characters_titles_its_conversation_on_one_printable_line(
    alice: Api,
) -> None:
    question = "\x1b[2J\x1b[31mred\x07 alert\r\nsecond line"

    response = alice.http.post(
        "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": question}]}
    )

    assert response.status_code == 200, response.text
    conversation_id = response.json()["agentstream"]["conversation_id"]
    title = alice.conversation(conversation_id)["title"]
    assert title.isprintable() and "red" in title and "second" not in title


NUMBERS: dict[str, tuple[bytes, int]] = {
    "5000-digit-integer": (HUGE_INT, 400),
    "overflowing-float": (b"1e400", 422),
    "negative-overflow": (b"-1e400", 422),
    "nan": (b"NaN", 422),
    "infinity": (b"Infinity", 422),
    "negative-zero": (b"-0", 422),
    "tiny-float": (b"1e-400", 422),
    "fraction": (b"1.5", 422),
}


def test_numbers_json_allows_but_no_field_can_hold_are_4xx_and_create_nothing(alice: Api) -> None:
    before = alice.snapshot()

    for case, (number, status) in NUMBERS.items():
        body = b'{"agent": {"max_iterations": ' + number + b"}}"
        response = alice.http.post(
            "/api/conversations", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == status, (case, response.text[:300])
        assert set(response.json()["error"]) == {"code", "message"}, case
    for limit in ("1" + "0" * 40, "1e3", "-0", "NaN", "0x10"):
        assert alice.http.get("/api/conversations", params={"limit": limit}).status_code == 422, limit

    assert alice.snapshot() == before


def test_a_whole_number_written_as_a_float_is_that_number(alice: Api) -> None:
    conversation = alice.create_conversation({"agent": {"max_iterations": 7.0}})

    assert conversation["agent"]["max_iterations"] == 7


MULTI_LINE = "first\r\nsecond\rthird\nfourth\u2028fifth"


def test_cr_and_lf_are_kept_exactly_in_multi_line_text(alice: Api) -> None:
    conversation = alice.create_conversation({"agent": {"system_prompt": MULTI_LINE}})

    outcome = alice.run(conversation["id"], MULTI_LINE)

    assert outcome.done["status"] == "completed"
    stored = alice.conversation(conversation["id"])
    assert stored["agent"]["system_prompt"] == MULTI_LINE
    assert stored["messages"][0]["content"] == MULTI_LINE
    with alice.http.stream("POST", "/api/chat", json={"message": MULTI_LINE}) as response:
        assert response.status_code == 200
        response.read()
    titles = [c["title"] for c in alice.http.get("/api/conversations").json()["items"]]
    assert "first" in titles


@pytest.mark.parametrize(
    ("field", "body"),
    [
        ("title", {"title": "first\r\nsecond"}),
        ("title", {"title": "first\rsecond"}),
        ("tools", {"agent": {"tools": ["calculator\n"]}}),
        ("tools", {"agent": {"tools": ["calcu\rlator"]}}),
    ],
)
def test_cr_and_lf_in_single_line_text_are_refused(alice: Api, field: str, body: dict[str, Any]) -> None:
    before = alice.snapshot()

    response = alice.http.post("/api/conversations", json=body)

    assert response.status_code == 422, response.text
    assert field in response.json()["error"]["message"]
    assert alice.snapshot() == before


def test_cr_and_lf_in_a_chat_conversation_id_are_refused(alice: Api) -> None:
    before = alice.snapshot()
    conversation = alice.create_conversation()

    for bad in (f"{conversation['id']}\r\n", f"\n{conversation['id']}", "conv\rx"):
        response = alice.http.post("/api/chat", json={"message": "hi", "conversation_id": bad})
        assert response.status_code == 422, (bad, response.text)
    with httpx.Client(base_url=alice.http.base_url, headers=alice.http.headers, timeout=10) as raw:
        response = raw.post(
            "/api/chat",
            content=b'{"message": "hi", "conversation_id": "conv\\u0000x"}',
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 422

    after = alice.snapshot()
    assert set(after["details"]) == {*before["details"], conversation["id"]}
    assert after["details"][conversation["id"]]["messages"] == []
