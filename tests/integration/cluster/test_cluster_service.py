"""Workers on a Redis Cluster (``REDIS_CLUSTER=true``, RUNS.md S-01) serve one another's runs as on
one Redis: uvicorn processes "a" and "b" on one SQLite file and the shared test cluster stream,
interrupt and cancel a run started through the other, resume a stream from its cursor, take a
decision on a run the other parked for approval, and carry on the run of a third worker killed
mid-run (its client reconnecting with its cursor misses nothing); and a run queued on a full
worker is taken at once by another with room, told over the cluster's pub/sub (in-thread servers
of their own, with a claim loop too slow to be the one). Every key they leave carries its
conversation as hash tag."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from redis.cluster import RedisCluster

from app.runs import takeover
from tests.integration.cluster.service_support import in_order, start_on_cluster
from tests.integration.service.test_approvals import approvals_of, decide, observation, waiting_run
from tests.integration.service.test_run_queue import holder, phases, started
from tests.integration.service.test_workers_sqlite import migrated_copy
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    Cluster,
    FakeLLM,
    GatedAgent,
    as_stored,
    clients_fixture,
    start_stream_interrupt_and_cancel_across_workers,
    thinking,
)
from tests.support.redis_cluster import shared_cluster_prefix
from tests.support.server import ServerProcess, wait_until
from tests.support.services import REDIS_CLUSTER_URL

# func_only: starting the workers (fixtures) has bounds of its own and may be slow on a busy machine.
pytestmark = [pytest.mark.timeout(30, func_only=True), pytest.mark.slow, pytest.mark.redis]


@pytest.fixture(autouse=True)
def _open_gate_after(llm: FakeLLM) -> Iterator[None]:
    yield
    llm.agent.gate.set()


@pytest.fixture(scope="module")
def prefix() -> Iterator[str]:
    """A key prefix private to the module; its keys are deleted from every master afterwards."""
    with shared_cluster_prefix() as (_, prefix):
        yield prefix


@pytest.fixture(scope="module")
def workers(
    llm: FakeLLM, prefix: str, sqlite_migrated_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Workers "a" and "b" on one SQLite file and the Redis Cluster, and "killed" (started in the
    background once they are up), which a test kills. RUN_LEASE_S is 2: the claim loops look
    every 2/3 s."""
    directory = tmp_path_factory.mktemp("cluster-workers")
    workers = Cluster(migrated_copy(sqlite_migrated_template, directory), llm, None, directory)
    on_cluster = {"REDIS_URL": str(REDIS_CLUSTER_URL), "REDIS_CLUSTER": "true", "REDIS_KEY_PREFIX": prefix}
    try:
        workers.start_roles({"a": on_cluster, "b": on_cluster})
        workers.start_roles_in_background({"killed": on_cluster})
        yield workers
    finally:
        workers.close()


@pytest.fixture
def pair(workers: Cluster) -> tuple[ServerProcess, ServerProcess]:
    return workers.role("a"), workers.role("b")


def test_two_workers_on_a_redis_cluster_serve_each_others_runs(
    llm: FakeLLM, pair: tuple[ServerProcess, ServerProcess], clients: Callable[..., Api]
) -> None:
    a, b = (clients(worker.base_url) for worker in pair)
    for api in (a, b):
        ready = api.http.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"]["event_bus"] == "ok"
    start_stream_interrupt_and_cancel_across_workers(llm, a, b)


def test_a_stream_resumes_from_its_cursor_on_the_other_worker(
    llm: FakeLLM, pair: tuple[ServerProcess, ServerProcess], clients: Callable[..., Api], prefix: str
) -> None:
    a, b = (clients(worker.base_url) for worker in pair)
    agent = llm.play(GatedAgent(tokens=20, delay_s=0.002))
    agent.close_gate()
    conv = a.create_conversation()
    run_id = a.start_run(conv, "question")
    with b.stream(conv) as stream:
        before = stream.read(until=thinking)
    with a.stream(conv, last_event_id=before[-1].id) as stream:
        agent.gate.set()
        rest = stream.read()
    assert rest[-1].event == "done" and rest[-1].data["status"] == "completed"
    assert as_stored(before + rest) == a.wait_stored(run_id)
    # The conversation's keys carry it as hash tag: its operations stay on one slot.
    cluster = RedisCluster.from_url(str(REDIS_CLUSTER_URL))
    try:
        keys = [k.decode() for k in cluster.scan_iter(match=f"{prefix}:*{conv}*", count=1000)]
        assert f"{prefix}:events:{{{conv}}}" in keys
        assert all(f"{{{conv}}}" in key for key in keys), keys
    finally:
        cluster.close()


