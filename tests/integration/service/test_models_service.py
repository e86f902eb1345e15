"""Several models through the real service (issue 16, API.md ``LLM_MODELS``): two fake providers,
each with a key of its own, and what reaches which.

Each provider is a ``FakeOpenAIServer`` playing an agent model that answers in its own words and
reports its own token counts, so an answer, a request or a token says which model made it. The
keys are distinctive strings: none may come back in a response body, an event or a log line.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.llm.models import ModelConfigError
from app.main import build_services, close_services
from app.observability import JsonFormatter
from app.settings import Settings
from tests.integration.service.conftest import Api, RunOutcome, Service, ServiceFactory
from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.fake_replies import FakeReply
from tests.support.server import wait_until

KEY_A = "sk-model-a-SECRET-5f0c2e9b"
KEY_B = "sk-model-b-SECRET-a71d44c3"
KEY_R = "sk-model-r-SECRET-c09e8b12"
KEYS = (KEY_A, KEY_B, KEY_R)
QUESTION = "What is 17*23?"
USAGE_A = (11, 3)
USAGE_B = (7, 2)
ABILITIES = {"tool_call": True, "json_mode": True, "streaming": True}


@pytest.fixture
def database_backend() -> str:
    """SQLite unless a test parametrises it: the model choice adds nothing database-specific but
    the run's ``model`` column, which the run-on-b test checks on PostgreSQL too."""
    return "sqlite"


# -- two providers ------------------------------------------------------------------------------


@dataclass
class Provider:
    """One fake provider: its server and the answer its agent model streams."""

    server: FakeOpenAIServer
    answer: str

    @property
    def requests(self) -> list[dict[str, Any]]:
        return self.server.requests

    def authorizations(self) -> set[str]:
        return {
            r.headers.get("authorization", "")
            for r in self.server.received
            if r.path.endswith("/completions")
        }


def agent_provider(name: str, usage: tuple[int, int]) -> Provider:
    behaviour = EchoAgentBehaviour(["Model ", name.upper(), " says ", "391."], usage=usage)
    server = FakeOpenAIServer(model=f"provider-model-{name}").start()
    server.set_handler(behaviour)
    return Provider(server, behaviour.answer)


def failing_provider(reply: FakeReply) -> Provider:
    server = FakeOpenAIServer().start()
    server.set_handler(lambda body: reply)
    return Provider(server, "")


@pytest.fixture
def providers() -> Iterator[Callable[..., Provider]]:
    """``providers(...)`` -> a started ``Provider`` (see ``agent_provider``), stopped after the test."""
    started: list[Provider] = []

    def make(name: str, usage: tuple[int, int] = (10, 5), *, reply: FakeReply | None = None) -> Provider:
        provider = failing_provider(reply) if reply is not None else agent_provider(name, usage)
        started.append(provider)
        return provider

    yield make
    for provider in started:
        provider.server.stop()


@pytest.fixture
def a(providers: Callable[..., Provider]) -> Provider:
    return providers("a", USAGE_A)


@pytest.fixture
def b(providers: Callable[..., Provider]) -> Provider:
    return providers("b", USAGE_B)


def entry(name: str, provider: Provider, key: str, **more: Any) -> dict[str, Any]:
    return {
        "name": name,
        "base_url": provider.server.base_url,
        "api_key": key,
        "model": f"provider-model-{name}",
        "max_retries": 0,
        **more,
    }


def models_setting(*entries: dict[str, Any]) -> str:
    return json.dumps(list(entries))


@pytest.fixture
def two_models(service: ServiceFactory, a: Provider, b: Provider) -> Service:
    """The service with models ``a`` (the default) and ``b``, no fallback."""
    return service(llm_models=models_setting(entry("a", a, KEY_A), entry("b", b, KEY_B)))


# -- reading what came back ---------------------------------------------------------------------


