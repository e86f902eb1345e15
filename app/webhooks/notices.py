"""``OutboxNotices``: the deliveries a run's change owes, stored in the transaction that made it
(FACES.md N-06, N-07; ``app.db.repositories.run_notices`` is the seam).

The bodies are built right there, from the run's row as the transaction changed it: a run webhook
posts the run record exactly as ``GET /api/runs/{id}`` shows it at that moment (what it waits for
included), an A2A push config gets the task's ``StreamResponse`` (``a2a_push``). Built later, at
delivery time, a ``waiting`` webhook delivered after the run went on would show the run running or
ended, and a receiver would never learn what it waited for; built here, each delivery tells the
change it was queued for, and the same bytes go out on every attempt.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Table, event, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.api.presenters import run_out
from app.db.models import Run
from app.db.repositories.approvals import ApprovalRecord, ApprovalRepo
from app.db.repositories.push_configs import push_configs_of
from app.db.repositories.rows import RunRecord, _run_record
from app.runs.approvals import approval_item, tool_call_item
from app.webhooks.outbox import NewDelivery, enqueue

_runs: Table = Run.__table__  # type: ignore[assignment]


def run_record_json(run: RunRecord, default_model: str, pending: list[ApprovalRecord]) -> str:
    """The run record of ``GET /api/runs/{id}``, as JSON text."""
    return run_out(
        run,
        run.model or default_model,
        [approval_item(a) for a in pending if a.kind == "approval"],
        [tool_call_item(c) for c in pending if c.kind == "client"],
    ).model_dump_json()


class OutboxNotices:
    """Implements ``RunNotices`` for the repositories: the run's webhook and its push configs get
    their deliveries. ``on_enqueued`` is called once the transaction that stored some committed
    (this worker's deliverer looks at once; the others at their next look)."""

    def __init__(self, default_model: str, on_enqueued: Callable[[], None] | None = None) -> None:
        self.default_model = default_model
        self.on_enqueued = on_enqueued

    async def run_changed(self, session: AsyncSession, run_id: str) -> None:
        row = (await session.execute(select(_runs).where(_runs.c.id == run_id))).first()
        if row is None:
            return
        run = _run_record(row)
        configs = await push_configs_of(session, run_id)
        # A run webhook tells of waits and ends (N-07); push configs of every status change (N-06).
        webhook = run.webhook if run.status not in ("queued", "running") else None
        if webhook is None and not configs:
            return
        pending = await ApprovalRepo.pending_in(session, run_id) if run.status == "waiting" else []
        owed: list[NewDelivery] = []
        if webhook is not None:
            body = run_record_json(run, self.default_model, pending)
            owed.append(NewDelivery("run", run.id, run.status, webhook, body))
        if configs:
            # Here, not with the app: the A2A SDK's types load once a task has a push config.
            from app.webhooks import a2a_push

            context_id = await a2a_push.context_id_of(session, run)
            bodies = a2a_push.notifications(run, context_id, pending)
            for config in configs:
                headers = a2a_push.push_headers(config)
                owed += [NewDelivery("a2a_push", run.id, run.status, config.url, b, headers) for b in bodies]
        await enqueue(session, owed)
        wake = self.on_enqueued
        if wake is not None:
            event.listen(session.sync_session, "after_commit", lambda _session: wake(), once=True)
