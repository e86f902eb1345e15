"""The floor with AgentStream's guarantees (issue 29): the bare relay, plus what keeping them costs at least.

``bench/peers/bare_relay.py`` relays one chat call per run and keeps nothing. This relay keeps what
AgentStream keeps for a streamed run, each done the cheapest way this stack allows, so that the
distance from it to the bare relay is what the guarantees cost a Python worker at the least, and the
distance from AgentStream to it is what the rest of AgentStream costs (the engine and its tool loop,
FastAPI, the layers of the publish and delivery paths):

* every event is appended to the conversation's Redis Stream (``XADD``) before its client gets it:
  one connection, one writer task for the process, every event queued since the last write sent
  in one pipelined write (a batch grows while a write is in flight), the replies read with hiredis;
* every event is stored in the database (SQLite, WAL, through aiosqlite): one insert of all runs'
  queued events every 500 ms in one transaction, and a run's last events with its ``done`` and its
  row's close in one transaction before the ``done`` reaches Redis or the client;
* the conversation and the run have rows: the conversation's inserted when it is created, the run's
  inserted before the call starts, each committed before the answer;
* the stream expires ``RETENTION_S`` after the run's ``done`` (``EXPIRE``, with the done's write).

If Redis or the database fails, the relay stops (exit status 70): a guarantee it cannot keep ends
the measurement loudly. Not here: resume from a cursor (it costs nothing while no client
reconnects), any worker serving any stream (the writer hands each event to its own run's queue), a
stream's length cap and the entries' ``run_id`` and ``prev`` fields, the engine, authentication.
``bench/capacity_bench.py knee --subjects guarded`` drives it with the same load generator, pinning,
fake LLM and Redis as the floor and AgentStream; it speaks the same slice of AgentStream's API as the
bare relay (see there). SQLite only: ``DATABASE_URL`` names the file (``sqlite+aiosqlite:///PATH``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import traceback
import uuid
from typing import NoReturn
from urllib.parse import urlsplit

import aiosqlite
import hiredis
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bench.peers.bare_relay import Frames, Relay, relay_app

STORE_INTERVAL_S = 0.5
RETENTION_S = 120
"""The stream's expiry once its run is done (the knee's workers run with ``STREAM_RETENTION_S=120``)."""
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS conversations (id TEXT PRIMARY KEY, created REAL)",
    "CREATE TABLE IF NOT EXISTS runs (id TEXT PRIMARY KEY, conversation_id TEXT, status TEXT, answer TEXT)",
    "CREATE TABLE IF NOT EXISTS events (conversation_id TEXT, id TEXT, event TEXT, data TEXT, "
    "PRIMARY KEY (conversation_id, id))",
)
Event = tuple[str, str, str, str]
"""(conversation id, event id, event name, data) as stored."""


def fatal(what: str) -> NoReturn:
    """A guarantee could not be kept: the relay stops at once rather than measure a broken run (a
    level it cannot serve is missed, loudly, instead of hanging its clients)."""
    traceback.print_exc()
    print(f"guarded relay: {what}; stopping", file=sys.stderr, flush=True)
    os._exit(70)


class Appender:
    """The process's one Redis writer: every queued command in one pipelined write at a time; each
    event's frame goes to its run's queue once Redis has it (``None``: the stream's end)."""

    def __init__(self, url: str, prefix: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 6379
        self.db = int(parts.path.strip("/") or 0)
        self.prefix = prefix
        self.pending: list[tuple[bytes, Frames | None, bytes | None]] = []
        """(command or b"", the queue its frame goes to, the frame or None for the stream's end)."""
        self.wake = asyncio.Event()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        if self.db:
            await self._round_trip(hiredis.pack_command(("SELECT", self.db)), 1)
        self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await _cancelled(self.task)
        if self.writer is not None:
            self.writer.close()

    def key(self, conversation_id: str) -> str:
        return f"{self.prefix}:stream:{conversation_id}"

    def append(self, conversation_id: str, ident: str, name: str, data: bytes, frames: Frames) -> None:
        command = hiredis.pack_command(("XADD", self.key(conversation_id), ident, "e", name, "d", data))
        self.pending.append((command, frames, frame_of(ident, name, data)))
        self.wake.set()

    def end(self, conversation_id: str, frames: Frames) -> None:
        """After the run's done: the stream's expiry, and the end of its client's stream."""
        expire = hiredis.pack_command(("EXPIRE", self.key(conversation_id), RETENTION_S))
        self.pending += [(expire, None, None), (b"", frames, None)]
        self.wake.set()

    async def _round_trip(self, payload: bytes, count: int) -> list[object]:
        assert self.reader is not None and self.writer is not None
        self.writer.write(payload)
        parser = hiredis.Reader()
        replies: list[object] = []
        while len(replies) < count:
            reply = parser.gets()
            if reply is False:
                data = await self.reader.read(262_144)
                if not data:
                    raise ConnectionError("Redis closed the connection")
                parser.feed(data)
                continue
            if isinstance(reply, hiredis.ReplyError):
                raise RuntimeError(f"Redis refused a command: {reply}")
            replies.append(reply)
        return replies

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.pending = self.pending, []
            count = sum(1 for command, _, _ in batch if command)
            try:
                if count:
                    await self._round_trip(b"".join(command for command, _, _ in batch), count)
            except asyncio.CancelledError:
                raise
            except Exception:
                fatal("an append to Redis failed")
            for _, frames, out in batch:
                if frames is not None:
                    frames.put_nowait(out)


class Store:
    """The process's event store: every queued event inserted, all runs' at once, every 500 ms."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.db: aiosqlite.Connection | None = None
        self.queued: list[Event] = []
        self.lock = asyncio.Lock()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.db = await aiosqlite.connect(self.path)
        await self.db.execute("PRAGMA journal_mode=WAL")
        for statement in SCHEMA:
            await self.db.execute(statement)
        await self.db.commit()
        self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await _cancelled(self.task)
        if self.db is not None:
            await self.db.close()

    async def write(self, sql: str, params: tuple[object, ...]) -> None:
        """One statement in a transaction of its own (a row of a conversation or a run)."""
        assert self.db is not None
        async with self.lock:
            await self.db.execute(sql, params)
            await self.db.commit()

    async def flush(self, sql: str = "", params: tuple[object, ...] = ()) -> None:
        """Everything queued so far stored (with ``sql`` in the same transaction, if given)."""
        assert self.db is not None
        async with self.lock:
            batch, self.queued = self.queued, []
            if batch:
                await self.db.executemany("INSERT INTO events VALUES (?, ?, ?, ?)", batch)
            if sql:
                await self.db.execute(sql, params)
            if batch or sql:
                await self.db.commit()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(STORE_INTERVAL_S)
            try:
                await self.flush()
            except Exception:
                fatal("storing events failed")


async def _cancelled(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def frame_of(ident: str, name: str, data: bytes) -> bytes:
    """``bench.peers.bare_relay.frame`` of a payload already encoded."""
    return b"id: %s\nevent: %s\ndata: %s\n\n" % (ident.encode(), name.encode(), data)


class GuardedRelay(Relay):
    """The bare relay's runs and read (``Relay``), each event kept in Redis and the store."""

    def __init__(self, base_url: str, model: str, redis_url: str, prefix: str, db_path: str) -> None:
        super().__init__(base_url, model)
        self.appender = Appender(redis_url, prefix)
        self.store = Store(db_path)

    async def start(self) -> None:
        await super().start()
        await self.appender.start()
        await self.store.start()

    async def stop(self) -> None:
        await super().stop()
        await self.appender.stop()
        await self.store.stop()

    async def begin_stored(self, conversation_id: str, message: str) -> str:
        """``begin`` once the run's row is stored."""
        run_id = uuid.uuid4().hex
        await self.store.write("INSERT INTO runs VALUES (?, ?, 'running', NULL)", (run_id, conversation_id))
        return self.begin(conversation_id, message, run_id)

    def _publish(
        self, conversation_id: str, frames: Frames, ident: str, name: str, payload: dict[str, str]
    ) -> None:
        """Queue the event for the store and for Redis (its client gets it once Redis has it)."""
        data = orjson.dumps(payload)
        self.store.queued.append((conversation_id, ident, name, data.decode()))
        self.appender.append(conversation_id, ident, name, data, frames)

    async def _finish(
        self, conversation_id: str, run_id: str, frames: Frames, ident: str, status: str, answer: str
    ) -> None:
        data = orjson.dumps({"run_id": run_id, "status": status, "answer": answer})
        self.store.queued.append((conversation_id, ident, "done", data.decode()))
        try:
            # The run's events, its done the last, and its row's close in one transaction, before
            # the done goes out.
            await self.store.flush(
                "UPDATE runs SET status = ?, answer = ? WHERE id = ?", (status, answer, run_id)
            )
        except Exception:
            fatal("storing a run's end failed")
        self.appender.append(conversation_id, ident, "done", data, frames)
        self.appender.end(conversation_id, frames)


def create_app() -> Starlette:
    database = urlsplit(os.environ["DATABASE_URL"])
    if database.scheme != "sqlite+aiosqlite":
        raise SystemExit("the guarded relay stores in SQLite only (DATABASE_URL=sqlite+aiosqlite:///PATH)")
    relay = GuardedRelay(
        os.environ["LLM_BASE_URL"],
        os.environ.get("LLM_MODEL", "fake-model"),
        os.environ["REDIS_URL"],
        os.environ.get("REDIS_KEY_PREFIX", "guarded-relay"),
        database.path[1:],  # sqlite+aiosqlite:///relative or :////absolute
    )

    async def new_conversation(request: Request) -> Response:
        conversation_id = uuid.uuid4().hex
        await relay.store.write("INSERT INTO conversations VALUES (?, ?)", (conversation_id, time.time()))
        return JSONResponse({"id": conversation_id}, status_code=201)

    async def new_run(request: Request) -> Response:
        body = orjson.loads(await request.body())
        run_id = await relay.begin_stored(request.path_params["conversation_id"], str(body["message"]))
        return JSONResponse({"run_id": run_id}, status_code=202)

    return relay_app(relay.start, relay.stop, relay.runs, new_conversation, new_run)