def run_in_new_conversation(api: Api, agent: dict[str, Any] | None = None) -> RunOutcome:
    conversation = api.create_conversation({"agent": agent} if agent is not None else None)
    return api.run(conversation["id"], QUESTION)


def phases(outcome: RunOutcome, phase: str) -> list[dict[str, Any]]:
    return [e.data for e in outcome.events if e.event == "phase" and e.data.get("phase") == phase]


def metric_samples(api: Api) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    # The run's done goes out a moment before its worker lets go of it; after that nothing counts.
    def settled() -> str | None:
        text = api.http.get("/metrics").text
        return text if "agentstream_active_runs 0.0" in text else None

    text = wait_until(settled, what="the active runs gauge to drop to 0")
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and labels.items() <= dict(sample_labels).items()
    )


# -- GET /api/models ----------------------------------------------------------------------------


def test_api_models_lists_each_name_with_its_provider_model_and_the_first_as_default(
    two_models: Service,
) -> None:
    response = two_models.api().http.get("/api/models")

    assert response.status_code == 200
    assert response.json() == [
        {"name": "a", "model": "provider-model-a", "abilities": ABILITIES, "default": True},
        {"name": "b", "model": "provider-model-b", "abilities": ABILITIES, "default": False},
    ]
    # Neither the keys nor where the models are served.
    for secret in (KEY_A, KEY_B, "SECRET", "127.0.0.1", "/v1"):
        assert secret not in response.text


def test_api_models_without_llm_models_is_the_one_default_model(service: ServiceFactory) -> None:
    response = service().api().http.get("/api/models")

    assert response.status_code == 200
    (only,) = response.json()
    assert (only["name"], only["model"], only["default"]) == ("default", "demo", True)


# -- a conversation picks its model -------------------------------------------------------------


@pytest.mark.parametrize("database_backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_conversation_on_model_b_sends_every_call_of_its_runs_to_b_with_bs_key(
    service: ServiceFactory, a: Provider, b: Provider
) -> None:
    svc = service(llm_models=models_setting(entry("a", a, KEY_A), entry("b", b, KEY_B)))
    api = svc.api()
    conversation = api.create_conversation({"agent": {"model": "b"}})

    first = api.run(conversation["id"], QUESTION)
    second = api.run(conversation["id"], "And what is 391+1?")

    assert conversation["agent"]["model"] == "b"
    assert a.requests == []
    assert b.requests, "model b got no call"
    assert {r["model"] for r in b.requests} == {"provider-model-b"}
    assert b.authorizations() == {f"Bearer {KEY_B}"}
    for outcome in (first, second):
        assert outcome.done["status"] == "completed", outcome.done
        assert outcome.done["model"] == "b"
        assert outcome.done["answer"] == b.answer
        assert api.get_run(outcome.run_id)["model"] == "b"
    calls = first.done["usage"]["llm_calls"] + second.done["usage"]["llm_calls"]
    assert calls == len(b.requests)


def test_a_conversation_without_agent_model_runs_on_the_first_entry(
    two_models: Service, a: Provider, b: Provider
) -> None:
    api = two_models.api()

    outcome = run_in_new_conversation(api)

    assert outcome.done["status"] == "completed", outcome.done
    assert (outcome.done["model"], api.get_run(outcome.run_id)["model"]) == ("a", "a")
    assert outcome.done["answer"] == a.answer
    assert b.requests == []
    assert len(a.requests) == outcome.done["usage"]["llm_calls"] > 0
    assert a.authorizations() == {f"Bearer {KEY_A}"}


def test_an_unknown_agent_model_is_refused_with_422_and_nothing_is_stored(
    two_models: Service, a: Provider, b: Provider
) -> None:
    api = two_models.api()
    api.create_conversation({"title": "kept"})
    before = api.snapshot()

    response = api.http.post("/api/conversations", json={"title": "x", "agent": {"model": "c"}})

    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert "'c'" in error["message"]
    assert api.snapshot() == before
    assert a.requests == b.requests == []


# -- /v1 ----------------------------------------------------------------------------------------


