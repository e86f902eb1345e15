"""Many workers on one host: uvicorn processes sharing one SQLite file; and a worker without Redis.

With Redis, two processes on one SQLite file (WAL, busy timeout) serve one another's runs. Without
Redis a single process serves, and a run its crashed predecessor left ``running`` is carried on by
the next one (RUNS.md R-09).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from app.db.repositories import EventRepo
from app.db.session import Database
from app.streaming.bus import StoredEvent
from tests.integration.conftest import run_in_own_loop
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    Cluster,
    FakeLLM,
    GatedAgent,
    as_stored,
    clients_fixture,
    fake_llm_serving,
    new_redis_prefix,
    redis_keys,
    service_settings,
    start_stream_interrupt_and_cancel_across_workers,
    thinking,
)
from tests.support.server import ServerProcess, ServerThread, wait_until

# func_only: starting the workers (fixtures) has bounds of its own and may be slow on a busy machine.
pytestmark = [pytest.mark.timeout(30, func_only=True), pytest.mark.slow]


def migrated_copy(template: Path, directory: Path) -> str:
    """A copy of the migrated SQLite template in ``directory``, as a database URL."""
    path = directory / "agentstream.db"
    path.write_bytes(template.read_bytes())
    return f"sqlite+aiosqlite:///{path}"


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with fake_llm_serving() as fake:
        yield fake


@pytest.fixture(scope="module")
def clusters(
    llm: FakeLLM, sqlite_migrated_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Cluster]]:
    """All the workers of the module, started in the background at once (each start imports the app).

    "shared-file": workers "a" and "b" on one SQLite file and Redis; "redisless": a worker
    "crashing" without Redis on a SQLite file of its own.
    """
    shared, redisless = tmp_path_factory.mktemp("shared-sqlite"), tmp_path_factory.mktemp("redisless")
    with redis_keys(new_redis_prefix()) as prefix:
        made = {
            "shared-file": Cluster(migrated_copy(sqlite_migrated_template, shared), llm, prefix, shared),
            "redisless": Cluster(migrated_copy(sqlite_migrated_template, redisless), llm, None, redisless),
        }
        try:
            made["shared-file"].start_roles_in_background({"a": {}, "b": {}})
            made["redisless"].start_roles_in_background({"crashing": {"RUN_LEASE_S": "1"}})
            yield made
        finally:
            for cluster in made.values():
                cluster.close()


@pytest.fixture(autouse=True)
def _open_gate_after(llm: FakeLLM) -> Iterator[None]:
    yield
    llm.agent.gate.set()


@pytest.fixture
def pair_on_one_file(clusters: dict[str, Cluster]) -> tuple[ServerProcess, ServerProcess]:
    cluster = clusters["shared-file"]
    return cluster.role("a"), cluster.role("b")


@pytest.fixture
def crashing(clusters: dict[str, Cluster]) -> ServerProcess:
    return clusters["redisless"].role("crashing")


@pytest.mark.redis
def test_two_workers_sharing_one_sqlite_file_serve_each_others_runs(
    llm: FakeLLM, pair_on_one_file: tuple[ServerProcess, ServerProcess], clients: Callable[..., Api]
) -> None:
    a, b = (clients(worker.base_url) for worker in pair_on_one_file)
    start_stream_interrupt_and_cancel_across_workers(llm, a, b)


def test_without_redis_a_run_of_a_killed_worker_is_carried_on_by_the_next_one_and_completes(
    clusters: dict[str, Cluster], crashing: ServerProcess, clients: Callable[..., Api]
) -> None:
    """RUNS.md R-09: one process on SQLite with the in-process bus, killed mid-run and started
    again: the run goes on from its last checkpoint and completes, and what its client saw before
    the kill is what the database keeps (the in-process bus only carries stored events)."""
    cluster = clusters["redisless"]
    agent = cluster.llm.play(GatedAgent(tokens=5))
    agent.close_gate()
    api = clients(crashing.base_url)
    conv = api.create_conversation()
    run_id = api.start_run(conv, "question")
    with api.stream(conv) as stream:
        before = stream.read(until=thinking)
        wait_until(lambda: agent.loop_calls == 1, what="the model call")
        crashing.kill()
    assert as_stored(before) == api_events_via_file(cluster, run_id)[: len(before)]

    # The next worker (in this process: it shares nothing with the dead one but the file). The
    # dead one was a process of this host, so its runs need not wait for their leases.
    settings = service_settings(cluster.database_url, cluster.llm.base_url, run_lease_s=30.0)
    successor = ServerThread(settings).start()
    try:
        after = clients(successor.base_url)
        with after.stream(conv, last_event_id=before[-1].id) as stream:
            agent.gate.set()
            rest = stream.read()
        run = after.wait_finished(run_id, timeout=10)
        assert (run["status"], run["attempt"]) == ("completed", 2)
        assert run["answer"] == agent.answer
        resumed = [e.data for e in rest if e.event == "phase" and e.data.get("phase") == "resumed"]
        assert resumed == [{"phase": "resumed", "attempt": 2, "after": resumed[0]["after"], "run_id": run_id}]
        stored = after.wait_stored(run_id)
        assert as_stored(before + rest) == stored
        # The conversation takes runs again.
        next_id = after.start_run(conv, "again")
        assert after.wait_finished(next_id)["status"] == "completed"
    finally:
        successor.stop()


def api_events_via_file(cluster: Cluster, run_id: str) -> list[dict[str, object]]:
    """The run's stored events as ``GET /api/runs/{id}/events`` shows them, read from the file."""

    async def read() -> list[StoredEvent]:
        db = Database(cluster.database_url)
        try:
            return await EventRepo(db.sessionmaker).for_run(run_id)
        finally:
            await db.dispose()

    return [{"id": e.id, "event": e.event, "data": orjson.loads(e.data)} for e in run_in_own_loop(read)]
