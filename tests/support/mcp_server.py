"""A small MCP server for tests, built on the official SDK; runs over stdio or streamable HTTP.

Tools: ``add(a, b)`` (integers), ``shout(text)`` (upper case with "!"), ``fail(message)`` (an MCP
error result), ``wait(seconds)`` (sleeps, for timeouts), ``echo_env(name)`` (an environment
variable of the server process, so a test can check the config's ``env``), and for the durable-run
tests ``send(to)`` (a side effect: must not run twice) and ``lookup(key)`` (read-only, so
idempotent), and ``inspect(path)``, read-only too, which kills the service that called it (a run
whose attempts keep dying). Those two append a JSON line to the file ``$MCP_JOURNAL`` when they start and when
they end, with the ``idempotency_key`` and ``traceparent`` of the request's ``_meta``; while a file
``$MCP_JOURNAL.hold.<tool>`` exists they wait (so a test can kill the service in the middle of a call).

    python -m tests.support.mcp_server                      # stdio
    python -m tests.support.mcp_server --http --port 0      # streamable HTTP at /mcp

Over HTTP it prints ``http://127.0.0.1:<port>/mcp`` on its first line once it accepts connections,
and serves until it gets SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Sequence

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

SERVER_NAME = "agentstream-test-tools"


def build_server() -> MCPServer:
    server: MCPServer = MCPServer(SERVER_NAME, log_level="WARNING")

    @server.tool(description="Add two integers and return the sum.")
    def add(a: int, b: int) -> int:
        return a + b

    @server.tool(description="Return the text in upper case, shouted.")
    def shout(text: str) -> str:
        return text.upper() + "!"

    @server.tool(description="Always fails with the given message.")
    def fail(message: str) -> str:
        raise ToolError(message)

    @server.tool(description="Wait for the given number of seconds, then say so.")
    async def wait(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return f"waited {seconds:g}s"

    @server.tool(description="The value of an environment variable of the server process.")
    def echo_env(name: str) -> str:
        return os.environ.get(name, "<unset>")

    @server.tool(description="Send a message to someone (it cannot be unsent).")
    async def send(to: str, ctx: Context) -> str:
        return await _journaled("send", to, ctx)

    @server.tool(description="Look a key up (reads only).", annotations=ToolAnnotations(readOnlyHint=True))
    async def lookup(key: str, ctx: Context) -> str:
        return await _journaled("lookup", key, ctx)

    @server.tool(
        description="Inspect a file (reads only; kills the service that calls it: a poison call).",
        annotations=ToolAnnotations(readOnlyHint=True),
    )
    async def inspect(path: str, ctx: Context) -> str:
        journal = os.environ.get("MCP_JOURNAL")
        meta = ctx.request_context.meta or {}
        if journal:
            key = meta.get("idempotency_key")
            _append(journal, {"tool": "inspect", "arg": path, "key": key, "at": "start"})
        os.kill(os.getppid(), signal.SIGKILL)  # the service that started this server over stdio
        return "unreachable"

    return server


async def _journaled(tool: str, arg: str, ctx: Context) -> str:
    journal = os.environ.get("MCP_JOURNAL")
    meta = ctx.request_context.meta or {}
    entry = {
        "tool": tool,
        "arg": arg,
        "key": meta.get("idempotency_key"),
        "traceparent": meta.get("traceparent"),
        "pid": os.getpid(),
    }
    if journal:
        _append(journal, {**entry, "at": "start"})
        await asyncio.to_thread(_wait_while_held, f"{journal}.hold.{tool}")
        _append(journal, {**entry, "at": "end"})
    return f"{tool} {arg}: done"


def _wait_while_held(hold: str, timeout_s: float = 60.0) -> None:
    """The test's hold is a file (the test and this server are different processes)."""
    deadline = time.monotonic() + timeout_s
    while os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.01)


def _append(path: str, entry: dict[str, object]) -> None:
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(entry) + "\n")


async def _serve_http(host: str, port: int) -> None:
    import uvicorn

    server = build_server()
    app = server.streamable_http_app(host=host)
    # Bind and listen before printing: the kernel queues connections made before uvicorn accepts
    # them, so the printed URL is usable at once, even with --port 0.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    sock.setblocking(False)
    web = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    web.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(web, "should_exit", True))
    print(f"http://{host}:{sock.getsockname()[1]}/mcp", flush=True)
    await web.serve(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="MCP test server (stdio by default).")
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args(argv)
    if args.http:
        asyncio.run(_serve_http(args.host, args.port))
    else:
        build_server().run("stdio")


if __name__ == "__main__":
    main()
