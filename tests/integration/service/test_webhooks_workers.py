"""Run webhooks across workers (FACES.md N-06, N-07): uvicorn worker processes on one database, a
receiver on loopback. A worker SIGKILLed in the middle of its deliveries loses none (another makes
them once its claims lapse, and not before); two workers never make attempts at one delivery at the
same time, even when each attempt outlasts the claim's lease; Redis restarting empty loses nothing
(the outbox is in the database).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import select
from standardwebhooks import Webhook

from app.db.models import WebhookDelivery
from app.db.session import Database
from app.webhooks.outbox import Delivery
from tests.integration.conftest import run_in_own_loop
from tests.integration.service.test_webhooks import LOOPBACK, SECRET, start_with_webhook, wait_status
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    Cluster,
    FakeLLM,
    clients_fixture,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support import redis_server
from tests.support.fake_agents import ToolAgentBehaviour
from tests.support.outbox import InspectableOutbox
from tests.support.redis_server import PrivateRedis
from tests.support.server import ServerThread, wait_until
from tests.support.services import unavailable
from tests.support.webhook_receiver import WebhookReceiver

# func_only: starting worker processes has bounds of its own and may be slow on a busy machine.
pytestmark = [pytest.mark.timeout(60, func_only=True), pytest.mark.slow, pytest.mark.redis]

WORKER_ENV = {
    "WEBHOOK_ALLOW_PRIVATE": "true",
    "WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
    "WEBHOOK_SECRET": SECRET,
    "WEBHOOK_RETRY_S": "0.05",
}


@pytest.fixture
def cluster(
    migrated_database_url: str, gated_llm: FakeLLM, redis_prefix: str, tmp_path: Path
) -> Iterator[Cluster]:
    made = Cluster(migrated_database_url, gated_llm, redis_prefix, tmp_path)
    try:
        yield made
    finally:
        made.close()


def outbox_rows(database_url: str) -> list[Delivery]:
    async def read() -> list[Delivery]:
        db = Database(database_url)
        try:
            outbox = InspectableOutbox(db.sessionmaker)
            async with db.sessionmaker() as session:
                run_ids = sorted(set(await session.scalars(select(WebhookDelivery.run_id))))
            return [d for run_id in run_ids for d in await outbox.of_run(run_id)]
        finally:
            await db.dispose()

    return run_in_own_loop(read)


def all_delivered(database_url: str, count: int) -> list[Delivery] | None:
    rows = outbox_rows(database_url)
    return rows if len(rows) == count and all(d.delivered_at for d in rows) else None


def test_a_worker_killed_mid_delivery_loses_none_and_another_makes_them_once_its_claims_lapse(
    cluster: Cluster, clients: Callable[..., Api], migrated_database_url: str
) -> None:
    env = {**WORKER_ENV, "WEBHOOK_CLAIM_S": "6"}
    with WebhookReceiver() as receiver:
        receiver.gate.clear()  # the receiver holds every request: a's attempts are under way
        (a,) = cluster.start(1, **env)
        api = clients(a.base_url)
        runs = [start_with_webhook(api, api.create_conversation(), receiver.url) for _ in range(3)]
        receiver.wait_for(lambda r: r.held >= 3, what="worker a's three attempts under way")
        # b is up while a holds its claims (renewed every third of 6 s): b takes none of them.
        (b,) = cluster.start(1, **env)
        held = outbox_rows(migrated_database_url)
        assert len({d.claimed_by for d in held}) == 1 and all(d.delivered_at is None for d in held)
        assert receiver.requests == []  # nothing answered yet: every request is a's, held

        a.kill()
        killed = time.monotonic()
        receiver.gate.set()  # a's requests are answered into closed connections
        rows = wait_until(
            lambda: all_delivered(migrated_database_url, 3), timeout=30, interval=0.2, what="b's deliveries"
        )

    by_b = [r for r in receiver.requests if r.arrived > killed]
    assert sorted(r.delivery_id for r in by_b) == sorted(d.id for d in rows)
    assert all(r.status == 200 for r in by_b)
    # Not before a's claims lapsed: each was held at least until the time stored when last looked.
    lapsed = min(monotonic_of(d.claimed_until) for d in held if d.claimed_until is not None)
    assert min(r.arrived for r in by_b) >= lapsed - 0.1
    assert {d.run_id for d in rows} == set(runs)
    before = {d.id: d.attempts for d in held}
    assert all(d.attempts == before[d.id] + 1 and d.event == "completed" for d in rows)
    for request in by_b:
        record = Webhook(SECRET).verify(request.body, request.headers)
        assert record["status"] == "completed" and record["run_id"] in runs
    b.stop()


def monotonic_of(moment: datetime) -> float:
    """``moment`` (a stored UTC time) on this process's monotonic clock."""
    return time.monotonic() + (moment.timestamp() - time.time())


