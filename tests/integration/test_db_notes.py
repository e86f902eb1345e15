"""The notebook's notes in the database (RUNS.md R-12) against real SQLite and PostgreSQL: per owner,
seen by every worker, and a call repeated under its idempotency key stores nothing twice, also when
the two copies race."""

from __future__ import annotations

import asyncio

import pytest

from app.db.repositories.notes import NoteRepo
from app.db.session import Database
from app.tools.builtins import MAX_NOTES, Notebook, ToolInputError
from app.tools.registry import ToolInvocation


def describe(replaced: bool, total: int) -> str:
    return f"{'updated' if replaced else 'saved'} ({total})"


async def test_notes_of_one_worker_are_listed_by_another_per_owner(migrated_database_url: str) -> None:
    first, second = Database(migrated_database_url), Database(migrated_database_url)
    try:
        one = Notebook(NoteRepo(first.sessionmaker))
        two = Notebook(NoteRepo(second.sessionmaker))
        await one.save_note("milk", "2 litres", ToolInvocation("run_a:c1", owner="alice"))
        await one.save_note("bread", "rye", ToolInvocation("run_a:c2", owner="alice"))
        await one.save_note("milk", "3 litres", ToolInvocation("run_a:c3", owner="alice"))
        await one.save_note("tea", "green", ToolInvocation("run_b:c1", owner="bob"))

        assert await two.list_notes(ToolInvocation("", owner="alice")) == (
            "2 note(s):\n- milk: 3 litres\n- bread: rye"
        )
        assert await two.list_notes(ToolInvocation("", owner="bob")) == "1 note(s):\n- tea: green"
    finally:
        await first.dispose()
        await second.dispose()


async def test_a_call_repeated_under_its_key_returns_its_result_and_changes_nothing(
    database: Database,
) -> None:
    notes = NoteRepo(database.sessionmaker)
    first = await notes.save(
        "alice", "milk", "2 litres", idempotency_key="run_a:c1", max_notes=10, describe=describe
    )
    await notes.save("alice", "milk", "5 litres", idempotency_key="run_a:c2", max_notes=10, describe=describe)

    repeated = await notes.save(
        "alice", "milk", "2 litres", idempotency_key="run_a:c1", max_notes=10, describe=describe
    )

    assert repeated == first == "saved (1)"
    assert await notes.notes("alice") == [("milk", "5 litres")]  # the later save stands


async def test_two_copies_of_one_call_racing_store_it_once(database: Database) -> None:
    notes = NoteRepo(database.sessionmaker)
    results = await asyncio.gather(
        *(
            notes.save("alice", f"n{i % 2}", "x", idempotency_key="run_a:c1", max_notes=10, describe=describe)
            for i in range(6)
        )
    )
    assert len(set(results)) == 1
    assert len(await notes.notes("alice")) == 1


async def test_the_notebook_is_bounded_per_owner(database: Database) -> None:
    book = Notebook(NoteRepo(database.sessionmaker))
    for i in range(MAX_NOTES):
        await book.save_note(f"n{i}", "x", ToolInvocation(f"k{i}", owner="alice"))
    with pytest.raises(ToolInputError, match="full"):
        await book.save_note("one more", "x", ToolInvocation("k-more", owner="alice"))
    assert await book.save_note("n0", "replaced", ToolInvocation("k-replace", owner="alice"))
    assert await book.save_note("mine", "x", ToolInvocation("k-bob", owner="bob"))
