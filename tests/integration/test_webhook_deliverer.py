"""A worker's ``Deliverer`` against real SQLite and PostgreSQL, its HTTP side played by an httpx
mock transport (nothing leaves this process): retries with backoff until the receiver accepts or the
delivery is too old, the URL checked again before each attempt (a host that now resolves to a
private address gets nothing), the request made to the very address checked, no redirect
followed, run webhooks signed and A2A pushes not, claims released when the worker stops, an
attempt's deadline counted from before its claim, old deliveries pruned in batches.

Where connections matter (a receiver that never answers beside one that does, a connection per
attempt), the receivers are real ones on loopback, reached by host names the test resolves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update
from standardwebhooks import Webhook

from app.db.models import WebhookDelivery, utcnow
from app.db.session import Database
from app.observability import Metrics
from app.webhooks import deliverer as deliverer_module
from app.webhooks.deliverer import MAX_IN_FLIGHT, MAX_PER_HOST, Deliverer, retry_delay
from app.webhooks.outbox import Delivery, NewDelivery, enqueue
from app.webhooks.urls import UrlPolicy
from tests.support.outbox import InspectableOutbox
from tests.support.server import async_wait_until
from tests.support.webhook_receiver import WebhookReceiver

KEY = b"key"

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
def outbox(database: Database) -> InspectableOutbox:
    return InspectableOutbox(database.sessionmaker)


@pytest.fixture
def resolver() -> Resolver:
    return Resolver()


@pytest.fixture
async def deliverer_for(
    outbox: InspectableOutbox, resolver: Resolver
) -> AsyncIterator[Callable[..., Deliverer]]:
    started: list[Deliverer] = []

    def make(playback: Playback, **options: float) -> Deliverer:
        deliverer = Deliverer(
            outbox,
            UrlPolicy(resolve=resolver),
            worker_id="w1",
            metrics=Metrics(),
            signing_key=KEY,
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


async def on_loopback(host: str, port: int) -> list[str]:
    assert host.endswith(".test"), host
    return ["127.0.0.1"]


@pytest.fixture
async def loopback_deliverer(outbox: InspectableOutbox) -> AsyncIterator[Callable[[], Deliverer]]:
    """A deliverer with its own HTTP client, every ``*.test`` host on 127.0.0.1."""
    started: list[Deliverer] = []

    def make() -> Deliverer:
        deliverer = Deliverer(
            outbox,
            UrlPolicy(allow_private=True, resolve=on_loopback),
            worker_id="w1",
            metrics=Metrics(),
            signing_key=KEY,
            max_age_s=60.0,
            claim_s=30.0,
            retry_s=0.02,
            draw=lambda: 0.0,
        )
        deliverer.start()
        started.append(deliverer)
        return deliverer

    yield make
    for deliverer in started:
        await deliverer.stop()


async def queue(outbox: InspectableOutbox) -> str:
    (delivery_id,) = await outbox.enqueue([NewDelivery("run", "run_1", "completed", URL, '{"a": 1}')])
    return delivery_id


async def settled(outbox: InspectableOutbox, delivery_id: str) -> Delivery:
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
    outbox: InspectableOutbox, deliverer_for: Callable[..., Deliverer]
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
    outbox: InspectableOutbox, deliverer_for: Callable[..., Deliverer]
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
    outbox: InspectableOutbox, deliverer_for: Callable[..., Deliverer]
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
    outbox: InspectableOutbox, resolver: Resolver, deliverer_for: Callable[..., Deliverer]
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
    outbox: InspectableOutbox, resolver: Resolver, deliverer_for: Callable[..., Deliverer]
) -> None:
    resolver.failures = 2
    playback = Playback(lambda n: 200)
    deliverer = deliverer_for(playback)
    delivery_id = await queue(outbox)

    made = await settled(outbox, delivery_id)

    assert made.delivered_at is not None and made.attempts == 3 and len(playback.requests) == 1
    assert (count(deliverer, "failed"), count(deliverer, "refused")) == (2, 0)


async def test_a_worker_that_stops_mid_attempt_releases_the_claim_for_another_at_once(
    outbox: InspectableOutbox, deliverer_for: Callable[..., Deliverer]
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


async def test_run_webhooks_are_signed_and_a2a_pushes_are_not(
    outbox: InspectableOutbox, deliverer_for: Callable[..., Deliverer]
) -> None:
    playback = Playback(lambda n: 200)
    deliverer_for(playback)
    token = {"X-A2A-Notification-Token": "tok"}
    hook, push = await outbox.enqueue(
        [
            NewDelivery("run", "run_1", "completed", URL, '{"run_id": "run_1"}'),
            NewDelivery("a2a_push", "run_1", "completed", URL, '{"statusUpdate": {}}', token),
        ]
    )
    await settled(outbox, hook)
    await settled(outbox, push)

    sent = {r.headers["webhook-id"]: r for r in playback.requests}
    assert Webhook(KEY).verify(sent[hook].content, dict(sent[hook].headers)) == {"run_id": "run_1"}
    # An A2A push carries its config's token, and no signature of the service's one secret.
    assert "webhook-signature" not in sent[push].headers
    assert sent[push].headers["x-a2a-notification-token"] == "tok"
    assert sent[push].headers["webhook-timestamp"].isdigit()


async def test_a_receiver_that_never_answers_holds_a_few_attempts_and_another_hosts_go_through(
    outbox: InspectableOutbox,
    loopback_deliverer: Callable[[], Deliverer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(deliverer_module, "TIMEOUT_S", 60.0)  # the stuck attempts outlast the test
    with WebhookReceiver(hold_timeout_s=60) as slow, WebhookReceiver() as fast:
        slow.gate.clear()  # answers nothing while the test runs

        def to(host: str, port: int, count: int) -> list[NewDelivery]:
            url = f"http://{host}:{port}/hook"
            return [NewDelivery("run", f"run_{host}_{i}", "completed", url, "{}") for i in range(count)]

        # The slow host's deliveries are due first, more of them than a worker makes at once.
        stuck = await outbox.enqueue(to("slow.test", slow.port, MAX_IN_FLIGHT + 4))
        await outbox.enqueue(to("fast.test", fast.port, 4))
        deliverer = loopback_deliverer()
        try:
            await asyncio.to_thread(fast.wait_accepted, 4, 20.0)
            await asyncio.to_thread(
                slow.wait_for, lambda r: r.held >= MAX_PER_HOST, 20.0, "the slow host's attempts"
            )
            held, answered = slow.held, list(slow.requests)
            rows = [await outbox.get(i) for i in stuck]
        finally:
            await deliverer.stop()

    assert held == MAX_PER_HOST and answered == []
    claimed = [r for r in rows if r is not None and r.claimed_by == "w1"]
    assert len(claimed) == MAX_PER_HOST and all(r.attempts == 1 for r in claimed)
    # The others were claimed and handed back (or never claimed): no attempt counted, due still.
    others = [r for r in rows if r is not None and r.claimed_by is None]
    assert len(others) == len(stuck) - MAX_PER_HOST and all(r.attempts == 0 for r in others)


async def test_each_attempt_connects_anew_so_no_host_name_rides_on_a_connection_made_for_another(
    outbox: InspectableOutbox, loopback_deliverer: Callable[[], Deliverer]
) -> None:
    # Two names on one address: a pool keyed by the address would hand b.test a's connection (with
    # https, one whose certificate was checked for a.test).
    with WebhookReceiver() as receiver:
        deliverer = loopback_deliverer()
        for name in ("a.test", "b.test", "b.test"):
            url = f"http://{name}:{receiver.port}/hook"
            (delivery_id,) = await outbox.enqueue([NewDelivery("run", "run_1", "completed", url, "{}")])
            deliverer.wake()
            await settled(outbox, delivery_id)

    assert [r.headers["host"] for r in receiver.requests] == [
        f"{name}:{receiver.port}" for name in ("a.test", "b.test", "b.test")
    ]
    assert receiver.connections == 3


class SlowClaims(InspectableOutbox):
    """Claims that come back late (a commit waiting for SQLite's write lock, a slow database)."""

    asked: list[tuple[float, list[str]]]

    async def claim(self, *args: Any, **kwargs: Any) -> list[Delivery]:
        asked_at = asyncio.get_running_loop().time()
        claimed = await super().claim(*args, **kwargs)
        if claimed:
            self.asked.append((asked_at, [d.id for d in claimed]))
            await asyncio.sleep(0.2)  # the late commit, played
        return claimed


async def test_an_attempts_deadline_counts_from_before_its_claim_was_asked(database: Database) -> None:
    outbox = SlowClaims(database.sessionmaker)
    outbox.asked = []
    playback = Playback(lambda n: 200)
    playback.gate.clear()  # the attempt stays under way
    deliverer = Deliverer(
        outbox,
        UrlPolicy(resolve=Resolver()),
        worker_id="w1",
        metrics=Metrics(),
        signing_key=None,
        max_age_s=60.0,
        claim_s=30.0,  # renewed every 10 s: not within this test
        retry_s=0.02,
        transport=httpx.MockTransport(playback),
    )
    deliverer.start()
    try:
        delivery_id = await queue(outbox)
        await async_wait_until(lambda: playback.requests, within=10, what="the attempt under way")
        flight = deliverer._flights[delivery_id]
        assert flight.deadline is not None
        when = flight.deadline.when()
    finally:
        playback.gate.set()
        await deliverer.stop()

    ((asked_at, ids),) = outbox.asked
    assert ids == [delivery_id]
    # The stored claim runs from a moment after ``asked_at``: the attempt stops before it lapses.
    assert when is not None and when <= asked_at + deliverer._hold_s


async def old_deliveries(database: Database, count: int, *, given_up: bool = False) -> list[str]:
    """``count`` deliveries made (or given up) 8 days ago."""
    long_ago = utcnow() - timedelta(days=8)
    async with database.sessionmaker.begin() as session:
        owed = [NewDelivery("run", f"run_{i}", "completed", URL, "{}") for i in range(count)]
        ids = await enqueue(session, owed, now=long_ago)
        done = {"given_up_at": long_ago} if given_up else {"delivered_at": long_ago}
        await session.execute(update(WebhookDelivery).where(WebhookDelivery.id.in_(ids)).values(**done))
    return ids


async def stored(database: Database) -> int:
    async with database.sessionmaker() as session:
        return int(await session.scalar(select(func.count()).select_from(WebhookDelivery)) or 0)


async def test_a_prune_goes_on_while_its_batches_come_back_full(
    database: Database, outbox: InspectableOutbox, deliverer_for: Callable[..., Deliverer]
) -> None:
    await old_deliveries(database, 1100)
    await old_deliveries(database, 101, given_up=True)
    (recent,) = await outbox.enqueue([NewDelivery("run", "run_new", "completed", URL, "{}")])
    playback = Playback(lambda n: 200)

    deliverer_for(playback)  # its first look prunes

    async def only_the_recent_one_left() -> bool:
        return await stored(database) == 1

    await async_wait_until(only_the_recent_one_left, within=15, what="the old deliveries pruned")
    assert [r.headers["webhook-id"] for r in playback.requests] == [recent]


async def test_a_prune_makes_a_bounded_number_of_batches(
    database: Database, outbox: InspectableOutbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deliverer_module, "PRUNE_BATCH", 10)
    monkeypatch.setattr(deliverer_module, "PRUNE_BATCHES", 3)
    await old_deliveries(database, 25)
    await old_deliveries(database, 20, given_up=True)
    deliverer = Deliverer(
        outbox,
        UrlPolicy(),
        worker_id="w1",
        metrics=Metrics(),
        signing_key=None,
        max_age_s=60.0,
        claim_s=30.0,
        retry_s=1.0,
    )

    assert await deliverer.prune() == 30  # three full batches, then it stops till the next time
    assert await stored(database) == 15
    assert await deliverer.prune() == 15
    assert await stored(database) == 0