def test_two_workers_never_make_attempts_at_one_delivery_at_the_same_time(
    cluster: Cluster, clients: Callable[..., Api], migrated_database_url: str
) -> None:
    # Every request takes 4 s, longer than the claim's lease; the first attempt at each fails.
    env = {**WORKER_ENV, "WEBHOOK_CLAIM_S": "3"}
    with WebhookReceiver(fail_first=1, hold_timeout_s=4.0) as receiver:
        receiver.gate.clear()
        a, b = cluster.start(2, **env)
        apis = [clients(a.base_url), clients(b.base_url)]
        runs = [start_with_webhook(api, api.create_conversation(), receiver.url) for api in apis * 3]

        rows = wait_until(
            lambda: all_delivered(migrated_database_url, 6), timeout=40, interval=0.2, what="six deliveries"
        )

    assert {d.run_id for d in rows} == set(runs)
    assert set(receiver.overlaps.values()) == {1}, receiver.overlaps
    attempts: dict[str, list[int]] = {}
    for request in receiver.requests:
        attempts.setdefault(request.delivery_id, []).append(request.status)
    assert attempts == {d.id: [500, 200] for d in rows}
    assert all(d.attempts == 2 for d in rows)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if not redis_server.available():
        unavailable("redis-server is not installed")
    with PrivateRedis(tmp_path / "redis") as server:
        yield server


@pytest.mark.parametrize("database_backend", ["sqlite"])
def test_redis_restarting_empty_loses_no_delivery(
    private_redis: PrivateRedis,
    start_service: Callable[..., ServerThread],
    clients: Callable[..., Api],
    gated_llm: FakeLLM,
) -> None:
    gated_llm.agent.inner = ToolAgentBehaviour("calculator", {"expression": "6*7"})
    accepting = threading.Event()
    with WebhookReceiver(answer=lambda r: 200 if accepting.is_set() else 503) as receiver:
        api = clients(start_service(redis_url=private_redis.url, **LOOPBACK).base_url)
        conv = api.create_conversation(require_approval=["calculator"])
        run_id = start_with_webhook(api, conv, receiver.url, "what is 6*7?")
        pending = wait_status(api, run_id, "waiting")["pending_approvals"][0]
        receiver.wait_for(lambda r: len(r.requests) >= 2, what="the waiting record refused twice")

        private_redis.stop()
        private_redis.start()  # empty
        decided = api.http.post(
            f"/api/conversations/{conv}/approvals/{pending['approval_id']}", json={"decision": "approve"}
        )
        assert decided.status_code == 200, decided.text
        final = wait_status(api, run_id, "completed")
        accepting.set()

        accepted = receiver.wait_for(
            lambda r: len(a := [x for x in r.requests if x.status == 200]) >= 2 and a,
            timeout=20,
            what="both records accepted",
        )

    records = [Webhook(SECRET).verify(r.body, r.headers) for r in accepted]
    assert sorted(r["status"] for r in records) == ["completed", "waiting"]
    assert next(r for r in records if r["status"] == "completed") == final
