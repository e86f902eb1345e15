"""Nothing loses a waiting run (RUNS.md A-06), with uvicorn worker processes on PostgreSQL and Redis.

A run waits for its approval; every worker is killed (SIGKILL) and Redis loses every key of the
service (as a Redis restarted empty would); a worker started afterwards takes the decision, and the
run goes on to its end, its events all in the log. And a decision made through one worker carries
on a run that another worker started and parked.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import pytest
import redis

from app.db.migrate import upgrade_database
from tests.integration.conftest import PostgresServer, run_in_thread
from tests.integration.service.test_approvals import wait_done, wait_status
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    REDIS_URL,
    Api,
    Cluster,
    clients_fixture,
    fake_llm_serving,
    new_redis_prefix,
    redis_keys,
)
from tests.support.fake_agents import ToolAgentBehaviour

pytestmark = [
    pytest.mark.timeout(60, func_only=True),
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.redis,
]


@pytest.fixture
def cluster(postgres_server: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    database = f"agentstream_test_{secrets.token_hex(6)}"
    postgres_server.create_database(database)
    url = postgres_server.async_url(database)
    try:
        run_in_thread(lambda: upgrade_database(url))
        with fake_llm_serving() as llm, redis_keys(new_redis_prefix()) as prefix:
            llm.agent.inner = ToolAgentBehaviour("calculator", {"expression": "6*7"})
            made = Cluster(url, llm, prefix, tmp_path_factory.mktemp("approval-workers"))
            try:
                yield made
            finally:
                made.close()
    finally:
        postgres_server.drop_database(database)


def forget_redis(prefix: str) -> int:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(f"{prefix}:*", count=1000))
        return client.delete(*keys) if keys else 0
    finally:
        client.close()


def test_a_decision_after_every_worker_died_and_redis_forgot_everything_still_carries_the_run_on(
    cluster: Cluster, clients: Callable[..., Api]
) -> None:
    a, b = cluster.start(2, APPROVAL_TIMEOUT_S="3600")
    api = clients(a.base_url)
    conv = api.create_conversation(require_approval=["calculator"])
    run_id = api.start_run(conv, "what is 6*7?")
    (pending,) = wait_status(api, run_id, "waiting")["pending_approvals"]  # type: ignore[misc]

    a.kill()
    b.kill()
    assert cluster.redis_prefix is not None
    assert forget_redis(cluster.redis_prefix) > 0
    (c,) = cluster.start(1)
    fresh = clients(c.base_url)
    assert fresh.run(run_id)["status"] == "waiting"

    decided = fresh.http.post(
        f"/api/conversations/{conv}/approvals/{pending['approval_id']}", json={"decision": "approve"}
    )

    assert decided.status_code == 200, decided.text
    assert wait_done(fresh, run_id)["status"] == "completed"
    events = fresh.wait_stored(run_id)
    kinds = [(e["event"], e["data"].get("status")) for e in events]
    assert kinds.count(("approval", "requested")) == 1
    assert kinds.count(("approval", "approved")) == 1
    assert kinds[-1] == ("done", "completed")
    assert any(e["data"].get("observation") == "6*7 = 42" for e in events if e["event"] == "step")
    ids = [e["id"] for e in events]
    assert ids == sorted(ids, key=lambda i: tuple(int(p) for p in i.split("-"))) and len(set(ids)) == len(ids)


def test_a_run_parked_by_one_worker_goes_on_when_another_takes_the_decision(
    cluster: Cluster, clients: Callable[..., Api]
) -> None:
    a, b = cluster.start(2)
    api_a, api_b = clients(a.base_url), clients(b.base_url)
    conv = api_a.create_conversation(require_approval=["calculator"])
    run_id = api_a.start_run(conv, "what is 6*7?")
    (pending,) = wait_status(api_a, run_id, "waiting")["pending_approvals"]  # type: ignore[misc]

    with api_b.stream(conv) as stream:
        decided = api_b.http.post(
            f"/api/conversations/{conv}/approvals/{pending['approval_id']}",
            json={"decision": "deny", "reason": "not now"},
        )
        assert decided.status_code == 200, decided.text
        seen = stream.read(until=lambda e: e.event == "done")

    statuses = [e.data.get("status") for e in seen if e.event == "approval"]
    assert statuses == ["requested", "denied"]
    assert seen[-1].data["status"] == "completed"
    assert wait_done(api_a, run_id)["pending_approvals"] == []
