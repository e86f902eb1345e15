"""Owner isolation beyond ``tests/integration/service/test_api_auth.py`` (which walks every /api
route with another owner's conversation and runs): ids are not guessable, what the OpenAI-compatible
route creates belongs to its caller alone, and no cursor or token opens another owner's stream."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

from tests.integration.service.conftest import Api

ID_FORMATS = {
    "conversation": re.compile(r"conv_([A-Za-z0-9_-]{22})"),
    "run": re.compile(r"run_([A-Za-z0-9_-]{22})"),
}


def random_part(kind: str, value: str) -> bytes:
    match = ID_FORMATS[kind].fullmatch(value)
    assert match is not None, f"{kind} id {value!r} is not prefix + 22 url-safe characters"
    return base64.urlsafe_b64decode(match[1] + "==")


def test_ids_carry_128_random_bits_so_they_cannot_be_guessed(alice: Api) -> None:
    conversations = [alice.create_conversation()["id"] for _ in range(40)]
    runs = [alice.run(conversation, "What is 2+2?").run_id for conversation in conversations[:8]]

    for kind, ids in (("conversation", conversations), ("run", runs)):
        raw = [random_part(kind, value) for value in ids]
        assert all(len(r) * 8 >= 128 for r in raw)
        assert len(set(raw)) == len(raw)
        # A counter or a clock would share leading bytes between ids made a moment apart.
        assert len({r[:2] for r in raw}) >= len(raw) - 1, ids
        ones = sum(bin(int.from_bytes(r, "big")).count("1") for r in raw)
        assert 0.4 < ones / (8 * sum(len(r) for r in raw)) < 0.6, ids


def api_routes(conversation_id: str, run_id: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    return [
        ("GET", f"/api/conversations/{conversation_id}", None),
        ("GET", f"/api/conversations/{conversation_id}/stream", None),
        ("POST", f"/api/conversations/{conversation_id}/runs", {"message": "hi"}),
        ("POST", f"/api/conversations/{conversation_id}/interrupt", {"content": "hi"}),
        ("POST", f"/api/conversations/{conversation_id}/cancel", None),
        ("POST", "/api/chat", {"message": "hi", "conversation_id": conversation_id}),
        ("GET", f"/api/runs/{run_id}", None),
        ("GET", f"/api/runs/{run_id}/events", None),
        ("DELETE", f"/api/conversations/{conversation_id}", None),
    ]


def completion_ids(api: Api, *, stream: bool) -> tuple[str, str]:
    body = {
        "model": "agentstream",
        "stream": stream,
        "messages": [{"role": "user", "content": "What is 3*3?"}],
    }
    if not stream:
        response = api.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        extension = response.json()["agentstream"]
        return extension["conversation_id"], extension["run_id"]
    with api.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        first = next(line for line in list(response.iter_lines()) if line.startswith("data: "))
    extension = json.loads(first.removeprefix("data: "))["agentstream"]
    return extension["conversation_id"], extension["run_id"]


def test_what_the_openai_route_creates_belongs_to_its_caller_alone(alice: Api, bob: Api) -> None:
    made = [completion_ids(alice, stream=False), completion_ids(alice, stream=True)]
    bobs_own = completion_ids(bob, stream=False)
    for _, run_id in made:
        alice.wait_finished(run_id)
    bob.wait_finished(bobs_own[1])
    before = alice.snapshot()

    for conversation_id, run_id in made:
        for method, path, body in api_routes(conversation_id, run_id):
            response = bob.http.request(method, path, json=body) if body else bob.http.request(method, path)
            assert response.status_code == 404, (method, path, response.text)
            assert response.json()["error"]["code"] == "not_found"

    assert alice.snapshot() == before
    assert {c["id"] for c in before["conversations"]} == {conversation_id for conversation_id, _ in made}
    assert [c["id"] for c in bob.http.get("/api/conversations").json()["items"]] == [bobs_own[0]]
    assert alice.http.get(f"/api/runs/{bobs_own[1]}").status_code == 404


def test_no_cursor_or_token_opens_another_owners_stream(alice: Api, bob: Api) -> None:
    conversation = alice.create_conversation()
    outcome = alice.run(conversation["id"], "What is 5*5?")
    path = f"/api/conversations/{conversation['id']}/stream"
    alice_key = alice.http.headers["authorization"].removeprefix("Bearer ")
    bob_key = bob.http.headers["authorization"].removeprefix("Bearer ")
    first, last = outcome.events[0].id, outcome.events[-2].id
    assert first is not None and last is not None

    attempts = [
        bob.http.get(path, params={"after": first}),
        bob.http.get(path, params={"after": last}),
        bob.http.get(path, headers={"Last-Event-ID": first}),
        # The header is the caller; a token in the query does not add another identity to it.
        bob.http.get(path, params={"access_token": alice_key}),
        bob.http.get(path, params={"access_token": bob_key}, headers={"Authorization": ""}),
        bob.http.get(f"/api/runs/{outcome.run_id}/events"),
    ]

    for response in attempts:
        assert response.status_code == 404, (response.request.url, response.text)
        assert response.json()["error"]["code"] == "not_found"
    with alice.http.stream("GET", path, params={"after": first}) as response:
        assert response.status_code == 200
