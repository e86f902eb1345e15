"""Many workers on one host: uvicorn processes sharing one SQLite file; and a worker without Redis.

With Redis, two processes on one SQLite file (WAL, busy timeout) serve one another's runs. Without
Redis a single process serves, and a run its crashed predecessor left ``running`` is closed as
``failed`` by the next one's reaper once its lease runs out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    Cluster,
    FakeLLM,
    GatedAgent,
    as_stored,
    clients_fixture,
    gated_llm_fixture,
    new_redis_prefix,
    redis_keys,
    service_settings,
    start_stream_interrupt_and_cancel_across_workers,
    thinking,
)
from tests.support.server import ServerThread, wait_until

pytestmark = [pytest.mark.timeout(30), pytest.mark.slow]


@pytest.fixture
def sqlite_file(sqlite_migrated_template: Path, tmp_path: Path) -> str:
    """A migrated SQLite file of this test alone, as a database URL."""
    path = tmp_path / "shared.db"
    path.write_bytes(sqlite_migrated_template.read_bytes())
    return f"sqlite+aiosqlite:///{path}"


@pytest.fixture
def cluster_on(gated_llm: FakeLLM, tmp_path: Path) -> Iterator[Callable[[str, bool], Cluster]]:
    made: list[Cluster] = []

    def make(database_url: str, redis: bool) -> Cluster:
        prefix = stack.enter_context(redis_keys(new_redis_prefix())) if redis else None
        cluster = Cluster(database_url, gated_llm, prefix, tmp_path)
        made.append(cluster)
        return cluster

    with ExitStack() as stack:
        yield make
        for cluster in made:
            cluster.close()


@pytest.mark.redis
def test_two_workers_sharing_one_sqlite_file_serve_each_others_runs(
    sqlite_file: str, cluster_on: Callable[[str, bool], Cluster], clients: Callable[..., Api]
) -> None:
    cluster = cluster_on(sqlite_file, True)
    a, b = cluster.start(2)
    start_stream_interrupt_and_cancel_across_workers(cluster.llm, clients(a.base_url), clients(b.base_url))


def test_without_redis_a_run_left_running_by_a_crashed_worker_is_closed_by_the_next_ones_reaper(
    sqlite_file: str,
    cluster_on: Callable[[str, bool], Cluster],
    clients: Callable[..., Api],
) -> None:
    cluster = cluster_on(sqlite_file, False)
    agent = cluster.llm.play(GatedAgent(tokens=5))
    agent.close_gate()
    (crashing,) = cluster.start(1, RUN_LEASE_S="1")
    api = clients(crashing.base_url)
    conv = api.create_conversation()
    run_id = api.start_run(conv, "question")
    with api.stream(conv) as stream:
        before = stream.read(until=thinking)
        wait_until(lambda: agent.loop_calls == 1, what="the model call")
        crashing.kill()

    # The next worker (in this process: it shares nothing with the dead one but the file).
    settings = service_settings(sqlite_file, cluster.llm.base_url, run_lease_s=1.0)
    successor = ServerThread(settings).start()
    try:
        after = clients(successor.base_url)
        run = after.wait_finished(run_id, timeout=10)
        assert run["status"] == "failed"
        assert "lease expired" in run["error"]
        stored = after.wait_stored(run_id)
        assert stored[-1]["data"]["status"] == "failed"
        assert stored[: len(before)] == as_stored(before)
        with after.stream(conv) as stream:
            assert as_stored(stream.read()) == stored
        # The conversation takes runs again.
        agent.gate.set()
        next_id = after.start_run(conv, "again")
        assert after.wait_finished(next_id)["status"] == "completed"
    finally:
        successor.stop()
