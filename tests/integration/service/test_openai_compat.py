"""The agent as an OpenAI-compatible model, driven by the official ``openai`` client (sync and
async, streaming and not) against the real service under uvicorn.

The answer a client reads is the run's ``done.answer``, the run is an ordinary run of a new
conversation of the caller's, and errors come in OpenAI's shape as the client's exception types.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.integration.service.conftest import ALICE_KEY, BOB_KEY, KEYS, Service, ServiceFactory
from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer, FakeReply
from tests.support.server import wait_until

QUESTION = "What is 17*23?"


def client(service: Service, key: str = ALICE_KEY) -> openai.OpenAI:
    # No retries: a 5xx must reach the test once, not start three runs.
    return openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=key, max_retries=0, timeout=20)


def async_client(service: Service, key: str = ALICE_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{service.base_url}/v1", api_key=key, max_retries=0, timeout=20)


@pytest.fixture
def database_backend() -> str:
    """SQLite only: this route adds nothing database-specific to the runs it starts."""
    return "sqlite"


@pytest.fixture
def demo(service: ServiceFactory) -> Service:
    """The service on the built-in demo model, with two callers."""
    return service(api_keys=KEYS)


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Clients to close after the test (an unclosed client is a ResourceWarning under -W error)."""
    made: list[Any] = []
    yield made
    for c in made:
        if isinstance(c, openai.OpenAI):
            c.close()


def steps_of(extension: dict[str, Any]) -> list[dict[str, Any]]:
    return list(extension["steps"])


def test_non_streaming_answer_is_the_runs_done_answer_with_its_usage_and_steps(
    demo: Service, closing: list[Any]
) -> None:
    oa = client(demo)
    closing.append(oa)

    reply = oa.chat.completions.create(
        model="anything-at-all", messages=[{"role": "user", "content": QUESTION}]
    )

    ext = reply.model_extra["agentstream"]  # type: ignore[index]
    run = demo.api(ALICE_KEY).get_run(ext["run_id"])
    assert run["status"] == "completed"
    assert reply.choices[0].message.content == run["answer"]
    assert "391" in run["answer"]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.object == "chat.completion"
    assert reply.model == "anything-at-all"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == run["usage"]["prompt_tokens"]
    assert reply.usage.completion_tokens == run["usage"]["completion_tokens"]
    assert reply.usage.total_tokens == run["usage"]["total_tokens"]
    assert ext["conversation_id"] == run["conversation_id"]
    assert ext["status"] == "completed"
    calls = [s for s in steps_of(ext) if s["type"] == "iteration" and s["status"] == "done"]
    assert calls and calls[0]["tool_name"] == "calculator" and "391" in calls[0]["observation"]
    # The steps are the run's own step events, in order.
    stored = [e["data"] for e in demo.api(ALICE_KEY).run_events(ext["run_id"]) if e["event"] == "step"]
    assert [{k: v for k, v in s.items() if k != "run_id"} for s in stored] == steps_of(ext)


def test_streamed_deltas_concatenate_to_the_runs_done_answer(demo: Service, closing: list[Any]) -> None:
    oa = client(demo)
    closing.append(oa)

    chunks = list(
        oa.chat.completions.create(
            model="agentstream",
            messages=[{"role": "user", "content": QUESTION}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    run_id = chunks[0].model_extra["agentstream"]["run_id"]  # type: ignore[index]
    run = demo.api(ALICE_KEY).get_run(run_id)
    assert text == run["answer"] and "391" in text
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    steps = [
        c.model_extra["agentstream"]["step"]
        for c in chunks
        if "step" in (c.model_extra or {}).get("agentstream", {})
    ]  # type: ignore[union-attr]
    assert any(s["type"] == "iteration" and s["tool_name"] == "calculator" for s in steps)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "stop"
    assert finishing[0].model_extra["agentstream"]["status"] == "completed"  # type: ignore[index]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.total_tokens == run["usage"]["total_tokens"] > 0


def test_raw_stream_is_data_lines_ending_with_done(demo: Service) -> None:
    api = demo.api(ALICE_KEY)
    body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "stream": True}

    with api.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line and not line.startswith(":")]

    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert lines.count("data: [DONE]") == 1


async def test_async_client_streaming_and_not_gets_the_runs_answer(demo: Service) -> None:
    async with async_client(demo) as oa:
        reply = await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}])
        stream = await oa.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 6*7?"}], stream=True
        )
        chunks = [chunk async for chunk in stream]

    api = demo.api(ALICE_KEY)
    first = api.get_run(reply.model_extra["agentstream"]["run_id"])  # type: ignore[index]
    assert reply.choices[0].message.content == first["answer"]
    second = api.get_run(chunks[0].model_extra["agentstream"]["run_id"])  # type: ignore[index]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == second["answer"]
    assert "42" in second["answer"]


