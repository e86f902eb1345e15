"""``Deliverer``: each worker's loop that drains the webhooks' outbox (FACES.md N-06, N-07).

It claims due deliveries (``Outbox.claim``), a few at a time, and makes each attempt as a task of
its own: the URL checked again and resolved (``UrlPolicy``), a POST to the very address checked on
a connection of its own, 10 s to answer (3 of them to connect), no redirect followed, the Standard
Webhooks headers (``signing``; run webhooks are signed, A2A push notifications carry their config's
credentials instead). At most ``MAX_PER_HOST`` of a worker's attempts go to one host at once: the
claims skip a host that has them, so a receiver that never answers holds a few attempts, not all
of them, and the other hosts' deliveries go on.

A 2xx answer is a delivery; anything else (a host that does not resolve too) is retried with
exponential backoff and jitter until the delivery is ``WEBHOOK_MAX_AGE_S`` old, then given up; a
URL refused now for what it is or where it resolves to is given up at once (nothing is sent).

While an attempt is under way its claim is renewed every third of ``WEBHOOK_CLAIM_S``; an attempt
whose claim could not be renewed stops before the claim can lapse, so no other worker ever makes
an attempt at the same delivery at the same time. A worker that dies leaves its claims to lapse,
and another worker makes those deliveries again (at least once); one that stops releases them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import httpx

from app import __version__
from app.db.models import utcnow
from app.observability import Metrics
from app.settings import Settings
from app.tls import client_tls
from app.webhooks.outbox import Delivery, Outbox
from app.webhooks.signing import webhook_headers
from app.webhooks.urls import UrlPolicy, WebhookRefusedError

log = logging.getLogger("app.webhooks")

TIMEOUT_S = 10.0
"""How long a receiver has to answer an attempt (N-06), connecting included."""
CONNECT_TIMEOUT_S = 3.0
"""How long connecting (and the TLS handshake) may take of that."""
MAX_IN_FLIGHT = 16
"""Attempts one worker makes at once."""
MAX_PER_HOST = 4
"""Attempts one worker makes at once to one host."""
POLL_S = 1.0
"""Longest pause between two looks for due deliveries (this worker's own are looked at at once)."""
MIN_WAIT_S = 0.02
MAX_BACKOFF_S = 3600.0
"""The longest wait between two attempts at one delivery."""
PRUNE_EVERY_S = 600.0
PRUNE_BATCH = 500
"""Deliveries deleted a transaction (SQLite's one write lock is let go between two)."""
PRUNE_BATCHES = 20
"""Transactions a prune makes at most: a worker deletes up to 10,000 deliveries every 10 minutes."""
KEPT_S = 7 * 86400.0
"""Deliveries made or given up are kept this long (to be looked at), then deleted."""
USER_AGENT = f"AgentStream-Webhooks/{__version__}"


def retry_delay(attempts: int, first_s: float, draw: float) -> float:
    """The wait after a delivery's ``attempts``-th failed attempt: ``first_s`` doubled each time
    up to an hour, less a random part of up to a half (``draw`` in [0, 1))."""
    ceiling = min(MAX_BACKOFF_S, first_s * 2.0 ** min(max(attempts - 1, 0), 40))
    return ceiling * (1.0 - draw / 2.0)


@dataclass(frozen=True, slots=True)
class Outcome:
    delivered: bool
    error: str | None = None
    refused: bool = False


@dataclass(slots=True)
class _Flight:
    """An attempt under way: its claim's local deadline moves with each renewal."""

    delivery: Delivery
    claimed_at: float
    """The loop's clock just before the claim was asked: its lease counts from no earlier."""
    task: asyncio.Task[None] | None = None
    deadline: asyncio.Timeout | None = None
    recording: bool = False


class Deliverer:
    def __init__(
        self,
        outbox: Outbox,
        policy: UrlPolicy,
        *,
        worker_id: str,
        metrics: Metrics,
        signing_key: bytes | None,
        max_age_s: float,
        claim_s: float,
        retry_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.outbox = outbox
        self.policy = policy
        self.worker_id = worker_id
        self.metrics = metrics
        self.signing_key = signing_key
        self.max_age_s = max_age_s
        self.claim_s = claim_s
        self.retry_s = retry_s
        self._transport = transport
        self._draw = draw
        # An attempt stops this long before its claim would lapse unless the claim was renewed.
        self._hold_s = claim_s - min(claim_s / 4.0, 2.0)
        self._flights: dict[str, _Flight] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None
        self._next_prune = 0.0  # the loop's first look prunes

    @classmethod
    def from_settings(
        cls, settings: Settings, outbox: Outbox, policy: UrlPolicy, *, worker_id: str, metrics: Metrics
    ) -> Deliverer:
        return cls(
            outbox,
            policy,
            worker_id=worker_id,
            metrics=metrics,
            signing_key=settings.webhook_signing_key(),
            max_age_s=settings.webhook_max_age_s,
            claim_s=settings.webhook_claim_s,
            retry_s=settings.webhook_retry_s,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        # No proxy from the environment (it would connect elsewhere than the address checked), no
        # redirect followed. No connection kept for another attempt: a pool tells connections apart
        # by the address connected to, and a TLS connection verified for one host name would carry
        # a delivery for another name on the same address.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_keepalive_connections=0),
            follow_redirects=False,
            trust_env=False,
            transport=self._transport,
            verify=client_tls(),
        )
        self._tasks = [
            asyncio.create_task(self._claim_loop(), name="webhook-claims"),
            asyncio.create_task(self._renew_loop(), name="webhook-renewals"),
        ]

    async def stop(self) -> None:
        """Stop claiming, stop the attempts under way and release their claims, so that another
        worker makes them at once."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        flights = list(self._flights.values())
        for flight in flights:
            if flight.task is not None and not flight.recording:
                flight.task.cancel()
        for flight in flights:
            if flight.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await flight.task
        left = [f.delivery for f in flights if not f.recording]
        try:
            released = await self.outbox.release(left, self.worker_id)
            if released:
                log.info("shutdown: released webhook deliveries", extra={"deliveries": released})
        except Exception as exc:  # their claims lapse instead
            log.warning("shutdown: could not release webhook deliveries", extra={"error": repr(exc)})
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def wake(self) -> None:
        """Look for due deliveries now (this worker queued some)."""
        self._wake.set()

    # ---- claiming --------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        while True:
            self._wake.clear()
            wait_s = POLL_S
            try:
                wait_s = await self._claim_due()
                await self._prune_now_and_then()
            except Exception as exc:  # the database restarting: look again later
                log.warning("could not claim webhook deliveries", extra={"error": repr(exc)})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._wake.wait()

    async def _claim_due(self) -> float:
        """Claim what is due while there is room; how long to wait before looking again."""
        room = MAX_IN_FLIGHT - len(self._flights)
        if room <= 0:
            return POLL_S  # an attempt that ends wakes the loop
        per_host = self._per_host()
        busy = {host for host, count in per_host.items() if count >= MAX_PER_HOST}
        # A read first: with nothing due (most looks) no worker writes, which on SQLite would
        # take the one write lock every worker shares.
        due = await self.outbox.next_due(skip_hosts=busy)
        if due is None:
            return POLL_S
        wait_s = (due - utcnow()).total_seconds()
        if wait_s > 0:
            return min(POLL_S, max(MIN_WAIT_S, wait_s))
        # Before the claim is asked: its lease counts from a moment after this, never before.
        claimed_at = asyncio.get_running_loop().time()
        claimed = await self.outbox.claim(self.worker_id, room, self.claim_s, skip_hosts=busy)
        over: list[Delivery] = []
        for delivery in claimed:
            if per_host.get(delivery.host, 0) >= MAX_PER_HOST:
                over.append(delivery)  # more of one host than it may have at once
                continue
            per_host[delivery.host] = per_host.get(delivery.host, 0) + 1
            self._launch(delivery, claimed_at)
        if over:
            await self.outbox.hand_back(over, self.worker_id)
        # Something started: look again at once (more may be due, other hosts' among them);
        # nothing (another worker was first): not before a while.
        return 0.0 if len(over) < len(claimed) else POLL_S / 4

    def _per_host(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for flight in self._flights.values():
            counts[flight.delivery.host] = counts.get(flight.delivery.host, 0) + 1
        return counts

    async def _prune_now_and_then(self) -> None:
        now = time.monotonic()
        if now < self._next_prune:
            return
        self._next_prune = now + PRUNE_EVERY_S
        gone = await self.prune()
        if gone:
            log.info("pruned old webhook deliveries", extra={"deliveries": gone})

    async def prune(self) -> int:
        """Delete what was made or given up ``KEPT_S`` ago, a batch a transaction while batches
        come back full, ``PRUNE_BATCHES`` at most; how many."""
        before = utcnow() - timedelta(seconds=KEPT_S)
        gone = 0
        for _ in range(PRUNE_BATCHES):
            batch = await self.outbox.prune(before, limit=PRUNE_BATCH)
            gone += batch
            if batch < PRUNE_BATCH:
                break
        return gone

    def _launch(self, delivery: Delivery, claimed_at: float) -> None:
        flight = _Flight(delivery, claimed_at)
        self._flights[delivery.id] = flight
        flight.task = asyncio.create_task(self._fly(flight), name=f"webhook-{delivery.id}")

    # ---- claims under way --------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.claim_s / 3.0)
            try:
                await self._renew()
            except Exception as exc:  # the attempts stop before their claims lapse
                log.warning("could not renew webhook claims", extra={"error": repr(exc)})

    async def _renew(self) -> None:
        flights = [f for f in self._flights.values() if not f.recording]
        if not flights:
            return
        # The local deadline counts from before the renewal was asked: never past the stored one.
        asked_at = asyncio.get_running_loop().time()
        held = await self.outbox.renew([f.delivery for f in flights], self.worker_id, self.claim_s)
        for flight in flights:
            if flight.delivery.id in held:
                if flight.deadline is not None and not flight.deadline.expired():
                    with contextlib.suppress(RuntimeError):  # it is expiring right now
                        flight.deadline.reschedule(asked_at + self._hold_s)
            elif not flight.recording and flight.task is not None:
                flight.task.cancel()  # another worker holds it now

    async def _fly(self, flight: _Flight) -> None:
        delivery = flight.delivery
        try:
            try:
                async with asyncio.timeout_at(flight.claimed_at + self._hold_s) as deadline:
                    flight.deadline = deadline
                    outcome = await self._attempt(delivery)
            except TimeoutError:
                log.warning(
                    "webhook attempt stopped: its claim could not be renewed",
                    extra={"delivery": delivery.id, "run_id": delivery.run_id},
                )
                return
            flight.recording = True
            await self._record(delivery, outcome)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # its claim lapses; another attempt is made then
            log.warning(
                "could not record a webhook attempt",
                extra={"delivery": delivery.id, "run_id": delivery.run_id, "error": repr(exc)},
            )
        finally:
            self._flights.pop(delivery.id, None)
            self._wake.set()

    async def _attempt(self, delivery: Delivery) -> Outcome:
        try:
            target = await self.policy.check(delivery.url)
        except WebhookRefusedError as exc:
            # A host that does not resolve now may later: retried. Any other refusal is final.
            return Outcome(False, f"refused: {exc}", refused=not exc.transient)
        assert self._client is not None, "the deliverer is not started"
        body = delivery.body.encode()
        # Run webhooks only: an A2A push goes to any URL a client registers and carries the
        # config's own credentials; signing it would hand out signed samples of the one secret.
        key = self.signing_key if delivery.kind == "run" else None
        headers = {
            **delivery.headers,
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            **webhook_headers(key, delivery.id, int(time.time()), body),
            "host": target.host_header,
        }
        extensions = {"sni_hostname": target.sni_hostname} if target.sni_hostname else {}
        try:
            request = self._client.build_request(
                "POST", target.request_url, content=body, headers=headers, extensions=extensions
            )
            async with asyncio.timeout(TIMEOUT_S):  # connecting, sending and the answer's head, in all
                # Streamed and closed unread: what the receiver answers beyond its status is not needed.
                response = await self._client.send(request, stream=True)
                await response.aclose()
        except (httpx.TimeoutException, TimeoutError):
            return Outcome(False, f"no answer within {TIMEOUT_S:g} s")
        except Exception as exc:  # its words may hold the URL: only its kind is kept
            return Outcome(False, f"could not post ({type(exc).__name__})")
        if 200 <= response.status_code < 300:
            return Outcome(True)
        return Outcome(False, f"the receiver answered HTTP {response.status_code}")

    async def _record(self, delivery: Delivery, outcome: Outcome) -> None:
        """The attempt's outcome, counted (first: it was made, whatever storing it meets), logged
        and stored."""
        where = {"delivery": delivery.id, "run_id": delivery.run_id, "attempt": delivery.attempts}
        if outcome.delivered:
            self.metrics.webhook_deliveries.labels(delivery.kind, "delivered").inc()
            log.info("webhook delivered", extra={**where, "kind": delivery.kind})
            await self.outbox.delivered(delivery, self.worker_id)
            return
        error = outcome.error or "failed"
        if outcome.refused:
            self.metrics.webhook_deliveries.labels(delivery.kind, "refused").inc()
            log.warning("webhook refused", extra={**where, "error": error})
            await self.outbox.failed(delivery, self.worker_id, error, retry_at=None)
            return
        retry_at = utcnow() + timedelta(seconds=retry_delay(delivery.attempts, self.retry_s, self._draw()))
        if retry_at > delivery.created_at + timedelta(seconds=self.max_age_s):
            self.metrics.webhook_deliveries.labels(delivery.kind, "given_up").inc()
            log.warning("webhook given up", extra={**where, "error": error})
            await self.outbox.failed(delivery, self.worker_id, error, retry_at=None)
            return
        self.metrics.webhook_deliveries.labels(delivery.kind, "failed").inc()
        log.info("webhook attempt failed; retrying", extra={**where, "error": error})
        await self.outbox.failed(delivery, self.worker_id, error, retry_at=retry_at)
