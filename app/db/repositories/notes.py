"""``NoteRepo``: the notebook tool's notes, per owner, and the effects of its calls (RUNS.md R-12).

A note is saved in one transaction with the call's idempotency key: the same call made again (a
new attempt of its run repeating a call cut off by a crash) finds the key and returns the result
it had, storing nothing twice.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.models import Note, ToolEffect, utcnow
from app.tools.builtins import NotebookFull


class NotebookFullError(NotebookFull):
    """The owner already has the most notes allowed; nothing was saved."""


class _AlreadyDone(Exception):
    """Raised inside a save's transaction (which then keeps nothing): the key was used before."""

    def __init__(self, result: str) -> None:
        super().__init__(result)
        self.result = result


class NoteRepo:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def save(
        self,
        owner: str,
        title: str,
        content: str,
        *,
        idempotency_key: str,
        max_notes: int,
        describe: Callable[[bool, int], str],
    ) -> str:
        """Save (or replace) ``owner``'s note ``title``; the call's result, ``describe(replaced,
        total)``. A key already used returns its first result and changes nothing. Raises
        ``NotebookFullError`` for a new note past ``max_notes``."""
        for _ in range(3):
            try:
                return await self._save_once(owner, title, content, idempotency_key, max_notes, describe)
            except _AlreadyDone as done:
                return done.result
            except IntegrityError:
                # Two saves of one new title, or of one key, at once: the other one won; look again.
                continue
        raise NotebookFullError("the notebook is busy; try again")

    async def _save_once(
        self,
        owner: str,
        title: str,
        content: str,
        key: str,
        max_notes: int,
        describe: Callable[[bool, int], str],
    ) -> str:
        now = utcnow()
        async with self._sessionmaker.begin() as session:
            # The write first (it takes the row lock, or SQLite's write lock): then the reads
            # below see every other save of this owner's title.
            updated = await session.execute(
                update(Note)
                .where(Note.owner == owner, Note.title == title)
                .values(content=content, updated_at=now)
            )
            replaced = bool(updated.rowcount)  # type: ignore[attr-defined]
            if key:
                done = await session.scalar(
                    select(ToolEffect.result).where(ToolEffect.idempotency_key == key)
                )
                if done is not None:
                    raise _AlreadyDone(done)
            total = (
                await session.scalar(select(func.count()).select_from(Note).where(Note.owner == owner)) or 0
            )
            if not replaced:
                if total >= max_notes:
                    raise NotebookFullError(f"the notebook is full ({max_notes} notes)")
                await session.execute(
                    insert(Note).values(
                        owner=owner, title=title, content=content, created_at=now, updated_at=now
                    )
                )
                total += 1
            result = describe(replaced, int(total))
            if key:
                await session.execute(
                    insert(ToolEffect).values(idempotency_key=key, owner=owner, result=result, created_at=now)
                )
            return result

    async def notes(self, owner: str) -> list[tuple[str, str]]:
        """``owner``'s notes as (title, content), oldest first."""
        async with self._sessionmaker() as session:
            rows = await session.execute(
                select(Note.title, Note.content)
                .where(Note.owner == owner)
                .order_by(Note.created_at, Note.title)
            )
            return [(row.title, row.content) for row in rows]