def test_each_request_is_a_new_conversation_of_the_caller(demo: Service, closing: list[Any]) -> None:
    oa = client(demo)
    closing.append(oa)

    ids = {
        oa.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}]).model_extra[  # type: ignore[index]
            "agentstream"
        ]["conversation_id"]
        for _ in range(2)
    }

    assert len(ids) == 2
    alice, bob = demo.api(ALICE_KEY), demo.api(BOB_KEY)
    listed = {c["id"] for c in alice.http.get("/api/conversations").json()["items"]}
    assert ids <= listed
    for conversation_id in ids:
        assert bob.http.get(f"/api/conversations/{conversation_id}").status_code == 404


def test_earlier_messages_are_the_runs_history_and_system_messages_its_instructions(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, closing: list[Any]
) -> None:
    fake_llm.set_handler(EchoAgentBehaviour())
    svc = service(api_keys=KEYS, llm=fake_llm)
    oa = client(svc)
    closing.append(oa)

    reply = oa.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "Answer like a pirate."},
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": [{"type": "text", "text": "Nice to meet you, Ada."}]},
            {"role": "user", "content": "What is my name?"},
        ],
    )

    loop_calls = [body for body in fake_llm.requests if not body.get("stream")]
    assert loop_calls, "the engine never asked the model"
    sent = [(m["role"], m["content"]) for m in loop_calls[0]["messages"]]
    assert sent[-3:] == [
        ("user", "My name is Ada."),
        ("assistant", "Nice to meet you, Ada."),
        ("user", "What is my name?"),
    ]
    assert sent[0][0] == "system" and "Answer like a pirate." in sent[0][1]
    # The conversation keeps the whole chat, with the instructions as the agent's system prompt.
    ext = reply.model_extra["agentstream"]  # type: ignore[index]
    conversation = svc.api(ALICE_KEY).conversation(ext["conversation_id"])
    assert conversation["agent"]["system_prompt"] == "Answer like a pirate."
    stored = [(m["role"], m["content"]) for m in conversation["messages"]]
    assert stored[:3] == [
        ("user", "My name is Ada."),
        ("assistant", "Nice to meet you, Ada."),
        ("user", "What is my name?"),
    ]
    assert reply.choices[0].message.content == svc.api(ALICE_KEY).get_run(ext["run_id"])["answer"]


def test_wrong_or_missing_key_is_an_authentication_error(demo: Service, closing: list[Any]) -> None:
    wrong = client(demo, key="not-a-key")
    closing.append(wrong)

    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}])
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()

    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert caught.value.type == "invalid_request_error"
    missing = httpx.post(f"{demo.base_url}/v1/chat/completions", json={"model": "m", "messages": []})
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert demo.api(ALICE_KEY).http.get("/api/conversations").json()["items"] == []


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_run_failing_because_the_model_is_down_is_a_502_in_openai_shape(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, closing: list[Any], stream: bool
) -> None:
    fake_llm.set_handler(lambda body: FakeReply.error(503))
    svc = service(api_keys=KEYS, llm=fake_llm)
    oa = client(svc)
    closing.append(oa)

    with pytest.raises(openai.InternalServerError) as caught:
        result = oa.chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTION}], stream=stream
        )
        list(result) if stream else None  # type: ignore[call-overload]

    assert caught.value.status_code == 502
    assert caught.value.code == "run_failed"
    assert caught.value.type == "server_error"
    # It was an ordinary run, stored as failed like any other.
    items = svc.api(ALICE_KEY).http.get("/api/conversations").json()["items"]
    assert len(items) == 1
    detail = svc.api(ALICE_KEY).conversation(items[0]["id"])
    run_id = next(m["run_id"] for m in detail["messages"] if m["run_id"])
    assert svc.api(ALICE_KEY).get_run(run_id)["status"] == "failed"


def test_run_failing_after_the_stream_started_ends_it_with_an_error_the_client_raises(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, closing: list[Any]
) -> None:
    # The first loop call asks for a tool (the model answered: the stream starts), the next fails.
    fake_llm.script(FakeReply.tool_calls([("calculator", {"expression": "1+1"})]), FakeReply.error(503))
    svc = service(api_keys=KEYS, llm=fake_llm)
    oa = client(svc)
    closing.append(oa)
    received: list[Any] = []

    with pytest.raises(openai.APIError) as caught:
        for chunk in oa.chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTION}], stream=True
        ):
            received.append(chunk)

    assert received and received[0].choices[0].delta.role == "assistant"
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "run_failed"
    fake_llm.assert_done()


