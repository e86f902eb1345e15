"""Replaying a run from one of its checkpoints through the real service (FACES.md B-06, B-07): the
fake model over a socket, a real MCP server over stdio whose journal counts its tool calls, SQLite
and PostgreSQL, a real HTTP client.

A replay is a new run answering the same question, a sibling answer: its events start with a
``replay`` phase and the source's steps up to the checkpoint, restated; the tool results the
checkpoint holds are given to the model again, the tools are not called again; its usage counts
its own calls; it may go on on another model of the same mode.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.durable.support import PlanAgent, mcp_servers
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    GatedAgent,
    answer_of,
    clients_fixture,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import ToolAgentBehaviour, _forced_function
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.server import ServerThread, wait_until

pytestmark = pytest.mark.timeout(60)

KEYS = ["alpha", "beta", "gamma"]


def completed(api: Api, run_id: str) -> dict[str, Any]:
    run = api.wait_finished(run_id, timeout=30)
    assert run["status"] == "completed", run
    return run


def replay(api: Api, run_id: str, **body: Any) -> httpx.Response:
    return api.http.post(f"/api/runs/{run_id}/replay", json=body)


def replayed(api: Api, run_id: str, **body: Any) -> str:
    """Replay ``run_id`` with ``body``; the new run's id once it completed."""
    response = replay(api, run_id, **body)
    assert response.status_code == 202, response.text
    started = response.json()
    assert started["run_id"] != run_id and started["status"] in ("running", "queued"), started
    completed(api, started["run_id"])
    return str(started["run_id"])


def steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The data of the ``step`` events, without their run id."""
    return [{k: v for k, v in e["data"].items() if k != "run_id"} for e in events if e["event"] == "step"]


def tool_results(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        e
        for e in events
        if e["event"] == "step" and e["data"].get("type") == "iteration" and e["data"]["status"] == "done"
    ]


def journal_calls(journal: Path) -> list[tuple[str, str, str]]:
    """Every call the MCP server ran: (its argument, the run whose call it was, start or end)."""
    if not journal.exists():
        return []
    entries = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
    return [(e["arg"], str(e["key"]).split(":", 1)[0], e["at"]) for e in entries]


def loop_calls(requests: list[dict[str, Any]]) -> list[list[tuple[str, str | None]]]:
    """The messages (role, content) of each loop call of ``requests``, the system prompt left out."""
    return [
        [(m["role"], m.get("content")) for m in body["messages"][1:]]
        for body in requests
        if not body.get("stream") and _forced_function(body) is None
    ]


def test_a_replay_after_the_third_tool_result_reuses_the_results_without_calling_the_tools_again(
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
    tmp_path: Path,
) -> None:
    journal = tmp_path / "mcp.journal"
    agent = PlanAgent(plan=[[("files__lookup", {"key": key})] for key in KEYS])
    agent.release.set()
    gated_llm.play(agent)  # type: ignore[arg-type]
    fake = gated_llm.server
    api = clients(start_service(redis=False, mcp_servers=mcp_servers(journal)).base_url)
    conv = api.create_conversation(completion_check=False, tools=["files__lookup"])
    source = api.start_run(conv, "look the three keys up")
    source_run = completed(api, source)
    source_events = api.wait_stored(source)
    results = tool_results(source_events)
    assert [r["data"]["observation"] for r in results] == [f"lookup {key}: done" for key in KEYS]
    calls = journal_calls(journal)
    assert calls == [(key, source, at) for key in KEYS for at in ("start", "end")]
    assert source_run["usage"]["llm_calls"] == len(fake.requests) == 5  # 4 loop calls, the answer
    before = api.http.get(f"/api/conversations/{conv}").json()["messages"]
    after = results[2]["id"]
    asked = len(fake.requests)

    new = replayed(api, source, after=after)

    assert journal_calls(journal) == calls, "a tool whose result was checkpointed ran again"
    run = api.run(new)
    assert (run["replay_of"], run["answer"], run["model"]) == (source, agent.answer, source_run["model"])
    events = api.wait_stored(new)
    assert events[0]["data"] == {"phase": "replay", "source_run_id": source, "after": after, "run_id": new}
    assert {e["data"]["run_id"] for e in events} == {new}
    # The source's steps up to that event, restated as the new run's own.
    kept = [e for e in source_events if e["id"] <= after and e["event"] == "step"]
    restated = [{**e["data"], "source_event": e["id"]} for e in kept]
    assert steps(events)[: len(restated)] == steps([{"event": "step", "data": d} for d in restated])
    assert len(tool_results(events[: len(restated) + 1])) == 3
    assert answer_of(events) == events[-1]["data"]["answer"] == agent.answer
    # The model got the three results from the checkpoint, in one loop call, then the synthesis.
    new_requests = fake.requests[asked:]
    assert run["usage"]["llm_calls"] == len(new_requests) == 2
    (loop,) = loop_calls(new_requests)
    assert [content for role, content in loop if role == "tool"] == [f"lookup {key}: done" for key in KEYS]
    assert loop[0] == ("user", "look the three keys up")
    assert api.run(source)["usage"] == source_run["usage"]
    # A sibling answer to the same stored question.
    now = api.http.get(f"/api/conversations/{conv}").json()["messages"]
    assert now[0] == before[0]
    assert now[1]["parent_id"] == before[0]["id"]
    assert now[1]["sibling_ids"] == [before[1]["id"], now[1]["id"]]
    assert {m["run_id"] for m in now[1:]} == {new}
    assert [(m["role"], m["content"]) for m in now] == [
        *[(m["role"], m["content"]) for m in before[:-1]],
        ("assistant", agent.answer),
    ]

    # A replay of the replay from one of its restated steps (the second result): the source's
    # checkpoint there is used, so no tool runs again there either (the third one does, anew).
    restated_second = tool_results(events)[1]["id"]
    twice = replayed(api, new, after=restated_second)
    assert api.run(twice)["replay_of"] == source
    assert journal_calls(journal) == [*calls, ("gamma", twice, "start"), ("gamma", twice, "end")]
    calls = journal_calls(journal)

    # From the third call's start, before its result: only that call is made again, by the replay.
    again = replayed(api, source, after=_start_of(source_events, "gamma"))
    assert journal_calls(journal) == [*calls, ("gamma", again, "start"), ("gamma", again, "end")]


def _start_of(events: list[dict[str, Any]], key: str) -> str:
    (start,) = [
        e["id"]
        for e in events
        if e["event"] == "step"
        and e["data"].get("type") == "iteration"
        and e["data"]["status"] == "start"
        and e["data"]["tool_args"] == {"key": key}
    ]
    return str(start)


@pytest.fixture
def providers() -> Iterator[tuple[FakeOpenAIServer, FakeOpenAIServer]]:
    first, second = FakeOpenAIServer(model="a-model").start(), FakeOpenAIServer(model="b-model").start()
    try:
        first.set_handler(ToolAgentBehaviour())
        second.set_handler(ToolAgentBehaviour())
        yield first, second
    finally:
        first.stop()
        second.stop()


def test_a_replay_on_another_model_makes_its_calls_there_and_a_model_of_another_mode_is_refused(
    start_service: Callable[..., ServerThread],
    providers: tuple[FakeOpenAIServer, FakeOpenAIServer],
    clients: Callable[..., Api],
) -> None:
    a, b = providers
    models = [
        {"name": "a", "base_url": a.base_url, "api_key": "sk-a", "model": "a-model"},
        {"name": "b", "base_url": b.base_url, "api_key": "sk-b", "model": "b-model"},
        # Same provider as b, but without native tool calls: JSON mode.
        {
            "name": "b-json",
            "base_url": b.base_url,
            "api_key": "sk-b",
            "model": "b-model",
            "abilities": ["json_mode", "streaming"],
        },
    ]
    api = clients(start_service(redis=False, llm_models=json.dumps(models)).base_url)
    conv = api.create_conversation(model="a")
    source = api.start_run(conv, "what is 6*7?")
    assert completed(api, source)["model"] == "a"
    source_events = api.wait_stored(source)
    (result,) = tool_results(source_events)
    assert result["data"]["observation"] == "6*7 = 42"
    on_a = len(a.requests)
    assert on_a == 3 and b.requests == []

    refused = {
        "another mode": replay(api, source, after=result["id"], model="b-json"),
        "unknown": replay(api, source, after=result["id"], model="c"),
    }
    assert {k: r.status_code for k, r in refused.items()} == {"another mode": 422, "unknown": 422}
    assert all(r.json()["error"]["code"] == "invalid_request" for r in refused.values())
    assert api.http.get(f"/api/conversations/{conv}").json()["active_run_id"] is None

    new = replayed(api, source, after=result["id"], model="b")

    run = api.run(new)
    assert (run["model"], run["replay_of"]) == ("b", source)
    events = api.wait_stored(new)
    assert events[-1]["data"]["model"] == "b"
    assert len(a.requests) == on_a, "no call of the replay went to the source's model"
    assert run["usage"]["llm_calls"] == len(b.requests) == 2  # the loop call after the result, the answer
    (loop,) = loop_calls(b.requests)
    assert loop[-1] == ("tool", "6*7 = 42")
    assert b.requests[0]["model"] == "b-model"
    assert api.run(source)["model"] == "a"


def test_replay_refuses_unknown_and_foreign_runs_and_events_and_waits_for_the_active_run(
    start_service: Callable[..., ServerThread], gated_llm: FakeLLM, clients: Callable[..., Api]
) -> None:
    server = start_service(redis=False, api_keys="alice:key-alice,bob:key-bob")
    alice, bob = clients(server.base_url), clients(server.base_url)
    alice.http.headers["Authorization"] = "Bearer key-alice"
    bob.http.headers["Authorization"] = "Bearer key-bob"
    agent: GatedAgent = gated_llm.agent
    conv = alice.create_conversation()
    source = alice.start_run(conv, "first question")
    completed(alice, source)
    event = alice.wait_stored(source)[0]["id"]
    later = alice.start_run(conv, "second question")
    completed(alice, later)
    of_later = alice.wait_stored(later)[0]["id"]
    before = alice.http.get(f"/api/conversations/{conv}").json()

    not_found = {
        "unknown run": replay(alice, "run_" + "x" * 22, after=event),
        "unknown event": replay(alice, source, after="0-0"),
        "another run's event": replay(alice, source, after=of_later),
        "another owner's run": replay(bob, source, after=event),
    }
    invalid = {
        "no event": replay(alice, source),
        "empty event": replay(alice, source, after=""),
        "unknown field": replay(alice, source, after=event, attempt=1),
        "empty model": replay(alice, source, after=event, model=""),
        "unknown model": replay(alice, source, after=event, model="nope"),
    }
    assert {k: r.status_code for k, r in not_found.items()} == dict.fromkeys(not_found, 404)
    assert {k: r.status_code for k, r in invalid.items()} == dict.fromkeys(invalid, 422)
    assert alice.http.get(f"/api/conversations/{conv}").json() == before

    agent.close_gate()
    active = alice.start_run(conv, "third question")
    first_event = wait_until(lambda: alice.events(active), timeout=10, what="the active run's first event")
    busy = {
        "another run": replay(alice, source, after=event),
        "the active run": replay(alice, active, after=first_event[0]["id"]),
    }
    assert {k: (r.status_code, r.json()["error"]["code"]) for k, r in busy.items()} == dict.fromkeys(
        busy, (409, "run_active")
    )
    agent.gate.set()
    completed(alice, active)
    new = replayed(alice, source, after=event)
    assert alice.run(new)["replay_of"] == source