def v1_chat(api: Api, model: str, **more: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], **more}
    return api.http.post("/v1/chat/completions", json=body)


def test_v1_chat_completions_with_a_configured_model_runs_on_it(
    two_models: Service, a: Provider, b: Provider
) -> None:
    api = two_models.api()

    response = v1_chat(api, "b")

    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["choices"][0]["message"]["content"] == b.answer
    run = api.get_run(reply["agentstream"]["run_id"])
    assert run["model"] == "b"
    assert a.requests == []
    assert len(b.requests) == run["usage"]["llm_calls"] > 0


def test_v1_chat_completions_streamed_with_a_configured_model_runs_on_it(
    two_models: Service, a: Provider, b: Provider
) -> None:
    api = two_models.api()

    response = v1_chat(api, "b", stream=True)

    assert response.status_code == 200, response.text
    assert b.answer in "".join(
        (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for line in response.text.splitlines()
        if line.startswith("data: {")
    )
    assert a.requests == []
    assert b.requests


def test_v1_chat_completions_with_a_model_of_no_entry_runs_on_the_default(
    two_models: Service, a: Provider, b: Provider
) -> None:
    api = two_models.api()

    response = v1_chat(api, "gpt-4o")

    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["choices"][0]["message"]["content"] == a.answer
    assert api.get_run(reply["agentstream"]["run_id"])["model"] == "a"
    assert b.requests == []
    assert a.requests


def test_v1_models_lists_agentstream_then_every_configured_name(two_models: Service) -> None:
    api = two_models.api()

    listed = api.http.get("/v1/models")
    one = api.http.get("/v1/models/b")
    other = api.http.get("/v1/models/c")

    assert listed.status_code == 200
    assert [m["id"] for m in listed.json()["data"]] == ["agentstream", "a", "b"]
    assert (one.status_code, one.json()["id"]) == (200, "b")
    assert other.status_code == 404
    for body in (listed.text, one.text, other.text):
        assert "SECRET" not in body


# -- fallback -----------------------------------------------------------------------------------


OUTAGE = FakeReply.error(503, headers={"retry-after": "0"})
"""An outage, with no wait before the retry (the client honours ``Retry-After``)."""


def test_a_model_that_stays_unavailable_falls_back_on_every_call_and_usage_counts_both(
    service: ServiceFactory, providers: Callable[..., Provider], b: Provider
) -> None:
    a = providers("a", reply=OUTAGE)
    svc = service(
        llm_models=models_setting(entry("a", a, KEY_A, max_retries=1, fallback="b"), entry("b", b, KEY_B))
    )
    api = svc.api()

    outcome = run_in_new_conversation(api)

    done = outcome.done
    assert done["status"] == "completed", done
    assert done["answer"] == b.answer
    # The run stays bound to its model; each of its calls went to b after two tries on a.
    assert (done["model"], api.get_run(outcome.run_id)["model"]) == ("a", "a")
    fallbacks = phases(outcome, "fallback")
    assert fallbacks == [
        {"phase": "fallback", "from_model": "a", "to_model": "b", "run_id": outcome.run_id}
    ] * len(b.requests)
    assert len(a.requests) == 2 * len(b.requests) > 0
    assert done["usage"]["llm_calls"] == len(a.requests) + len(b.requests)
    # Tokens are b's alone: a reported none.
    assert done["usage"]["prompt_tokens"] == USAGE_B[0] * len(b.requests)
    assert a.authorizations() == {f"Bearer {KEY_A}"}
    assert b.authorizations() == {f"Bearer {KEY_B}"}

    samples = metric_samples(api)
    failed_calls = total(samples, "agentstream_llm_calls_total", model="a", outcome="error")
    assert failed_calls == len(b.requests)
    assert total(samples, "agentstream_llm_calls_total", model="b", outcome="ok") == len(b.requests)


def test_a_refused_request_does_not_fall_back_and_the_run_fails_saying_so(
    service: ServiceFactory, providers: Callable[..., Provider], b: Provider
) -> None:
    refusal = FakeReply.error(
        401, {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error"}}
    )
    a = providers("a", reply=refusal)
    svc = service(
        llm_models=models_setting(entry("a", a, KEY_A, max_retries=3, fallback="b"), entry("b", b, KEY_B))
    )
    api = svc.api()

    outcome = run_in_new_conversation(api)

    done = outcome.done
    assert done["status"] == "failed", done
    assert "refused" in done["error"] and "401" in done["error"], done["error"]
    assert phases(outcome, "fallback") == []
    assert b.requests == []
    assert len(a.requests) == 1  # a refusal is not retried either
    assert api.get_run(outcome.run_id)["status"] == "failed"


# -- keys never leave the process ---------------------------------------------------------------


class LogLines(logging.Handler):
    """Every record, formatted as the service's JSON log line (message, extras, traceback)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record)
        with self._guard:
            self.lines.append(line)

    @property
    def text(self) -> str:
        with self._guard:
            return "\n".join(self.lines)


@pytest.fixture
def service_logs() -> Iterator[LogLines]:
    """What the service logs in this process at DEBUG: the ``app`` logger (which does not
    propagate) and the root logger, which the SDKs under it (openai, httpx) log to."""
    handler = LogLines()
    root = logging.getLogger()
    app = logging.getLogger("app")
    level = root.level
    root.setLevel(logging.DEBUG)
    root.addHandler(handler)
    app.addHandler(handler)
    try:
        yield handler
    finally:
        app.removeHandler(handler)
        root.removeHandler(handler)
        root.setLevel(level)


def test_no_key_reaches_an_answer_an_event_an_error_or_a_log_line(
    service: ServiceFactory,
    providers: Callable[..., Provider],
    b: Provider,
    service_logs: LogLines,
) -> None:
    a = providers("a", reply=OUTAGE)
    # A provider that echoes the key it refused, as some gateways do.
    r = providers("r", reply=FakeReply.error(401, {"error": {"message": f"Invalid API key: {KEY_R}"}}))
    svc = service(
        log_level="DEBUG",
        llm_models=models_setting(
            entry("a", a, KEY_A, max_retries=1, fallback="b"),
            entry("b", b, KEY_B),
            entry("r", r, KEY_R),
        ),
    )
    api = svc.api()

    fell_back = run_in_new_conversation(api)
    refused = run_in_new_conversation(api, {"model": "r"})
    bodies = [
        api.http.get("/api/models").text,
        api.http.get("/v1/models").text,
        api.http.post("/api/conversations", json={"agent": {"model": "nope"}}).text,
        v1_chat(api, "b").text,
        v1_chat(api, "r").text,
        v1_chat(api, "r", stream=True).text,
        api.http.get("/metrics").text,
    ]
    for outcome in (fell_back, refused):
        bodies.extend(e.raw_data for e in outcome.events)
        bodies.append(api.http.get(f"/api/runs/{outcome.run_id}").text)
        bodies.append(api.http.get(f"/api/runs/{outcome.run_id}/events").text)
        bodies.append(api.http.get(f"/api/conversations/{outcome.started['conversation_id']}").text)

    # The runs did what this test is about: a fallback, and a refusal that reached the user.
    assert phases(fell_back, "fallback") and fell_back.done["status"] == "completed"
    assert refused.done["status"] == "failed" and "401" in refused.done["error"]
    assert r.authorizations() == {f"Bearer {KEY_R}"}  # r was called, with its key
    logs = service_logs.text
    # The log was captured, the runs' lines included.
    assert "went to the model's fallback" in logs and "run finished" in logs
    for key in KEYS:
        leaks = [body for body in bodies if key in body]
        assert not leaks, f"{key} in a response: {leaks[0][:500]}"
        assert key not in logs, next(line for line in service_logs.lines if key in line)[:2000]


# -- metrics ------------------------------------------------------------------------------------


def test_metrics_label_llm_calls_latency_and_tokens_with_the_model(
    two_models: Service, a: Provider, b: Provider
) -> None:
    api = two_models.api()

    on_a = run_in_new_conversation(api)
    on_b = run_in_new_conversation(api, {"model": "b"})
    samples = metric_samples(api)

    for name, provider, usage, outcome in (("a", a, USAGE_A, on_a), ("b", b, USAGE_B, on_b)):
        calls = len(provider.requests)
        assert outcome.done["usage"]["llm_calls"] == calls
        assert total(samples, "agentstream_llm_calls_total", model=name) == calls
        assert total(samples, "agentstream_llm_calls_total", model=name, outcome="ok") == calls
        assert total(samples, "agentstream_llm_latency_seconds_count", model=name) == calls
        prompt = total(samples, "agentstream_llm_tokens_total", model=name, type="prompt")
        completion = total(samples, "agentstream_llm_tokens_total", model=name, type="completion")
        assert (prompt, completion) == (usage[0] * calls, usage[1] * calls)
        assert (prompt, completion) == (
            outcome.done["usage"]["prompt_tokens"],
            outcome.done["usage"]["completion_tokens"],
        )
    assert total(samples, "agentstream_llm_calls_total", model="default") == 0


# -- a bad LLM_MODELS stops the start -----------------------------------------------------------


SERVED = "http://127.0.0.1:9/v1"
"""A base URL nothing is asked of: the start must stop before any model is called."""


@pytest.mark.parametrize(
    ("models", "names"),
    [
        pytest.param(
            [
                {"name": "a", "base_url": SERVED, "api_key": KEY_A, "model": "m", "fallback": "b"},
                {"name": "c", "base_url": SERVED, "api_key": KEY_B, "model": "m"},
            ],
            ("'a'", "'b'", "names no entry"),
            id="fallback-names-no-entry",
        ),
        pytest.param(
            [
                {"name": "a", "base_url": SERVED, "api_key": KEY_A, "model": "m"},
                {"name": "b", "base_url": "api.example.com", "api_key": KEY_B, "model": "m"},
            ],
            ("entry 2", "'b'", "base_url"),
            id="entry-with-a-key-and-no-url",
        ),
        pytest.param(
            [{"name": "a", "base_url": SERVED, "apikey": KEY_A, "model": "m"}],
            ("entry 1", "'a'", "apikey"),
            id="key-under-a-misspelt-field",
        ),
        pytest.param(
            [{"name": "a", "base_url": SERVED, "api_key": KEY_A, "model": "m", "max_retries": KEY_B}],
            ("entry 1", "'a'", "max_retries"),
            id="key-in-a-field-that-takes-a-number",
        ),
        pytest.param(
            [
                {"name": "a", "base_url": SERVED, "api_key": KEY_A, "model": "m", "fallback": "b"},
                {"name": "b", "base_url": SERVED, "api_key": KEY_B, "model": "m", "fallback": "a"},
            ],
            ("a -> b -> a", "loop"),
            id="fallbacks-that-loop",
        ),
    ],
)
async def test_a_bad_llm_models_stops_the_start_naming_the_entry_and_no_key(
    tmp_path: Path, models: list[dict[str, Any]], names: tuple[str, ...]
) -> None:
    database = tmp_path / "never-made" / "agentstream.db"
    values: dict[str, Any] = {
        "database_url": f"sqlite+aiosqlite:///{database}",
        "llm_models": json.dumps(models),
        "log_level": "WARNING",
    }
    settings = Settings(_env_file=None, **values)  # type: ignore[call-arg]

    with pytest.raises(ModelConfigError) as raised:
        services = await build_services(settings)
        await close_services(services)  # only if the start went on: the test fails anyway

    message = str(raised.value)
    for name in names:
        assert name in message, message
    for key in KEYS:
        assert key not in message and key not in repr(raised.value)
    assert not database.parent.exists(), "the start opened the database before checking the models"
