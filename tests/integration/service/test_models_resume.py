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


def entries(a: FakeOpenAIServer, b: FakeOpenAIServer) -> list[dict[str, Any]]:
    return [
        {"name": "a", "base_url": a.base_url, "api_key": "sk-a", "model": "a-model"},
        {"name": "b", "base_url": b.base_url, "api_key": "sk-b", "model": "b-model"},
    ]


def hand_over_a_run_on_b(
    service: ServiceFactory, a: FakeOpenAIServer, b: FakeOpenAIServer
) -> tuple[str, str]:
    """A run of a conversation on model ``b`` whose worker stops in b's call after the tool's
    result, so that the run is handed over; its conversation and run ids."""
    a.set_handler(ToolAgentBehaviour())
    agent = ToolAgentBehaviour()
    release = threading.Event()

    def hold_the_second_call(body: dict[str, Any]) -> FakeReply:
        reply = agent(body)
        return FakeReply.blocked(release, reply) if len(b.requests) == 2 else reply

    b.set_handler(hold_the_second_call)
    leaving = service(llm_models=json.dumps(entries(a, b)), run_lease_s=1.0)
    conversation = leaving.api().create_conversation({"agent": {"model": "b"}})["id"]
    run_id = leaving.api().start_run(conversation, "What is 6*7?")["run_id"]
    try:
        b.wait_for_requests(2)
        leaving.stop()
    finally:
        release.set()
    return conversation, run_id


def test_a_resumed_run_keeps_calling_the_model_it_started_with(
    service: ServiceFactory, providers: tuple[FakeOpenAIServer, FakeOpenAIServer]
) -> None:
    default, chosen = providers
    conversation, run_id = hand_over_a_run_on_b(service, default, chosen)

    api = service(llm_models=json.dumps(entries(default, chosen)), run_lease_s=1.0).api()
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
    conversation, _ = hand_over_a_run_on_b(service, kept, removed)

    # The next deploy no longer has "b".
    only_a = json.dumps(entries(kept, removed)[:1])
    events = service(llm_models=only_a, run_lease_s=1.0).api().stream(conversation)

    done = events[-1].data
    assert (done["status"], done["model"]) == ("failed", "b")
    assert "'b' is no longer configured" in done["error"]
    assert kept.requests == [], "the run never switched to another model"
