"""Deploys and poison runs (RUNS.md R-07, R-08): a worker that stops hands its runs over and another
carries them on at once, without waiting for a lease; a rolling restart of every worker, one by
one, with runs in flight, fails no run (and uses up no attempt: RUN_MAX_ATTEMPTS is 1 here); a run
whose attempts keep killing their worker fails after RUN_MAX_ATTEMPTS.

uvicorn worker processes on PostgreSQL and Redis, with a lease of 30 s: a run that waited for its
lease would outlast the test's read timeout.
"""

from __future__ import annotations

import secrets
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.db.migrate import upgrade_database
from tests.integration.conftest import PostgresServer, run_in_thread
from tests.integration.durable.support import PlanAgent, is_resumed, journal_entries, mcp_servers
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    Cluster,
    SseEvent,
    answer_of,
    as_stored,
    clients_fixture,
    fake_llm_serving,
    new_redis_prefix,
    redis_keys,
    thinking,
)
from tests.support.server import ServerProcess, wait_until

pytestmark = [
    pytest.mark.timeout(90, func_only=True),
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.redis,
]

DEPLOYED = {"RUN_LEASE_S": "30", "SHUTDOWN_GRACE_S": "0.5", "RUN_MAX_ATTEMPTS": "1"}


@pytest.fixture(scope="module")
def cluster(postgres_server: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    name = f"agentstream_test_{secrets.token_hex(6)}"
    postgres_server.create_database(name)
    url = postgres_server.async_url(name)
    folder = tmp_path_factory.mktemp("deploys")
    try:
        run_in_thread(lambda: upgrade_database(url))
        with fake_llm_serving() as llm, redis_keys(new_redis_prefix()) as prefix:
            made = Cluster(url, llm, prefix, folder)
            made.journal = folder / "mcp.journal"  # type: ignore[attr-defined]
            try:
                yield made
            finally:
                made.close()
    finally:
        postgres_server.drop_database(name)


@pytest.fixture(autouse=True)
def workers_go_with_their_test(cluster: Cluster) -> Iterator[None]:
    """Kill whatever worker a test started and left running (it failed half-way): the tests share
    one database, and a worker left over would take the next test's runs with its own settings (a
    rolling restart's RUN_MAX_ATTEMPTS=1 failed the poison run after one lost attempt)."""
    started_before = len(cluster.workers)
    yield
    for worker in cluster.workers[started_before:]:
        worker.kill()


def start(cluster: Cluster, count: int = 1, **settings: str) -> list[ServerProcess]:
    journal: Path = cluster.journal  # type: ignore[attr-defined]
    return cluster.start(count, **{**DEPLOYED, "MCP_SERVERS": mcp_servers(journal), **settings})


def sigterm(worker: ServerProcess) -> None:
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGTERM)
    # uvicorn re-raises the SIGTERM it handled once it is done: exit by that signal is clean.
    assert worker.proc.wait(timeout=30) in (0, -signal.SIGTERM), worker.logs()
    assert "Traceback" not in worker.logs(), worker.logs()


def follow(
    api: Api, conv: str, until: Callable[[SseEvent], bool], after: str | None = None
) -> list[SseEvent]:
    with api.stream(conv, last_event_id=after) as stream:
        return stream.read(until=until)


def test_a_stopping_worker_hands_its_run_over_and_another_carries_it_on_at_once(
    cluster: Cluster, clients: Callable[..., Api]
) -> None:
    agent = cluster.llm.play(PlanAgent(hold="between"))  # type: ignore[arg-type]
    leaving, staying = start(cluster, 2)
    a, b = clients(leaving.base_url), clients(staying.base_url)
    conv = a.create_conversation(completion_check=False)
    run_id = a.start_run(conv, "work through the plan")
    with b.stream(conv) as stream:
        received = stream.read(until=thinking)
        assert agent.reached.wait(30)
        sigterm(leaving)  # the run is in a model call that outlives the grace: it is handed over
        received += stream.read(until=is_resumed)
        agent.release.set()
        received += stream.read()

    done = received[-1]
    assert (done.event, done.data["status"]) == ("done", "completed"), done
    resumed = [e for e in received if is_resumed(e)]
    assert [e.data["attempt"] for e in resumed] == [2]
    assert answer_of(as_stored(received[received.index(resumed[0]) :])) == done.data["answer"] == agent.answer
    run = b.run(run_id)
    assert (run["status"], run["attempt"]) == ("completed", 2)  # a hand-over is not a lost attempt
    assert as_stored(received) == b.wait_stored(run_id)
    sends = [e for e in journal_entries(cluster.journal, run_id) if e["tool"] == "send"]  # type: ignore[attr-defined]
    assert [e["at"] for e in sends] == ["start", "end"]  # done before the hand-over: not again
    metrics = b.http.get("/metrics").text
    assert 'agentstream_runs_resumed_total{cause="handover"} 1.0' in metrics
    staying.stop()


