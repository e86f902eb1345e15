"""Many workers (API.md, "Many workers"): uvicorn processes sharing PostgreSQL and the real Redis.

Two workers, A and B, serve the whole module. A run started through one is streamed, interrupted
and cancelled through the other; a worker killed with SIGKILL or stopped with SIGTERM mid-run
has its runs carried on by the others (RUNS.md R-03, R-08), and no client misses an event. The
workers those tests stop are started with A and B, all at once (each start imports the whole
app). The model is the fake OpenAI server in this process, whose loop calls wait for a gate the
test opens: runs last exactly as long as a test needs, with no sleeps.
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from app.db.migrate import upgrade_database
from tests.integration.conftest import PostgresServer, run_in_thread
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    Cluster,
    GatedAgent,
    answer_of,
    as_stored,
    clients_fixture,
    fake_llm_serving,
    new_redis_prefix,
    redis_keys,
    start_stream_interrupt_and_cancel_across_workers,
    thinking,
)
from tests.support.server import ServerProcess, wait_until

# func_only: starting the workers (fixtures) has bounds of its own and may be slow on a busy machine.
pytestmark = [
    pytest.mark.timeout(30, func_only=True),
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.redis,
]


ROLES: dict[str, dict[str, str]] = {"a": {}, "b": {}}
STOPPED_ROLES: dict[str, dict[str, str]] = {
    "killed": {"RUN_LEASE_S": "2"},
    "stalled": {"RUN_LEASE_S": "2"},
    "long-grace": {"SHUTDOWN_GRACE_S": "15"},
    "short-grace": {"SHUTDOWN_GRACE_S": "1"},
}
"""The workers of the module and their settings (RUN_LEASE_S is 2 unless said); those a test stops
start in the background once A and B are up."""


@pytest.fixture(scope="module")
def cluster(postgres_server: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The workers of ``ROLES`` and ``STOPPED_ROLES`` (``cluster.role(name)``) on a PostgreSQL
    database of this module."""
    name = f"agentstream_test_{secrets.token_hex(6)}"
    postgres_server.create_database(name)
    url = postgres_server.async_url(name)
    try:
        run_in_thread(lambda: upgrade_database(url))
        with fake_llm_serving() as llm, redis_keys(new_redis_prefix()) as prefix:
            cluster = Cluster(url, llm, prefix, tmp_path_factory.mktemp("workers"))
            try:
                cluster.start_roles(ROLES)
                cluster.start_roles_in_background(STOPPED_ROLES)
                yield cluster
            finally:
                cluster.close()
    finally:
        postgres_server.drop_database(name)


@pytest.fixture
def a_and_b(cluster: Cluster, clients: Callable[..., Api]) -> Iterator[tuple[Api, Api]]:
    a, b = cluster.role("a"), cluster.role("b")
    for worker in (a, b):
        assert worker.proc is not None and worker.proc.poll() is None, worker.logs()
    yield clients(a.base_url), clients(b.base_url)
    cluster.llm.agent.gate.set()  # nothing a test left waiting may hold the next test up


@pytest.fixture
def worker(cluster: Cluster, request: pytest.FixtureRequest) -> ServerProcess:
    """The worker of the role the test is parametrised with (``indirect``), once it is up."""
    return cluster.role(str(request.param))


def test_a_run_started_on_one_worker_is_streamed_interrupted_and_cancelled_through_another(
    cluster: Cluster, a_and_b: tuple[Api, Api]
) -> None:
    start_stream_interrupt_and_cancel_across_workers(cluster.llm, *a_and_b)


@pytest.mark.parametrize("worker", ["killed"], indirect=True)
def test_a_run_whose_worker_is_killed_mid_answer_is_carried_on_by_another_and_restreamed(
    cluster: Cluster, a_and_b: tuple[Api, Api], clients: Callable[..., Api], worker: ServerProcess
) -> None:
    _, b = a_and_b
    agent = cluster.llm.play(GatedAgent(tokens=400, delay_s=0.01))
    victim = worker
    v = clients(victim.base_url)
    conv = v.create_conversation()
    run_id = v.start_run(conv, "a long answer")

    with b.stream(conv) as stream, v.stream(conv) as on_victim:
        received = stream.read(count=30)
        assert received[-1].event == "answer", "the run should be streaming its answer"
        seen_on_victim = on_victim.read(count=10)
        victim.kill()
        killed = time.monotonic()
        with pytest.raises(httpx.TransportError):
            seen_on_victim += on_victim.read()
        received += stream.read()
        took = time.monotonic() - killed
    # A client of the dead worker reconnects to the survivor with its cursor and misses nothing.
    with b.stream(conv, last_event_id=seen_on_victim[-1].id) as stream:
        seen_on_victim += stream.read()
    assert as_stored(seen_on_victim) == as_stored(received)
    done = received[-1]
    assert done.event == "done"
    assert done.data["status"] == "completed", done.data
    assert took < 8.0, f"the run was carried on and finished {took:.1f}s after the kill"
    # The new attempt says where it starts again, and streams the whole answer again.
    (resumed,) = [e for e in received if e.event == "phase" and e.data.get("phase") == "resumed"]
    assert resumed.data["attempt"] == 2
    after_resume = as_stored(received[received.index(resumed) + 1 :])
    assert answer_of(after_resume) == done.data["answer"] == agent.answer
    run = b.run(run_id)
    assert (run["status"], run["attempt"], run["answer"]) == ("completed", 2, agent.answer)
    # What clients saw live is what the database keeps, the lost worker's last events included.
    stored = b.wait_stored(run_id)
    assert as_stored(received) == stored
    ids = [e["id"] for e in stored]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    assert len(set(ids)) == len(ids)


