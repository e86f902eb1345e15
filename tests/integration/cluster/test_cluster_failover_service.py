"""A master's failover mid-run, through the service (RUNS.md S-01): no event and no run lost.

Two in-thread servers on a private cluster of this module; a run streams its answer through one
while a client follows it through the other. The master serving the conversation's slot is
killed (SIGKILL) mid-answer: its replica takes over, the run completes, and the client, connecting
again with its cursor whenever its stream breaks (as a browser's EventSource does), ends with
every event once and in order, as the database keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.streaming.redis_keys import RedisKeys
from tests.integration.cluster.service_support import follow, in_order, start_on_cluster
from tests.integration.service.test_workers_sqlite import migrated_copy
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    GatedAgent,
    answer_of,
    as_stored,
    clients_fixture,
    new_redis_prefix,
)
from tests.support.redis_cluster import PrivateCluster
from tests.support.server import ServerThread
from tests.support.sse import SseEvent

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(60, func_only=True)]

PREFIX = new_redis_prefix()


@pytest.fixture(scope="module")
def servers(
    private_cluster: PrivateCluster,
    llm: FakeLLM,
    sqlite_migrated_template: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerThread, ServerThread]]:
    """Servers "a" and "b" on one SQLite file and the private cluster."""
    database = migrated_copy(sqlite_migrated_template, tmp_path_factory.mktemp("failover-service"))
    started: list[ServerThread] = []
    try:
        for _ in range(2):
            started.append(start_on_cluster(database, llm, private_cluster.url, PREFIX))
        yield started[0], started[1]
    finally:
        llm.agent.gate.set()
        for server in reversed(started):
            server.stop()


def test_a_run_streaming_through_a_master_failover_completes_and_its_follower_misses_nothing(
    llm: FakeLLM,
    servers: tuple[ServerThread, ServerThread],
    private_cluster: PrivateCluster,
    clients: Callable[..., Api],
) -> None:
    a, b = (clients(server.base_url) for server in servers)
    agent = llm.play(GatedAgent(tokens=150, delay_s=0.02))  # an answer of some 3 s
    conv = a.create_conversation()
    key = RedisKeys(PREFIX, cluster=True).events(conv)
    run_id = a.start_run(conv, "a long answer")
    killed: list[int] = []

    def kill_mid_answer(event: SseEvent) -> None:
        if event.event == "answer" and event.data.get("status") == "delta" and not killed:
            killed.append(private_cluster.kill_master_of(key))

    received, _ = follow(b, conv, within=45, on_event=kill_mid_answer)

    assert killed, "the run ended before its answer streamed"
    assert private_cluster.master_port_of(key) != killed[0], "the replica never took the slot over"
    done = received[-1]
    assert (done.event, done.data["run_id"], done.data["status"]) == ("done", run_id, "completed"), done
    run = a.run(run_id)
    assert run["status"] == "completed"
    events = as_stored(received)
    assert in_order([e["id"] for e in events])
    assert events == b.wait_stored(run_id, timeout=20)
    # A new attempt (if the run was taken over) streams the whole answer again.
    resumed = [i for i, e in enumerate(events) if e["event"] == "phase" and e["data"]["phase"] == "resumed"]
    last_attempt = events[resumed[-1] + 1 :] if resumed else events
    assert answer_of(last_attempt) == done.data["answer"] == agent.answer
