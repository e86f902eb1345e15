"""MemoryInterruptQueue: order, atomic drain, and its bound."""

from __future__ import annotations

import asyncio

import pytest

from app.engine.interrupts import MAX_QUEUED, InterruptQueueFullError, MemoryInterruptQueue


async def test_puts_count_up_and_a_drain_takes_them_all_in_order() -> None:
    queue = MemoryInterruptQueue()
    assert [await queue.put("a"), await queue.put("b")] == [1, 2]
    assert await queue.drain() == ["a", "b"]
    assert await queue.drain() == []


async def test_a_full_queue_refuses_a_put_and_keeps_what_it_holds() -> None:
    queue = MemoryInterruptQueue()
    for n in range(MAX_QUEUED):
        assert await queue.put(f"m{n}") == n + 1

    with pytest.raises(InterruptQueueFullError):
        await queue.put("one too many")

    assert await queue.drain() == [f"m{n}" for n in range(MAX_QUEUED)]
    assert await queue.put("after the drain") == 1


async def test_concurrent_puts_never_go_past_the_limit() -> None:
    queue = MemoryInterruptQueue(limit=5)

    async def put(n: int) -> bool:
        try:
            await queue.put(str(n))
        except InterruptQueueFullError:
            return False
        return True

    assert sum(await asyncio.gather(*(put(n) for n in range(20)))) == 5
    assert len(await queue.drain()) == 5
