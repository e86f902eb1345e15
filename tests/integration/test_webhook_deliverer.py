"""A worker's ``Deliverer`` against real SQLite and PostgreSQL, its HTTP side played by an httpx
mock transport (nothing leaves this process): retries with backoff until the receiver accepts or the
delivery is too old, the URL checked again before each attempt (a host that now resolves to a
private address gets nothing), the request made to the very address checked, no redirect
followed, and claims released when the worker stops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta

import httpx
import pytest

from app.db.session import Database
from app.observability import Metrics
from app.webhooks.deliverer import Deliverer, retry_delay
from app.webhooks.outbox import Delivery, NewDelivery, Outbox
from app.webhooks.urls import UrlPolicy
from tests.support.server import async_wait_until

URL = "https://hooks.example.com/in?key=k"
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class Playback:
    """The receiver side: answers each request as ``answer`` says, keeping the requests."""

    def __init__(self, answer: Callable[[int], int]) -> None:
        self.answer = answer
        self.requests: list[httpx.Request] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        await self.gate.wait()
        status = self.answer(len(self.requests))
        return httpx.Response(status, headers={"location": "http://127.0.0.1/"} if status == 302 else {})


class Resolver:
    def __init__(self) -> None:
        self.addresses = ["93.184.216.34"]
        self.failures = 0
        """How many lookups fail (as a DNS outage) before they answer again."""

    async def __call__(self, host: str, port: int) -> list[str]:
        assert host == "hooks.example.com"
        if self.failures > 0:
            self.failures -= 1
            raise OSError("Temporary failure in name resolution")
        return list(self.addresses)


@pytest.fixture
def outbox(database: Database) -> Outbox:
    return Outbox(database.sessionmaker)


@pytest.fixture
def resolver() -> Resolver:
    return Resolver()


@pytest.fixture
async def deliverer_for(outbox: Outbox, resolver: Resolver) -> AsyncIterator[Callable[..., Deliverer]]:
    started: list[Deliverer] = []

    def make(playback: Playback, **options: float) -> Deliverer:
        deliverer = Deliverer(
            outbox,
            UrlPolicy(resolve=resolver),
            worker_id="w1",
            metrics=Metrics(),
            signing_key=b"key",
            max_age_s=options.get("max_age_s", 60.0),
            claim_s=options.get("claim_s", 30.0),
            retry_s=options.get("retry_s", 0.02),
            transport=httpx.MockTransport(playback),
            draw=lambda: 0.0,
        )
        deliverer.start()
        started.append(deliverer)
        return deliverer

    yield make
    for deliverer in started:
        await deliverer.stop()


async def queue(outbox: Outbox) -> str:
    (delivery_id,) = await outbox.enqueue([NewDelivery("run", "run_1", "completed", URL, '{"a": 1}')])
    return delivery_id


async def settled(outbox: Outbox, delivery_id: str) -> Delivery:
    async def done() -> Delivery | None:
        d = await outbox.get(delivery_id)
        return d if d is not None and (d.delivered_at or d.given_up_at) else None

    found: Delivery = await async_wait_until(done, within=15, what="the delivery made or given up")
    return found


def count(deliverer: Deliverer, outcome: str) -> float:
    return (
        deliverer.metrics.registry.get_sample_value(
            "agentstream_webhook_deliveries_total", {"kind": "run", "outcome": outcome}
        )
        or 0.0
    )


async def test_a_receiver_that_fails_three_times_is_retried_with_growing_waits_until_it_accepts(
    outbox: Outbox, deliverer_for: Callable[..., Deliverer]
) -> None:
    playback = Playback(lambda n: 500 if n <= 3 else 204)
    deliverer = deliverer_for(playback)
    delivery_id = await queue(outbox)
    deliverer.wake()

    made = await settled(outbox, delivery_id)

    assert made.delivered_at is not None and made.attempts == 4 and made.last_error is None
    assert len(playback.requests) == 4
    assert {r.headers["webhook-id"] for r in playback.requests} == {delivery_id}
    # Each wait at least the backoff's (0.02, 0.04, 0.08 s with no jitter drawn).
    stamps = [int(r.headers["webhook-timestamp"]) for r in playback.requests]
    assert stamps == sorted(stamps)
    assert (count(deliverer, "failed"), count(deliverer, "delivered")) == (3, 1)


async def test_the_request_goes_to_the_address_checked_with_the_hosts_name_and_no_redirect_is_followed(
    outbox: Outbox, deliverer_for: Callable[..., Deliverer]
) -> None:
    playback = Playback(lambda n: 302)
    deliverer_for(playback, max_age_s=0.05)
    delivery_id = await queue(outbox)

    given_up = await settled(outbox, delivery_id)

    first = playback.requests[0]
    assert first.url.host == "93.184.216.34" and first.url.path == "/in" and first.url.query == b"key=k"
    assert first.headers["host"] == "hooks.example.com"
    assert first.extensions["sni_hostname"] == "hooks.example.com"
    assert first.headers["content-type"] == "application/json" and first.content == b'{"a": 1}'
    assert all(r.url.host == "93.184.216.34" for r in playback.requests)  # never the Location
    assert given_up.given_up_at is not None and given_up.last_error == "the receiver answered HTTP 302"


async def test_a_delivery_is_given_up_once_its_next_attempt_would_be_past_the_max_age(
    outbox: Outbox, deliverer_for: Callable[..., Deliverer]
) -> None:
    playback = Playback(lambda n: 503)
    deliverer = deliverer_for(playback, max_age_s=1.0, retry_s=0.1)
    delivery_id = await queue(outbox)

    given_up = await settled(outbox, delivery_id)

    assert given_up.delivered_at is None and given_up.given_up_at is not None
    assert given_up.last_error == "the receiver answered HTTP 503"
    # Waits of 0.1, 0.2, 0.4 s: the one after a fourth attempt (0.8 s) would end past 1 s (fewer
    # attempts if the machine is slow), and never more than a few seconds late.
    assert 1 <= given_up.attempts == len(playback.requests) <= 4
    assert given_up.given_up_at - given_up.created_at < timedelta(seconds=5)
    assert count(deliverer, "given_up") == 1
    assert await outbox.pending_count() == 0


async def test_a_host_that_resolves_to_a_private_address_at_delivery_gets_nothing(
    outbox: Outbox, resolver: Resolver, deliverer_for: Callable[..., Deliverer]
) -> None:
    resolver.addresses = ["93.184.216.34", "10.0.0.8"]  # checked fine when given; not any more
    playback = Playback(lambda n: 200)
    deliverer = deliverer_for(playback)
    delivery_id = await queue(outbox)

    refused = await settled(outbox, delivery_id)

    assert playback.requests == []
    assert refused.given_up_at is not None and refused.attempts == 1
    assert (
        refused.last_error
        == "refused: host hooks.example.com is a private address (WEBHOOK_ALLOW_PRIVATE is off)"
    )
    assert count(deliverer, "refused") == 1


async def test_a_host_that_does_not_resolve_for_a_while_is_retried_not_given_up(
    outbox: Outbox, resolver: Resolver, deliverer_for: Callable[..., Deliverer]
) -> None:
    resolver.failures = 2
    playback = Playback(lambda n: 200)
    deliverer = deliverer_for(playback)
    delivery_id = await queue(outbox)

    made = await settled(outbox, delivery_id)

    assert made.delivered_at is not None and made.attempts == 3 and len(playback.requests) == 1
    assert (count(deliverer, "failed"), count(deliverer, "refused")) == (2, 0)


async def test_a_worker_that_stops_mid_attempt_releases_the_claim_for_another_at_once(
    outbox: Outbox, deliverer_for: Callable[..., Deliverer]
) -> None:
    playback = Playback(lambda n: 200)
    playback.gate.clear()
    deliverer = deliverer_for(playback)
    delivery_id = await queue(outbox)
    await async_wait_until(lambda: playback.requests, within=10, what="the attempt under way")

    await deliverer.stop()

    released = await outbox.get(delivery_id)
    assert released is not None and (released.claimed_by, released.attempts) == (None, 1)
    assert released.delivered_at is None
    (again,) = await outbox.claim("w2", 5, 30)
    assert (again.id, again.attempts) == (delivery_id, 2)


def test_backoff_doubles_up_to_an_hour_and_jitter_takes_up_to_half() -> None:
    assert [retry_delay(n, 1.0, 0.0) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert retry_delay(30, 1.0, 0.0) == 3600.0 and retry_delay(10_000, 1.0, 0.0) == 3600.0
    assert retry_delay(3, 1.0, 0.999) == pytest.approx(2.002)
