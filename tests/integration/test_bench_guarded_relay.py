"""bench/peers/guarded_relay.py keeps what it claims to keep: every event in Redis and in SQLite."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import redis.asyncio as redis

from bench.capacity_client import Level
from bench.fakellm import timed_args
from bench.instructions import GUARDED, stream_runs
from bench.service_stack import Stack
from tests.support.services import REDIS_URL

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(120)]

RUNS, TOKENS = 4, 30


def _key(ident: str) -> tuple[int, int]:
    ms, seq = ident.split("-")
    return int(ms), int(seq)


async def test_every_event_a_client_gets_is_in_redis_and_in_sqlite_in_order() -> None:
    async with Stack(
        timed_args(0, TOKENS, 0.005, "calculator"), factory=GUARDED, redis_url=REDIS_URL
    ) as stack:
        level = Level(2, TOKENS, 200, 0, 0, 0)
        await stream_runs(stack.workers[0][1], level, RUNS, 2)
        assert level.runs_good == RUNS, (level.problems, level.examples)
        db = sqlite3.connect(Path(stack.tmp.name) / "bench.db")
        try:
            conversations = [row[0] for row in db.execute("SELECT id FROM conversations")]
            runs = dict(db.execute("SELECT conversation_id, answer FROM runs WHERE status = 'completed'"))
            stored = {
                cid: sorted(
                    db.execute("SELECT id, event, data FROM events WHERE conversation_id = ?", (cid,)),
                    key=lambda row: _key(row[0]),
                )
                for cid in conversations
            }
        finally:
            db.close()
        client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            streamed = {
                cid: [
                    (ident, fields["e"], fields["d"])
                    for ident, fields in await client.xrange(f"{stack.prefix}:stream:{cid}")
                ]
                for cid in conversations
            }
            for cid in conversations:
                await client.delete(f"{stack.prefix}:stream:{cid}")
        finally:
            await client.aclose()

    assert len(conversations) == RUNS and len(runs) == RUNS
    for cid in conversations:
        # The client read TOKENS deltas and a done (the load generator checked the answer): all of
        # them are in both places, in the same order, with the same bytes.
        assert len(stored[cid]) == TOKENS + 1
        assert stored[cid] == streamed[cid]
        assert stored[cid][-1][1] == "done"
        assert json.loads(stored[cid][-1][2])["answer"] == runs[cid] != ""