def test_answer_replaced_after_synthesis_failed_mid_stream_is_in_the_last_chunk(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, closing: list[Any]
) -> None:
    def handler(body: dict[str, Any]) -> FakeReply:
        if body.get("stream"):
            return FakeReply.stream(["Partial ", "answer ", "that ", "breaks"], cut_after=2)
        return FakeReply.text("The loop's own answer.")

    fake_llm.set_handler(handler)
    svc = service(api_keys=KEYS, llm=fake_llm)
    oa = client(svc)
    closing.append(oa)

    chunks = list(
        oa.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], stream=True)
    )

    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason == "stop")
    ext = last.model_extra["agentstream"]  # type: ignore[index]
    run = svc.api(ALICE_KEY).get_run(ext["run_id"])
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert run["status"] == "completed" and run["error"]
    if streamed == run["answer"]:
        pytest.fail("the fake stream was expected to break before the whole answer was sent")
    assert ext["answer_replaced"] is True
    assert ext["answer"] == run["answer"]


def test_cancelled_run_is_a_409_the_client_does_not_retry(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    release = threading.Event()
    fake_llm.script(FakeReply.blocked(release, then=FakeReply.text("too late")))
    svc = service(api_keys=KEYS, llm=fake_llm)
    api = svc.api(ALICE_KEY)
    outcome: list[BaseException] = []

    def ask() -> None:
        # Default retries: x-should-retry must stop the client from asking again.
        with openai.OpenAI(base_url=f"{svc.base_url}/v1", api_key=ALICE_KEY, timeout=20) as oa:
            try:
                oa.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}])
            except BaseException as exc:
                outcome.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        conversation = wait_until(
            lambda: next(iter(api.http.get("/api/conversations").json()["items"]), None),
            what="the request's conversation",
        )
        fake_llm.wait_for_requests(1)
        assert api.http.post(f"/api/conversations/{conversation['id']}/cancel").status_code == 202
        asker.join(timeout=15)
    finally:
        release.set()
        asker.join(timeout=15)

    assert len(outcome) == 1 and isinstance(outcome[0], openai.ConflictError)
    assert outcome[0].code == "run_cancelled"
    assert len(api.http.get("/api/conversations").json()["items"]) == 1


NOT_TAKEN: list[tuple[dict[str, Any], str]] = [
    ({"model": "m", "messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "   "}]}, "must not be blank"),
    ({"model": "m", "messages": [{"role": "assistant", "content": "hi"}]}, "must be from the user"),
    (
        {"model": "m", "messages": [{"role": "tool", "content": "1", "tool_call_id": "c1"}]},
        "this model runs its own tools",
    ),
    (
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "only text content is supported",
    ),
    ({"model": "m", "messages": [{"role": "user", "content": "x" * 32_001}]}, "longer than 32000"),
    ({"model": "m", "messages": [{"role": "user", "content": "a\u0000b"}]}, "NUL"),
    (
        {
            "model": "m",
            "messages": [{"role": "system", "content": "x" * 8001}, {"role": "user", "content": "hi"}],
        },
        "system messages are longer than 8000",
    ),
]


def test_requests_it_cannot_take_are_400_in_openai_shape_and_store_nothing(demo: Service) -> None:
    api = demo.api(ALICE_KEY)

    for body, param_or_message in NOT_TAKEN:
        response = api.http.post("/v1/chat/completions", json=body)

        assert response.status_code == 400, (param_or_message, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}
        assert param_or_message == error["param"] or param_or_message in error["message"], error
    assert api.http.get("/api/conversations").json()["items"] == []


def test_body_that_is_not_json_is_a_400_in_openai_shape(demo: Service) -> None:
    response = demo.api(ALICE_KEY).http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )

    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the request body is not valid JSON"


def test_models_lists_the_agent(demo: Service, closing: list[Any]) -> None:
    oa = client(demo)
    closing.append(oa)

    models = oa.models.list()

    # The agent on the default model first, then every configured model by name.
    assert [m.id for m in models.data] == ["agentstream", "default"]
    assert oa.models.retrieve("agentstream").id == "agentstream"
    assert oa.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("gpt-4o")


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_route_reads_its_run_as_the_stream_route_does_waiting_at_holes(
    demo: Service, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """Where Redis lost events the route waits for the database to store them, like /api's stream
    (it did not wait at all: a database a moment behind made it skip them)."""
    from app.api.routes import openai_compat
    from app.api.routes.stream import SEAM_WAIT_S

    seen: list[dict[str, Any]] = []
    real = openai_compat.stream_events

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(openai_compat, "stream_events", recording)
    body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "stream": stream}
    response = demo.api(ALICE_KEY).http.post("/v1/chat/completions", json=body)

    assert response.status_code == 200, response.text
    assert [kwargs.get("seam_wait_s") for kwargs in seen] == [SEAM_WAIT_S]
