"""The webhooks' outbox as the tests use it (FACES.md N-06, N-07): ``InspectableOutbox`` is the
app's ``Outbox`` with what only tests need, storing deliveries in a transaction of their own and
reading them back as the app maps them (``Delivery``). The app stores deliveries only in the
transaction of the change they tell of (``app.webhooks.outbox.enqueue``) and reads them only by
claiming them."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select

from app.webhooks.outbox import Delivery, NewDelivery, Outbox, _deliveries, _delivery, enqueue


class InspectableOutbox(Outbox):
    async def enqueue(self, deliveries: Sequence[NewDelivery]) -> list[str]:
        """Store ``deliveries``, due at once, in a transaction of their own; their ids, in order."""
        async with self._sessionmaker.begin() as session:
            return await enqueue(session, deliveries)

    async def get(self, delivery_id: str) -> Delivery | None:
        async with self._sessionmaker() as session:
            row = (await session.execute(select(_deliveries).where(_deliveries.c.id == delivery_id))).first()
        return _delivery(row) if row is not None else None

    async def of_run(self, run_id: str) -> list[Delivery]:
        """The deliveries about a run, in the order they were queued."""
        async with self._sessionmaker() as session:
            rows = await session.execute(
                select(_deliveries)
                .where(_deliveries.c.run_id == run_id)
                .order_by(_deliveries.c.created_at, _deliveries.c.id)
            )
            return [_delivery(row) for row in rows]
