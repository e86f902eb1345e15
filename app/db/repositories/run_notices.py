"""The seam through which the transactions that park or close a run tell of it (FACES.md N-06, N-07).

``RunRepo.finish`` and ``ApprovalRepo.park`` call ``RunNotices.run_changed`` inside their own
transaction when the run has someone to tell (a webhook URL, an A2A push config), and so does
``ApprovalRepo`` when a decision, a client's result or an expiry lets a waiting run go on: the
webhooks' outbox (``app.webhooks``) stores its deliveries there, so that a delivery exists exactly when the
change was committed, whatever happens to the worker after. The repositories know nothing more of
webhooks than this.
"""

from __future__ import annotations

from typing import Protocol

from sqlalchemy import ColumnElement, Table, exists, or_
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import PushConfig, Run

_runs: Table = Run.__table__  # type: ignore[assignment]
_push_configs: Table = PushConfig.__table__  # type: ignore[assignment]


class RunNotices(Protocol):
    async def run_changed(self, session: AsyncSession, run_id: str) -> None:
        """``run_id`` just started waiting, went on or ended, in ``session``'s transaction (not
        committed yet): store what is owed to its listeners in it."""


NOTIFY: ColumnElement[bool] = or_(
    _runs.c.webhook.is_not(None), exists().where(_push_configs.c.run_id == _runs.c.id)
).label("notify")
"""Whether a run has listeners: returned by the UPDATE that changes it. When it says none, the
repositories ask ``has_push_configs`` again in a statement of their own (one statement more): on
PostgreSQL this subquery sees the snapshot taken before the UPDATE waited for the run's row, not a
push config committed meanwhile."""