def active_runs(worker: ServerProcess) -> float:
    metrics = httpx.get(f"{worker.base_url}/metrics", timeout=5).text
    line = next(line for line in metrics.splitlines() if line.startswith("agentstream_active_runs "))
    return float(line.split()[1])


@pytest.mark.parametrize("worker", ["stalled"], indirect=True)
def test_a_worker_that_stalls_past_its_lease_stops_the_run_another_worker_carried_on(
    cluster: Cluster, a_and_b: tuple[Api, Api], clients: Callable[..., Api], worker: ServerProcess
) -> None:
    _, b = a_and_b
    agent = cluster.llm.play(GatedAgent(tokens=5))
    assert worker.proc is not None
    w = clients(worker.base_url)
    conv = w.create_conversation()
    agent.close_gate()
    run_id = w.start_run(conv, "question")

    with b.stream(conv) as stream:
        received = stream.read(until=thinking)
        wait_until(lambda: agent.loop_calls == 1, what="the model call")
        worker.proc.send_signal(signal.SIGSTOP)
        try:
            # The other workers take it for dead and carry the run on: its next model call.
            received += stream.read(until=lambda e: e.event == "phase" and e.data.get("phase") == "resumed")
            wait_until(lambda: agent.loop_calls == 2, what="the new attempt's model call")
        finally:
            worker.proc.send_signal(signal.SIGCONT)
        # Awake again, the stalled worker sees that another attempt holds the run and stops its
        # own, before its held model call returns anything.
        wait_until(lambda: active_runs(worker) == 0, timeout=10, what="the stalled worker to drop its run")
        agent.gate.set()
        received += stream.read()
    assert received[-1].event == "done"
    assert received[-1].data["status"] == "completed"
    run = w.run(run_id)
    assert (run["status"], run["attempt"]) == ("completed", 2)
    stored = b.wait_stored(run_id)
    assert as_stored(received) == stored, "events of the stalled attempt came after the resume"
    # The conversation is usable on that worker again.
    next_id = w.start_run(conv, "again")
    assert w.wait_finished(next_id)["status"] == "completed"


def sigterm(worker: ServerProcess) -> None:
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGTERM)


def refuses_connections(worker: ServerProcess) -> bool:
    try:
        httpx.get(f"{worker.base_url}/healthz", timeout=1)
    except httpx.TransportError:
        return True
    return False


@pytest.mark.parametrize(
    ("worker", "finishes_in_grace"),
    [("long-grace", True), ("short-grace", False)],
    ids=["finishes", "outlives-grace"],
    indirect=["worker"],
)
def test_sigterm_ends_the_workers_streams_and_its_runs_finish_or_are_handed_over(
    finishes_in_grace: bool,
    cluster: Cluster,
    a_and_b: tuple[Api, Api],
    clients: Callable[..., Api],
    worker: ServerProcess,
) -> None:
    _, b = a_and_b
    agent = cluster.llm.play(GatedAgent(tokens=20))
    w = clients(worker.base_url)
    conv = w.create_conversation()
    agent.close_gate()
    run_id = w.start_run(conv, "question")

    with w.stream(conv) as stream:
        received = stream.read(until=thinking)
        sigterm(worker)
        # The worker ends its open stream (no done: the run goes on) ...
        received += stream.read()
    assert received[-1].event != "done"
    # ... and takes no more requests, while its run still has the grace period.
    wait_until(lambda: refuses_connections(worker), timeout=5, what="the worker to stop listening")
    assert b.run(run_id)["status"] == "running"

    # The client reconnects to another worker with its cursor and misses nothing.
    with b.stream(conv, last_event_id=received[-1].id) as stream:
        if finishes_in_grace:
            agent.gate.set()
        else:
            # Past the grace the worker hands the run over: another carries it on at once.
            received += stream.read(until=lambda e: e.event == "phase" and e.data.get("phase") == "resumed")
            agent.gate.set()
        received += stream.read()
    done = received[-1]
    assert done.event == "done"
    assert worker.proc is not None
    # uvicorn re-raises the SIGTERM it handled once it is done: exit by that signal is a clean exit.
    assert worker.proc.wait(timeout=10) in (0, -signal.SIGTERM), worker.logs()
    assert "Traceback" not in worker.logs()
    run = b.run(run_id)
    assert done.data["status"] == run["status"] == "completed"
    assert done.data["answer"] == agent.answer
    assert run["attempt"] == (1 if finishes_in_grace else 2)
    assert as_stored(received) == b.wait_stored(run_id)
    conversation = b.http.get(f"/api/conversations/{conv}").json()
    assert conversation["active_run_id"] is None