def test_a_rolling_restart_of_every_worker_with_runs_in_flight_fails_no_run(
    cluster: Cluster, clients: Callable[..., Api]
) -> None:
    agent = cluster.llm.play(PlanAgent(plan=[[("calculator", {"expression": "1+1"})]], delay_s=0.02))  # type: ignore[arg-type]
    first = start(cluster, 2)
    apis = [clients(worker.base_url) for worker in first]
    runs: list[tuple[str, str]] = []
    for n in range(4):
        api = apis[n % 2]
        conv = api.create_conversation(completion_check=False)
        runs.append((conv, api.start_run(conv, f"question {n}")))
    watcher = clients(first[1].base_url)
    wait_until(
        lambda: all(any(e["event"] == "answer" for e in watcher.events(run_id)) for _, run_id in runs),
        timeout=30,
        what="every run to be answering",
    )

    # One worker after the other: a new one starts, then an old one stops (handing its runs over).
    survivors = list(first)
    for old in first:
        (new,) = start(cluster)
        survivors.append(new)
        sigterm(old)
        survivors.remove(old)

    reader = clients(survivors[0].base_url)
    for conv, run_id in runs:
        events = follow(reader, conv, lambda e: e.event == "done")
        assert as_stored(events) == reader.wait_stored(run_id)
        run = reader.wait_finished(run_id, timeout=30)
        assert run["status"] == "completed", run
        stored = reader.wait_stored(run_id)
        assert stored[-1]["data"]["answer"] == agent.answer
        resumes = [e for e in stored if e["event"] == "phase" and e["data"].get("phase") == "resumed"]
        tail = stored[stored.index(resumes[-1]) + 1 :] if resumes else stored
        assert answer_of(tail) == agent.answer
        assert events[-1].data["run_id"] == run_id
    for worker in survivors:
        worker.stop()


def test_a_run_whose_attempts_keep_killing_their_worker_fails_after_run_max_attempts(
    cluster: Cluster, clients: Callable[..., Api]
) -> None:
    cluster.llm.play(PlanAgent(plan=[[("files__inspect", {"path": "/etc/poison"})]]))  # type: ignore[arg-type]
    workers = start(cluster, 3, RUN_MAX_ATTEMPTS="2")
    apis = [clients(worker.base_url) for worker in workers]
    conv = apis[0].create_conversation(completion_check=False)
    run_id = apis[0].start_run(conv, "inspect the poison file")

    def closed() -> dict[str, object] | None:
        for api in apis:
            try:
                run = api.run(run_id)
            except Exception:
                continue  # that worker is dead
            return run if run["status"] != "running" else None
        return None

    run = wait_until(closed, timeout=60, what="the poison run to be closed")
    assert run["status"] == "failed"
    assert "lost 2 times" in str(run["error"]) and "RUN_MAX_ATTEMPTS=2" in str(run["error"])
    assert [w.proc is not None and w.proc.poll() is not None for w in workers].count(True) == 2
    inspections = [e for e in journal_entries(cluster.journal, run_id) if e["tool"] == "inspect"]  # type: ignore[attr-defined]
    assert len({e["key"] for e in inspections}) == 1 and len(inspections) == 2  # the same call, twice
    alive = next(
        api for api, w in zip(apis, workers, strict=True) if w.proc is not None and w.proc.poll() is None
    )
    events = alive.wait_stored(run_id)
    assert events[-1]["event"] == "done" and events[-1]["data"]["status"] == "failed"
    for worker in workers:
        worker.stop()