def test_a_run_parked_for_approval_on_one_worker_goes_on_when_the_other_takes_the_decision(
    llm: FakeLLM, pair: tuple[ServerProcess, ServerProcess], clients: Callable[..., Api]
) -> None:
    """RUNS.md A-01..A-03 on the cluster: the calculator call waits on A; B shows the run waiting,
    streams it, takes the approval, and the run goes on to its end."""
    a, b = (clients(worker.base_url) for worker in pair)
    agent = llm.play(GatedAgent())
    conv, run_id, _ = waiting_run(a, llm)
    (pending,) = b.run(run_id)["pending_approvals"]

    with b.stream(conv) as stream:
        seen = stream.read(until=lambda e: e.event == "approval")
        decided = decide(b, conv, pending["approval_id"], decision="approve")
        assert decided.status_code == 200, decided.text
        seen += stream.read()

    events = as_stored(seen)
    assert [d["status"] for d in approvals_of(events)] == ["requested", "approved"]
    assert approvals_of(events)[0]["approval_id"] == pending["approval_id"]
    assert observation(events, "calculator") == "6*7 = 42"
    assert seen[-1].event == "done" and seen[-1].data["status"] == "completed", seen[-1]
    assert seen[-1].data["answer"] == agent.answer
    run = a.run(run_id)
    assert (run["status"], run["pending_approvals"]) == ("completed", [])
    assert events == a.wait_stored(run_id)


def test_a_run_whose_worker_is_killed_is_carried_on_by_another_and_its_client_misses_nothing(
    llm: FakeLLM, workers: Cluster, pair: tuple[ServerProcess, ServerProcess], clients: Callable[..., Api]
) -> None:
    """RUNS.md R-03, R-09 on the cluster: the worker running the run is SIGKILLed in its model
    call; a worker of the same host sees the process gone and takes the run at once (attempt 2,
    ``resumed``); the dead worker's client reconnects to B with its cursor and gets the rest, and
    a client of B all along gets the same events; both are what the database keeps."""
    _, b = (clients(worker.base_url) for worker in pair)
    victim = workers.role("killed")
    v = clients(victim.base_url)
    agent = llm.play(GatedAgent(tokens=8))
    agent.close_gate()
    conv = v.create_conversation()
    run_id = v.start_run(conv, "question")

    with b.stream(conv) as watching, v.stream(conv) as on_victim:
        before = on_victim.read(until=thinking)
        watched = watching.read(until=thinking)
        wait_until(lambda: agent.loop_calls == 1, what="the model call on the worker to kill")
        victim.kill()
        with pytest.raises(httpx.TransportError):
            before += on_victim.read()
        wait_until(lambda: agent.loop_calls == 2, timeout=10, what="another worker to carry the run on")
        agent.gate.set()
        watched += watching.read()
    with b.stream(conv, last_event_id=before[-1].id) as stream:
        rest = stream.read()

    resumed = [e.data for e in rest if e.event == "phase" and e.data.get("phase") == "resumed"]
    assert resumed == [{"phase": "resumed", "attempt": 2, "after": resumed[0]["after"], "run_id": run_id}]
    done = rest[-1]
    assert (done.event, done.data["status"], done.data["answer"]) == ("done", "completed", agent.answer)
    run = b.run(run_id)
    assert (run["status"], run["attempt"]) == ("completed", 2)
    stored = b.wait_stored(run_id)
    assert as_stored(before + rest) == as_stored(watched) == stored
    assert in_order([e["id"] for e in stored])


def test_a_run_queued_on_a_full_worker_is_taken_at_once_by_another_with_room(
    llm: FakeLLM,
    clients: Callable[..., Api],
    sqlite_migrated_template: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RUNS.md Q-01 on the cluster: the full worker announces the queued run over the cluster's
    pub/sub and the other takes it at once. The servers' claim loops look only every 10 s here,
    so a take within 5 s is the announcement's."""
    monkeypatch.setattr(takeover, "CLAIM_INTERVAL_S", 60.0)  # the loops look every RUN_LEASE_S/3
    database = migrated_copy(sqlite_migrated_template, tmp_path)
    agent = llm.play(GatedAgent(tokens=5))
    with shared_cluster_prefix() as (url, prefix):
        full = start_on_cluster(database, llm, url, prefix, max_active_runs=1, run_lease_s=30.0)
        roomy = start_on_cluster(database, llm, url, prefix, max_active_runs=2, run_lease_s=30.0)
        try:
            api = clients(full.base_url)
            agent.close_gate()
            first = started(api, api.create_conversation(), "first question", "running")
            wait_until(lambda: agent.loop_calls >= 1, what="the first run at work")

            second = started(api, api.create_conversation(), "second question", "queued")

            wait_until(lambda: api.run(second)["status"] == "running", timeout=5, what="the queued run taken")
            wait_until(lambda: agent.loop_calls >= 2, what="the second run at work")
            assert holder(database, second) == roomy.services.manager.worker_id
            assert api.run(first)["status"] == "running"
            agent.gate.set()
            assert [api.wait_finished(r)["status"] for r in (first, second)] == ["completed", "completed"]
            names = [p["phase"] for p in phases(api, second)]
            assert names[0] == "queued" and "resumed" not in names
        finally:
            agent.gate.set()
            roomy.stop()
            full.stop()
