"""Run webhooks and A2A push notifications (FACES.md N-06, N-07): one durable outbox in the database.

- ``outbox``: the deliveries owed (``enqueue`` in the caller's transaction; claims under a lease).
- ``notices``: what a run that waits or ends owes, stored in the transaction that parks or closes it.
- ``deliverer``: each worker's loop that makes the deliveries, at least once, retried with backoff.
- ``urls``: which URLs are posted to (checked when given and before each delivery).
- ``signing``: Standard Webhooks headers; ``a2a_push``: the A2A ``StreamResponse`` bodies.

``build_webhooks`` wires them for one app; ``Webhooks`` is what the routes and faces use.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.repositories.push_configs import PushConfigRepo
from app.observability import Metrics
from app.settings import Settings
from app.webhooks.deliverer import Deliverer
from app.webhooks.notices import OutboxNotices
from app.webhooks.outbox import Outbox
from app.webhooks.urls import Resolver, UrlPolicy, WebhookRefusedError, system_resolver

__all__ = ["WebhookRefusedError", "Webhooks", "build_webhooks"]


@dataclass
class Webhooks:
    outbox: Outbox
    policy: UrlPolicy
    """Check a URL when it is given: ``await policy.check(url)`` raises ``WebhookRefusedError``."""
    notices: OutboxNotices
    """Given to the run and approval repositories: they store deliveries through it."""
    deliverer: Deliverer
    push_configs: PushConfigRepo


def build_webhooks(
    settings: Settings,
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    metrics: Metrics,
    worker_id: str,
    default_model: str,
    resolve: Resolver = system_resolver,
) -> Webhooks:
    outbox = Outbox(sessionmaker)
    policy = UrlPolicy.from_settings(settings, resolve)
    deliverer = Deliverer.from_settings(settings, outbox, policy, worker_id=worker_id, metrics=metrics)
    return Webhooks(
        outbox=outbox,
        policy=policy,
        notices=OutboxNotices(default_model, on_enqueued=deliverer.wake),
        deliverer=deliverer,
        push_configs=PushConfigRepo(sessionmaker),
    )
