"""A run stays on its model (E-02) when another worker carries it on (RUNS.md R-03): the new
attempt reads the model from the run's row, whatever the default is."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.service.conftest import ServiceFactory
from tests.support.fake_agents import ToolAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.fake_replies import FakeReply


@pytest.fixture
def providers() -> Iterator[tuple[FakeOpenAIServer, FakeOpenAIServer]]:
    first, second = FakeOpenAIServer(model="a-model").start(), FakeOpenAIServer(model="b-model").start()
    try:
        yield first, second
    finally:
        first.stop()
        second.stop()


def test_a_resumed_run_keeps_calling_the_model_it_started_with(
    service: ServiceFactory, providers: tuple[FakeOpenAIServer, FakeOpenAIServer]
) -> None:
    default, chosen = providers
    default.set_handler(ToolAgentBehaviour())
    agent = ToolAgentBehaviour()
    release = threading.Event()

    def hold_the_second_call(body: dict[str, Any]) -> FakeReply:
        reply = agent(body)
        return FakeReply.blocked(release, reply) if len(chosen.requests) == 2 else reply

    chosen.set_handler(hold_the_second_call)
    models = json.dumps(
        [
            {"name": "a", "base_url": default.base_url, "api_key": "sk-a", "model": "a-model"},
            {"name": "b", "base_url": chosen.base_url, "api_key": "sk-b", "model": "b-model"},
        ]
    )
    settings = {"llm_models": models, "run_lease_s": 1.0}
    leaving = service(**settings)
    conversation = leaving.api().create_conversation({"agent": {"model": "b"}})["id"]
    run_id = leaving.api().start_run(conversation, "What is 6*7?")["run_id"]
    try:
        chosen.wait_for_requests(2)
        leaving.stop()  # in the call after the tool's result: the run is handed over
    finally:
        release.set()

    api = service(**settings).api()
    events = api.stream(conversation)

    resumed = [e.data["attempt"] for e in events if e.event == "phase" and e.data["phase"] == "resumed"]
    assert resumed == [2]
    assert events[-1].data["status"] == "completed"
    assert events[-1].data["model"] == "b" == api.get_run(run_id)["model"]
    assert default.requests == [], "no call of the run went to the default model"
    assert len(chosen.requests) > 2, "the new attempt called the run's model"


def test_a_run_whose_model_is_no_longer_configured_fails_saying_so_instead_of_switching(
    service: ServiceFactory, providers: tuple[FakeOpenAIServer, FakeOpenAIServer]
) -> None:
    kept, removed = providers
    kept.set_handler(ToolAgentBehaviour())
    agent = ToolAgentBehaviour()
    release = threading.Event()

    def hold_the_second_call(body: dict[str, Any]) -> FakeReply:
        reply = agent(body)
        return FakeReply.blocked(release, reply) if len(removed.requests) == 2 else reply

    removed.set_handler(hold_the_second_call)
    entry_a = {"name": "a", "base_url": kept.base_url, "api_key": "sk-a", "model": "a-model"}
    entry_b = {"name": "b", "base_url": removed.base_url, "api_key": "sk-b", "model": "b-model"}
    leaving = service(llm_models=json.dumps([entry_a, entry_b]), run_lease_s=1.0)
    conversation = leaving.api().create_conversation({"agent": {"model": "b"}})["id"]
    leaving.api().start_run(conversation, "What is 6*7?")
    try:
        removed.wait_for_requests(2)
        leaving.stop()
    finally:
        release.set()

    # The next deploy no longer has "b".
    events = service(llm_models=json.dumps([entry_a]), run_lease_s=1.0).api().stream(conversation)

    done = events[-1].data
    assert (done["status"], done["model"]) == ("failed", "b")
    assert "'b' is no longer configured" in done["error"]
    assert kept.requests == [], "the run never switched to another model"
