"""Run webhooks (FACES.md N-07) through the real service: a receiver on loopback, the fake model.

``POST .../runs {"webhook"}`` posts the run record (``GET /api/runs/{id}``'s JSON) when the run
starts waiting and when it ends, signed as Standard Webhooks says (checked with the
``standardwebhooks`` package); a receiver that fails is retried until it accepts; URLs on private
addresses or off ``WEBHOOK_ALLOWED_HOSTS`` are refused when given (422) and again at delivery,
where nothing is sent.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from standardwebhooks import Webhook

from app.db.session import Database
from app.webhooks.outbox import Delivery, NewDelivery
from tests.integration.conftest import run_in_own_loop
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    clients_fixture,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import ToolAgentBehaviour
from tests.support.node import run_node
from tests.support.outbox import InspectableOutbox
from tests.support.server import ServerThread, wait_until
from tests.support.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.timeout(60)

SECRET = "whsec_" + base64.b64encode(b"a key of thirty-two bytes, at least").decode()
LOOPBACK = {
    "webhook_allow_private": True,
    "webhook_allowed_hosts": "127.0.0.1",
    "webhook_secret": SECRET,
    "webhook_retry_s": 0.05,
}


def start_with_webhook(api: Api, conv: str, url: str, message: str = "hello") -> str:
    response = api.http.post(f"/api/conversations/{conv}/runs", json={"message": message, "webhook": url})
    assert response.status_code == 202, response.text
    return str(response.json()["run_id"])


def wait_status(api: Api, run_id: str, status: str) -> dict[str, Any]:
    run: dict[str, Any] = wait_until(
        lambda: (r := api.run(run_id))["status"] == status and r,
        timeout=15,
        interval=0.05,
        what=f"run {run_id} to be {status}",
    )
    return run


def deliveries(api: Api) -> dict[tuple[str, str], float]:
    response = api.http.get("/metrics")
    return {
        (s.labels["kind"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
        if s.name == "agentstream_webhook_deliveries_total"
    }


def outbox_of(database_url: str, run_id: str) -> list[Delivery]:
    async def read() -> list[Delivery]:
        db = Database(database_url)
        try:
            return await InspectableOutbox(db.sessionmaker).of_run(run_id)
        finally:
            await db.dispose()

    return run_in_own_loop(read)


def test_a_receiver_that_fails_three_times_gets_the_signed_run_record_once_it_accepts(
    start_service: Callable[..., ServerThread], clients: Callable[..., Api], migrated_database_url: str
) -> None:
    api = clients(start_service(redis=False, **LOOPBACK).base_url)
    with WebhookReceiver(fail_first=3) as receiver:
        conv = api.create_conversation()
        run_id = start_with_webhook(api, conv, receiver.url)

        (accepted,) = receiver.wait_accepted(1)
        record = api.run(run_id)

    attempts = receiver.requests
    assert [r.status for r in attempts] == [500, 500, 500, 200]
    assert {r.delivery_id for r in attempts} == {accepted.delivery_id}
    assert accepted.delivery_id.startswith("wh_")
    # Each attempt is signed anew (its own timestamp); the accepted one checks out.
    assert Webhook(SECRET).verify(accepted.body, accepted.headers) == record
    for attempt in attempts:
        Webhook(SECRET).verify(attempt.body, attempt.headers)
    assert accepted.headers["content-type"] == "application/json"
    assert record["status"] == "completed" and record["run_id"] == run_id
    # The worker records the delivery once the receiver answered: a moment after it.
    (row,) = wait_until(
        lambda: [d for d in outbox_of(migrated_database_url, run_id) if d.delivered_at],
        timeout=10,
        what="the delivery recorded",
    )
    assert (row.attempts, row.event, row.given_up_at, row.claimed_by) == (4, "completed", None, None)
    assert row.last_error is None
    counts = wait_until(lambda: (c := deliveries(api)).get(("run", "delivered")) and c, timeout=10)
    assert counts[("run", "failed")] == 3 and counts[("run", "delivered")] == 1


def test_a_run_that_waits_for_approval_posts_its_record_when_it_waits_and_when_it_ends(
    start_service: Callable[..., ServerThread],
    clients: Callable[..., Api],
    gated_llm: FakeLLM,
) -> None:
    gated_llm.agent.inner = ToolAgentBehaviour("calculator", {"expression": "6*7"})
    api = clients(start_service(redis=False, **LOOPBACK).base_url)
    with WebhookReceiver() as receiver:
        conv = api.create_conversation(require_approval=["calculator"])
        run_id = start_with_webhook(api, conv, receiver.url, "what is 6*7?")

        (waiting,) = receiver.wait_accepted(1)
        waiting_record = wait_status(api, run_id, "waiting")
        assert Webhook(SECRET).verify(waiting.body, waiting.headers) == waiting_record
        (pending,) = waiting_record["pending_approvals"]
        assert pending["tool_name"] == "calculator"

        decided = api.http.post(
            f"/api/conversations/{conv}/approvals/{pending['approval_id']}", json={"decision": "approve"}
        )
        assert decided.status_code == 200, decided.text
        ended = receiver.wait_accepted(2)[1]
        final = wait_status(api, run_id, "completed")

    assert Webhook(SECRET).verify(ended.body, ended.headers) == final
    assert final["pending_approvals"] == [] and "42" in str(api.events(run_id))
    assert waiting.delivery_id != ended.delivery_id
    assert len(receiver.requests) == 2


@pytest.mark.parametrize(
    ("settings", "url", "why"),
    [
        pytest.param({}, "http://127.0.0.1:{port}/hook", "loopback", id="loopback"),
        pytest.param({}, "http://10.0.0.7/hook", "private", id="private"),
        pytest.param({}, "http://169.254.169.254/latest", "link-local", id="link-local"),
        pytest.param({}, "http://[::1]:{port}/hook", "loopback", id="ipv6-loopback"),
        pytest.param(
            {"webhook_allow_private": True, "webhook_allowed_hosts": "127.0.0.1"},
            "http://localhost:{port}/hook",
            "WEBHOOK_ALLOWED_HOSTS",
            id="not-an-allowed-host",
        ),
        pytest.param({"webhook_allow_private": True}, "ftp://127.0.0.1/hook", "pattern", id="scheme"),
        pytest.param(
            {"webhook_allow_private": True}, "http://user:pw@127.0.0.1/hook", "credentials", id="userinfo"
        ),
    ],
)
def test_a_webhook_url_the_service_does_not_post_to_is_refused_when_given_and_nothing_starts(
    settings: dict[str, Any],
    url: str,
    why: str,
    start_service: Callable[..., ServerThread],
    clients: Callable[..., Api],
) -> None:
    # Allowed hosts, so that only the address is refused (literal addresses: nothing is resolved).
    settings = {"webhook_allowed_hosts": "127.0.0.1,::1,10.0.0.7,169.254.169.254", **settings}
    api = clients(start_service(redis=False, **settings).base_url)
    with WebhookReceiver() as receiver:
        conv = api.create_conversation()
        response = api.http.post(
            f"/api/conversations/{conv}/runs",
            json={"message": "hello", "webhook": url.format(port=receiver.port)},
        )

        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_request" and why in error["message"]
        assert "pw" not in error["message"]
        assert api.http.get(f"/api/conversations/{conv}").json()["active_run_id"] is None
        # The same conversation takes a run with no webhook.
        assert api.http.post(f"/api/conversations/{conv}/runs", json={"message": "x"}).status_code == 202
    assert receiver.requests == []


def test_a_delivery_to_an_address_refused_now_is_given_up_and_nothing_is_sent(
    start_service: Callable[..., ServerThread], clients: Callable[..., Api], migrated_database_url: str
) -> None:
    # Queued while loopback was allowed (another worker's settings, or a name that resolved to a
    # public address then); this worker does not post to loopback.
    api = clients(start_service(redis=False, webhook_retry_s=0.05).base_url)
    with WebhookReceiver() as receiver:

        async def queue() -> str:
            db = Database(migrated_database_url)
            try:
                (delivery_id,) = await InspectableOutbox(db.sessionmaker).enqueue(
                    [NewDelivery("run", "run_elsewhere", "completed", receiver.url, '{"run_id": "x"}')]
                )
                return delivery_id
            finally:
                await db.dispose()

        run_in_own_loop(queue)
        (row,) = wait_until(
            lambda: [d for d in outbox_of(migrated_database_url, "run_elsewhere") if d.given_up_at],
            timeout=15,
            what="the delivery given up",
        )

        assert receiver.requests == []
    assert row.attempts == 1 and row.delivered_at is None
    assert row.last_error is not None and "loopback" in row.last_error and "/hook" not in row.last_error
    assert wait_until(lambda: deliveries(api).get(("run", "refused")), timeout=10) == 1


def test_the_readmes_node_snippet_verifies_a_delivery_and_refuses_a_changed_one(
    start_service: Callable[..., ServerThread], clients: Callable[..., Api]
) -> None:
    api = clients(start_service(redis=False, **LOOPBACK).base_url)
    with WebhookReceiver() as receiver:
        run_id = start_with_webhook(api, api.create_conversation(), receiver.url)
        (delivery,) = receiver.wait_accepted(1)

    def verify(body: bytes, secret: str = SECRET) -> Any:
        env = {
            "WEBHOOK_SECRET": secret,
            "WEBHOOK_BODY_B64": base64.b64encode(body).decode(),
            "WEBHOOK_HEADERS": json.dumps(delivery.headers),
        }
        return run_node("webhook_verify.mjs", env, timeout=30)

    assert verify(delivery.body) == {"valid": True, "record": api.run(run_id)}
    assert verify(delivery.body.replace(b"completed", b"cancelled"))["valid"] is False
    assert verify(delivery.body, "whsec_" + base64.b64encode(b"another key").decode())["valid"] is False
