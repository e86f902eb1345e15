"""A small MCP server for tests, built on the official SDK; runs over stdio or streamable HTTP.

Tools: ``add(a, b)`` (integers), ``shout(text)`` (upper case with "!"), ``fail(message)`` (an MCP
error result), ``wait(seconds)`` (sleeps, for timeouts), ``echo_env(name)`` (an environment
variable of the server process, so a test can check the config's ``env``).

    python -m tests.support.mcp_server                      # stdio
    python -m tests.support.mcp_server --http --port 0      # streamable HTTP at /mcp

Over HTTP it prints ``http://127.0.0.1:<port>/mcp`` on its first line once it accepts connections,
and serves until it gets SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
from collections.abc import Sequence

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

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

    return server


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
