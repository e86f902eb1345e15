"""MemoryCancelSignal: the in-process twin of the Redis cancel signal."""

from __future__ import annotations

from app.streaming.redis_signals import MemoryCancelSignal


async def test_a_request_reaches_every_listener_and_is_remembered() -> None:
    signal = MemoryCancelSignal()
    seen: list[str] = []
    seen_async: list[str] = []

    async def record(run_id: str) -> None:
        seen_async.append(run_id)

    await signal.listen(seen.append)
    await signal.listen(record)
    assert not await signal.is_requested("run_1")
    await signal.request("run_1")
    assert seen == ["run_1"] and seen_async == ["run_1"]
    assert await signal.is_requested("run_1")
    assert not await signal.is_requested("run_2")


async def test_a_failing_callback_does_not_stop_the_others() -> None:
    signal = MemoryCancelSignal()
    seen: list[str] = []

    def broken(run_id: str) -> None:
        raise RuntimeError("boom")

    await signal.listen(broken)
    await signal.listen(seen.append)
    await signal.request("run_1")
    assert seen == ["run_1"]


async def test_after_close_nobody_is_called() -> None:
    signal = MemoryCancelSignal()
    seen: list[str] = []
    await signal.listen(seen.append)
    await signal.close()
    await signal.request("run_1")
    assert seen == []
    assert await signal.is_requested("run_1")


async def test_old_requests_are_forgotten_after_their_ttl() -> None:
    signal = MemoryCancelSignal(ttl_s=0)
    await signal.request("run_1")
    assert not await signal.is_requested("run_1")
