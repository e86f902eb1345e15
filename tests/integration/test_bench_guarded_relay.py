"""bench/peers/guarded_relay.py keeps what it claims to keep: what a client gets is in Redis and in
SQLite, in the order the client got it, and a run's ``done`` is stored before the client sees it."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import httpx
import orjson
import pytest
import redis.asyncio as redis

from bench.capacity_bench import GUARDED
from bench.fakellm import timed_args
from bench.service_stack import Stack
from tests.support.services import REDIS_URL

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(120)]

RUNS, TOKENS = 3, 30
Event = tuple[str, str, str]


def _rows(db_path: Path, sql: str, *params: str) -> list[tuple[str, ...]]:
    db = sqlite3.connect(db_path)
    try:
        return [tuple(row) for row in db.execute(sql, params)]
    finally:
        db.close()


def _key(ident: str) -> tuple[int, int]:
    ms, seq = ident.split("-")
    return int(ms), int(seq)


async def _run(client: httpx.AsyncClient, db_path: Path) -> tuple[str, list[Event], bool]:
    """One run streamed to its end: its conversation, the events as the client got them, and whether
    its done was stored when the client got it."""
    conversation = (await client.post("/api/conversations", json={})).json()["id"]
    started = await client.post(f"/api/conversations/{conversation}/runs", json={"message": "hi"})
    assert started.status_code == 202
    got: list[Event] = []
    done_stored = False
    async with client.stream("GET", f"/api/conversations/{conversation}/stream") as response:
        fields: dict[str, str] = {}
        async for line in response.aiter_lines():
            if line:
                name, _, value = line.partition(": ")
                fields[name] = value
                continue
            got.append((fields["id"], fields["event"], fields["data"]))
            if fields["event"] == "done":
                query = "SELECT id FROM events WHERE conversation_id = ? AND id = ?"
                found = _rows(db_path, query, conversation, fields["id"])  # ids are a conversation's
                done_stored = found == [(fields["id"],)]
            fields = {}
    return conversation, got, done_stored


async def test_what_a_client_gets_is_in_redis_and_in_sqlite_in_order() -> None:
    async with Stack(timed_args(0, TOKENS, 0.005), factory=GUARDED, redis_url=REDIS_URL) as stack:
        db_path = Path(stack.tmp.name) / "bench.db"
        base = f"http://127.0.0.1:{stack.workers[0][1]}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            runs = await asyncio.gather(*(_run(client, db_path) for _ in range(RUNS)))
        store = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            streamed = {
                conversation: [
                    (ident, fields["e"], fields["d"])
                    for ident, fields in await store.xrange(f"{stack.prefix}:stream:{conversation}")
                ]
                for conversation, _, _ in runs
            }
            ttl = [await store.ttl(f"{stack.prefix}:stream:{conversation}") for conversation, _, _ in runs]
        finally:
            await store.aclose()
        stored = {
            conversation: sorted(
                _rows(db_path, "SELECT id, event, data FROM events WHERE conversation_id = ?", conversation),
                key=lambda row: _key(row[0]),
            )
            for conversation, _, _ in runs
        }
        answers = dict(_rows(db_path, "SELECT conversation_id, answer FROM runs WHERE status = 'completed'"))

    assert len(answers) == RUNS
    assert all(0 < seconds <= 120 for seconds in ttl)  # the stream expires after its run's done
    for conversation, got, done_stored in runs:
        assert [event for _, event, _ in got] == ["answer"] * TOKENS + ["done"]
        assert done_stored
        # In the client's order, with the same bytes, in both places.
        assert streamed[conversation] == got
        assert stored[conversation] == got
        deltas = "".join(orjson.loads(data)["content"] for _, event, data in got if event == "answer")
        assert orjson.loads(got[-1][2])["answer"] == deltas == answers[conversation] != ""
