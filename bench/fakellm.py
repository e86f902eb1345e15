"""The benchmarks' fake LLM: the test suite's fake OpenAI server playing one fixed agent job.

The job every subject does: ``K`` sequential calls of one tool, then an ``N``-token streamed answer.
A request that offers tools and carries fewer than ``K`` tool results gets the next tool call;
otherwise a streaming request gets the answer (pre-encoded once, so serving it costs next to
nothing) and a non-streaming one gets a short final answer (what the engine's loop reads before its
synthesis call).

Two extra serving paths the test server does not have:

* ``--timed``: answer tokens are sent one by one, ``--delay-s`` apart, and each carries its send
  time (``time.time()`` in microseconds) in its text, ``" t<micros>"``. A client on the same machine
  reads the token and computes the delivery latency with the same clock; the app needs no hook;
* ``--hold-s``: the first loop call of a run is held, without polling, for that many seconds (or
  until the process gets SIGUSR1), so runs stay active and quiet, for idle-connection tests.

Run it (from the repository root, with the project's venv)::

    python -m bench.fakellm --k 5 --tokens 200 [--tool add|calculator] [--timed --delay-s 0.02]

prints its base URL on the first line and serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from tests.support.fake_agents import answer_tokens
from tests.support.fake_openai import FakeOpenAIServer, FakeReply
from tests.support.fake_replies import _chunked

USAGE = (20, 10)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n"
)


def tool_args(tool: str, n: int) -> dict[str, Any]:
    if tool == "calculator":
        return {"expression": f"{n}+1"}
    return {"a": n, "b": 1}


def tool_results(body: Mapping[str, Any]) -> int:
    return sum(1 for m in body.get("messages") or () if isinstance(m, Mapping) and m.get("role") == "tool")


class _ToolCallReply(FakeReply):
    """A tool-call reply whose call id is unique across the run (the Agents SDK rejects reused ids)."""

    __slots__ = ("call_id",)
    call_id: str

    def _tool_calls_json(self) -> list[dict[str, Any]]:
        calls = super()._tool_calls_json()
        for call in calls:
            call["id"] = self.call_id
        return calls


def tool_call_reply(tool: str, n: int) -> FakeReply:
    reply = _ToolCallReply("tool_calls")
    reply.usage = USAGE
    reply.finish_reason = "tool_calls"
    reply.tool_call_list = [(tool, orjson.dumps(tool_args(tool, n)).decode())]
    reply.call_id = f"call_{n}_{tool}"
    return reply


class TimedStream:
    """Marker reply: stream ``tokens`` answer tokens, each stamped with its send time."""

    __slots__ = ("delay_s", "lead_s", "tokens")

    def __init__(self, tokens: int, delay_s: float, lead_s: float = 0.0) -> None:
        self.tokens = tokens
        self.delay_s = delay_s
        self.lead_s = lead_s


class Held:
    """Marker reply: hold the request until released, then answer ``then``."""

    __slots__ = ("then",)

    def __init__(self, then: FakeReply) -> None:
        self.then = then


class ReactJob:
    """The handler: K tool calls, then the answer."""

    def __init__(
        self,
        k: int,
        tokens: int,
        *,
        tool: str = "add",
        timed: bool = False,
        delay_s: float = 0.0,
        lead_s: float = 0.0,
        hold: bool = False,
    ) -> None:
        self.k = k
        self.tool = tool
        self.hold = hold
        self.answer_tokens = answer_tokens(tokens)
        self._calls = [tool_call_reply(tool, n) for n in range(k)]
        self._final = FakeReply.text("All additions are done.", usage=USAGE)
        self._answer: FakeReply | TimedStream = (
            TimedStream(tokens, delay_s, lead_s)
            if timed
            else FakeReply.stream(self.answer_tokens, usage=USAGE)
        )

    def __call__(self, body: dict[str, Any]) -> Any:
        done = tool_results(body)
        if body.get("tools") and done < self.k:
            reply = self._calls[done]
            if done == 0 and self.hold:
                return Held(reply)
            return reply
        if body.get("stream"):
            return self._answer
        return self._final


class BenchFakeServer(FakeOpenAIServer):
    """``FakeOpenAIServer`` with the timed and held serving paths."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.release = asyncio.Event()

    def _record(
        self, method: str, path: str, headers: dict[str, str], body: dict[str, Any] | None, query: str = ""
    ) -> None:
        # A benchmark sends hundreds of thousands of requests: keep none of them.
        return

    def _choose(self, body: dict[str, Any]) -> Any:
        assert self._handler is not None
        return self._handler(body)

    async def _answer(
        self, writer: asyncio.StreamWriter, reply: Any, body: dict[str, Any], keep_alive: bool
    ) -> bool:
        if isinstance(reply, Held):
            await self.release.wait()
            reply = reply.then
        if isinstance(reply, TimedStream):
            await self._write_timed(writer, reply, str(body.get("model") or "fake-model"))
            return True
        return await super()._answer(writer, reply, body, keep_alive)

    @staticmethod
    async def _write_timed(writer: asyncio.StreamWriter, plan: TimedStream, model: str) -> None:
        def frame(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> bytes:
            obj: dict[str, Any] = {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": 1_700_000_000,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if usage is None else [],
            }
            if usage is not None:
                obj["usage"] = usage
            return _chunked(b"data: " + orjson.dumps(obj) + b"\n\n")

        writer.write(SSE_HEAD + frame({"role": "assistant", "content": ""}))
        await writer.drain()
        if plan.lead_s > 0:
            await asyncio.sleep(plan.lead_s)
        for i in range(plan.tokens):
            if plan.delay_s > 0:
                await asyncio.sleep(plan.delay_s)
            # The stamp is taken right before the write: this is when the engine could have the token.
            text = f"{'' if i == 0 else ' '}w t{time.time_ns() // 1000}"
            writer.write(frame({"content": text}))
            await writer.drain()
        total = {
            "prompt_tokens": USAGE[0],
            "completion_tokens": plan.tokens,
            "total_tokens": USAGE[0] + plan.tokens,
        }
        writer.write(
            frame({}, "stop") + frame({}, usage=total) + _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        )
        await writer.drain()


_STAMP = re.compile(r"w t(\d+)")


def timed_args(k: int, tokens: int, delay_s: float, tool: str = "calculator") -> list[str]:
    """This server's command-line arguments for ``k`` tool calls, then ``tokens`` timed tokens
    ``delay_s`` apart (what the latency and capacity benchmarks start it with)."""
    return ["--k", str(k), "--tokens", str(tokens), "--tool", tool, "--timed", "--delay-s", str(delay_s)]


def parse_stamps(text: str) -> list[int]:
    """Send times (µs) of the timed tokens in ``text`` (one delta, or several merged), in order."""
    return [int(n) for n in _STAMP.findall(text)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The benchmarks' fake OpenAI-compatible LLM.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--k", type=int, default=5, help="tool calls before the answer")
    parser.add_argument("--tokens", type=int, default=200, help="tokens in the streamed answer")
    parser.add_argument("--tool", choices=["add", "calculator"], default="add")
    parser.add_argument("--timed", action="store_true", help="stamp each answer token with its send time")
    parser.add_argument("--delay-s", type=float, default=0.0, help="pause between timed tokens")
    parser.add_argument("--lead-s", type=float, default=0.0, help="pause before the first timed token")
    parser.add_argument("--hold-s", type=float, default=0.0, help="hold each run's first call this long")
    args = parser.parse_args(argv)

    server = BenchFakeServer(port=args.port)
    job = ReactJob(
        args.k,
        args.tokens,
        tool=args.tool,
        timed=args.timed,
        delay_s=args.delay_s,
        lead_s=args.lead_s,
        hold=args.hold_s > 0,
    )
    server.set_handler(job)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server.release = asyncio.Event()
        ready = asyncio.Event()
        serving = asyncio.ensure_future(server.serve_forever(ready))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, serving.cancel)
        loop.add_signal_handler(signal.SIGUSR1, server.release.set)
        if args.hold_s > 0:
            loop.call_later(args.hold_s, server.release.set)
        await asyncio.wait(
            [serving, asyncio.ensure_future(ready.wait())], return_when=asyncio.FIRST_COMPLETED
        )
        if ready.is_set():
            print(server.base_url, flush=True)
        with contextlib.suppress(asyncio.CancelledError):
            await serving

    try:
        import uvloop
    except ImportError:
        asyncio.run(run())
    else:
        uvloop.run(run())


if __name__ == "__main__":
    main(sys.argv[1:])
