"""The floor of the knee benchmark (issue 29): a bare relay of one chat call per run, as SSE.

What a Python worker of this stack costs when it does nothing but relay: Starlette on uvicorn (the
server AgentStream's workers run on, same flags), one streaming chat call per run through aiohttp,
each answer token put on the run's ``asyncio.Queue`` as a ready SSE frame and sent from there. No
engine (no tool loop: the call offers no tools, so the fake LLM answers at once), no Redis, no
database, no resume, no authentication. ``bench/capacity_bench.py knee --subjects floor`` drives it
with the same load generator (``bench/capacity_client.agentstream_run``), pinning and fake LLM as
AgentStream, so it speaks the slice of AgentStream's API that generator uses:

* ``POST /api/conversations`` -> 201 ``{"id"}``;
* ``POST /api/conversations/{id}/runs`` ``{"message"}`` -> 202 ``{"run_id"}``, the call started;
* ``GET /api/conversations/{id}/stream`` -> ``answer`` events ``{"run_id", "status": "delta",
  "content"}`` with ids ``<ms>-<seq>`` (the publish time, which the generator splits the delay at),
  then ``done`` ``{"run_id", "status": "completed", "answer"}``; the stream ends after ``done``.

Run (the project's venv: aiohttp is a dependency of the app's LLM client)::

    LLM_BASE_URL=http://127.0.0.1:PORT/v1 python -m uvicorn bench.peers.bare_relay:create_app --factory
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

Frames = asyncio.Queue[bytes | None]
"""A run's SSE frames, None after its last."""


def frame(ident: str, event: str, payload: dict[str, str]) -> bytes:
    return b"id: %s\nevent: %s\ndata: %s\n\n" % (ident.encode(), event.encode(), orjson.dumps(payload))


class Relay:
    """The runs in flight (one per conversation) and the one HTTP client session of the process."""

    def __init__(self, base_url: str, model: str) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.runs: dict[str, Frames] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)  # one connection per run in flight, no cap
        self.session = aiohttp.ClientSession(connector=connector)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def begin(self, conversation_id: str, message: str, run_id: str | None = None) -> str:
        run_id = run_id or uuid.uuid4().hex
        frames: Frames = asyncio.Queue()
        self.runs[conversation_id] = frames
        task = asyncio.create_task(self._relay(conversation_id, run_id, message, frames))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return run_id

    def _publish(
        self, conversation_id: str, frames: Frames, ident: str, name: str, payload: dict[str, str]
    ) -> None:
        """An answer token's event: straight to its client."""
        frames.put_nowait(frame(ident, name, payload))

    async def _finish(
        self, conversation_id: str, run_id: str, frames: Frames, ident: str, status: str, answer: str
    ) -> None:
        """The run's ``done``, and the end of its client's stream."""
        frames.put_nowait(frame(ident, "done", {"run_id": run_id, "status": status, "answer": answer}))
        frames.put_nowait(None)

    async def _relay(self, conversation_id: str, run_id: str, message: str, frames: Frames) -> None:
        """The chat call, each answer token an event (``_publish``), then ``_finish``: the read
        of ``bench/peers/guarded_relay.py`` too, which keeps what it publishes."""
        assert self.session is not None
        body = {"model": self.model, "messages": [{"role": "user", "content": message}], "stream": True}
        parts: list[str] = []
        seq, last_ms = 0, 0
        status = "completed"
        try:
            async with self.session.post(self.url, json=body) as response:
                response.raise_for_status()
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        break
                    choices = orjson.loads(data).get("choices") or ()
                    content = choices[0].get("delta", {}).get("content") if choices else None
                    if not content:
                        continue
                    parts.append(content)
                    now_ms = max(time.time_ns() // 1_000_000, last_ms)  # ids never go back
                    seq = seq + 1 if now_ms == last_ms else 0
                    last_ms = now_ms
                    payload = {"run_id": run_id, "status": "delta", "content": content}
                    self._publish(conversation_id, frames, f"{now_ms}-{seq}", "answer", payload)
        except (aiohttp.ClientError, ValueError, TimeoutError):
            status = "failed"
        ident = f"{max(last_ms + 1, time.time_ns() // 1_000_000)}-0"
        await self._finish(conversation_id, run_id, frames, ident, status, "".join(parts))


async def _frames(frames: Frames) -> AsyncIterator[bytes]:
    while (data := await frames.get()) is not None:
        yield data


def create_app() -> Starlette:
    relay = Relay(os.environ["LLM_BASE_URL"], os.environ.get("LLM_MODEL", "fake-model"))

    async def new_conversation(request: Request) -> Response:
        return JSONResponse({"id": uuid.uuid4().hex}, status_code=201)

    async def new_run(request: Request) -> Response:
        body = orjson.loads(await request.body())
        run_id = relay.begin(request.path_params["conversation_id"], str(body["message"]))
        return JSONResponse({"run_id": run_id}, status_code=202)

    return relay_app(relay.start, relay.stop, relay.runs, new_conversation, new_run)


def relay_app(
    start: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    runs: dict[str, Frames],
    new_conversation: Callable[[Request], Awaitable[Response]],
    new_run: Callable[[Request], Awaitable[Response]],
) -> Starlette:
    """The slice of AgentStream's API the load generator uses, for a relay whose runs put their
    frames on ``runs[conversation_id]`` (this one's, and ``bench/peers/guarded_relay.py``'s)."""

    async def stream(request: Request) -> Response:
        frames = runs.pop(request.path_params["conversation_id"], None)
        if frames is None:
            return Response(status_code=204)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(_frames(frames), media_type="text/event-stream", headers=headers)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    routes = [
        Route("/api/conversations", new_conversation, methods=["POST"]),
        Route("/api/conversations/{conversation_id}/runs", new_run, methods=["POST"]),
        Route("/api/conversations/{conversation_id}/stream", stream, methods=["GET"]),
        Route("/readyz", health, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await start()
        try:
            yield
        finally:
            await stop()

    return Starlette(routes=routes, lifespan=lifespan)
