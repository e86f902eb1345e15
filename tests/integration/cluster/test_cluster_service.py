"""Two workers on a Redis Cluster (``REDIS_CLUSTER=true``, RUNS.md S-01): uvicorn processes on one
SQLite file and the shared test cluster serve one another's runs as on one Redis: a run started
through one is streamed, interrupted and cancelled through the other, and a stream resumes from its
cursor on either. Every key they leave carries its conversation as hash tag."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis.cluster import RedisCluster

from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    Cluster,
    FakeLLM,
    GatedAgent,
    as_stored,
    clients_fixture,
    fake_llm_serving,
    new_redis_prefix,
    start_stream_interrupt_and_cancel_across_workers,
    thinking,
)
from tests.support.server import ServerProcess
from tests.support.services import REDIS_CLUSTER_URL, unavailable

# func_only: starting the workers (fixtures) has bounds of its own and may be slow on a busy machine.
pytestmark = [pytest.mark.timeout(30, func_only=True), pytest.mark.slow, pytest.mark.redis]


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with fake_llm_serving() as fake:
        yield fake


@pytest.fixture(autouse=True)
def _open_gate_after(llm: FakeLLM) -> Iterator[None]:
    yield
    llm.agent.gate.set()


@pytest.fixture(scope="module")
def prefix() -> Iterator[str]:
    """A key prefix private to the module; its keys are deleted from every master afterwards."""
    if REDIS_CLUSTER_URL is None:
        unavailable("no Redis Cluster to test against (AGENTSTREAM_TEST_REDIS_CLUSTER)")
    prefix = new_redis_prefix()
    try:
        yield prefix
    finally:
        client = RedisCluster.from_url(str(REDIS_CLUSTER_URL))
        try:
            for key in list(client.scan_iter(match=f"{prefix}:*", count=1000)):
                client.delete(key)
        finally:
            client.close()


@pytest.fixture(scope="module")
def pair(
    llm: FakeLLM, prefix: str, sqlite_migrated_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Workers "a" and "b" on one SQLite file and the Redis Cluster."""
    directory = tmp_path_factory.mktemp("cluster-workers")
    database = directory / "agentstream.db"
    database.write_bytes(sqlite_migrated_template.read_bytes())
    workers = Cluster(f"sqlite+aiosqlite:///{database}", llm, None, directory)
    on_cluster = {"REDIS_URL": str(REDIS_CLUSTER_URL), "REDIS_CLUSTER": "true", "REDIS_KEY_PREFIX": prefix}
    try:
        workers.start_roles({"a": on_cluster, "b": on_cluster})
        yield workers.role("a"), workers.role("b")
    finally:
        workers.close()


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
