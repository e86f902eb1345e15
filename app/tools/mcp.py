"""Tools from MCP servers, registered in the tool registry like the built-ins.

``MCP_SERVERS`` is a JSON list; each entry is one server, reached over stdio (the service starts
the command) or streamable HTTP::

    [{"name": "files", "transport": "stdio", "command": "python", "args": ["-m", "my_server"],
      "env": {"ROOT": "/srv"}, "cwd": null},
     {"name": "web", "transport": "http", "url": "http://127.0.0.1:9000/mcp",
      "headers": {"Authorization": "Bearer ..."}}]

Optional on both: ``timeout_s`` (one tool call, default 30) and ``connect_timeout_s`` (start-up and
tool listing, default 15). ``parse_mcp_servers`` validates the list and raises ``MCPConfigError``
naming the bad entry, so a typo stops the service at start-up instead of silently losing tools.

``MCPToolset.connect`` opens every server concurrently. A server that cannot be started or reached
is logged and skipped: the service runs with the tools it has. Each of the others stays connected
for the app's lifetime in a task of its own (the SDK's task groups must be entered and left by one
task, and a server dying must not take the app's lifespan task down with it). Each MCP tool becomes
a ``Tool`` named ``<server>__<tool>`` whose function calls the server; an MCP error result raises
``MCPToolError``, which the registry turns into an error observation like any tool failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Annotated, Any, Literal, TextIO

import orjson
from opentelemetry import propagate
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from app.tools.registry import Tool, ToolInvocation, ToolRegistry

log = logging.getLogger("app.tools.mcp")

SEPARATOR = "__"
MAX_TOOL_NAME = 64
"""OpenAI-compatible providers accept function names of at most 64 characters of ``[A-Za-z0-9_-]``."""
MAX_OBSERVATION_CHARS = 100_000
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]")


class MCPConfigError(ValueError):
    """``MCP_SERVERS`` is not a valid list of MCP server configs; the message says which entry and why."""


class MCPToolError(RuntimeError):
    """The MCP server answered a tool call with an error result."""


class MCPServerUnavailableError(RuntimeError):
    """The MCP server of a tool is no longer connected."""


class _ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    timeout_s: float = Field(default=30.0, gt=0, le=3600)
    connect_timeout_s: float = Field(default=15.0, gt=0, le=600)

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not _NAME_RE.match(value) or SEPARATOR in value:
            raise ValueError(
                "must be 1 to 32 letters, digits, '-' or '_', start with a letter or digit, "
                f"and not contain {SEPARATOR!r} (it separates server and tool in tool names)"
            )
        return value


class StdioServerConfig(_ServerConfig):
    transport: Literal["stdio"]
    command: str = Field(min_length=1)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    """Added to a minimal inherited environment (PATH, HOME, ...), not to the service's own."""
    cwd: str | None = None


class HttpServerConfig(_ServerConfig):
    transport: Literal["http"]
    url: str
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError("must be an http:// or https:// URL, e.g. http://127.0.0.1:9000/mcp")
        return value


MCPServerConfig = Annotated[StdioServerConfig | HttpServerConfig, Field(discriminator="transport")]
_CONFIG_LIST: TypeAdapter[list[MCPServerConfig]] = TypeAdapter(list[MCPServerConfig])


def parse_mcp_servers(raw: str | None) -> list[StdioServerConfig | HttpServerConfig]:
    """The server configs of ``MCP_SERVERS`` (None or blank: none); raises ``MCPConfigError``."""
    if raw is None or not raw.strip():
        return []
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MCPConfigError(f"MCP_SERVERS is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise MCPConfigError("MCP_SERVERS must be a JSON list of server objects (see README, 'MCP tools')")
    try:
        configs = _CONFIG_LIST.validate_python(data)
    except ValidationError as exc:
        problems = "; ".join(_describe(err, data) for err in exc.errors())
        raise MCPConfigError(f"MCP_SERVERS: {problems}") from None
    seen: set[str] = set()
    for config in configs:
        if config.name in seen:
            raise MCPConfigError(f"MCP_SERVERS: the server name {config.name!r} is used twice")
        seen.add(config.name)
    return configs


def _describe(err: Mapping[str, Any], data: list[Any]) -> str:
    loc: list[Any] = list(err.get("loc", ()))
    where = "entry"
    if loc and isinstance(loc[0], int):
        index = loc.pop(0)
        entry = data[index] if index < len(data) else None
        name = entry.get("name") if isinstance(entry, dict) else None
        where = f"entry {index}" + (f" ({name!r})" if isinstance(name, str) else "")
        if loc and str(loc[0]) in ("stdio", "http"):
            loc.pop(0)  # the union member pydantic tried, which "transport" already says
    field = ".".join(str(part) for part in loc)
    message = str(err.get("msg", "invalid"))
    if err.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        message = '\'transport\' must be "stdio" or "http"'
        field = ""
    return f"{where}: {field + ': ' if field else ''}{message}"


# ---- results -----------------------------------------------------------------------------------


def result_text(result: Any) -> str:
    """A ``CallToolResult``'s content as one text observation (text blocks as is, others described)."""
    parts: list[str] = []
    for block in result.content or ():
        kind = getattr(block, "type", "content")
        if kind == "text":
            parts.append(str(block.text))
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {block.mime_type}, {len(block.data)} base64 characters]")
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            parts.append(str(text) if text is not None else f"[binary resource {resource.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource link {block.uri}]")
        else:
            parts.append(f"[{kind} content]")
    if not parts and result.structured_content is not None:
        parts.append(orjson.dumps(result.structured_content, default=str).decode())
    text = "\n".join(parts)
    if len(text) > MAX_OBSERVATION_CHARS:
        text = text[:MAX_OBSERVATION_CHARS] + f"\n[… cut at {MAX_OBSERVATION_CHARS} characters]"
    return text


def tool_name(server: str, tool: str) -> str:
    """``<server>__<tool>``, with characters providers reject replaced and the length bounded."""
    return f"{server}{SEPARATOR}{_UNSAFE_NAME_CHARS.sub('_', tool)}"[:MAX_TOOL_NAME]


def _root_cause(exc: BaseException) -> BaseException:
    # The SDK's task groups wrap the real error in (nested) exception groups.
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _describe_error(exc: BaseException) -> str:
    cause = _root_cause(exc)
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


def _start_failure(config: StdioServerConfig | HttpServerConfig, exc: BaseException) -> str:
    cause = _root_cause(exc)
    if isinstance(cause, TimeoutError):
        return f"no answer within {config.connect_timeout_s:g}s"
    if isinstance(config, StdioServerConfig) and isinstance(cause, OSError):
        return f"cannot run {config.command!r}: {cause.strerror or cause}"
    return _describe_error(cause)


def _child_errlog() -> TextIO:
    # The child's stderr needs a real file descriptor; under some test runners sys.stderr has none.
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
    return sys.stderr


# ---- connections -------------------------------------------------------------------------------


class MCPConnection:
    """One MCP server, connected by a task of its own until ``close()``."""

    def __init__(self, config: StdioServerConfig | HttpServerConfig) -> None:
        self.config = config
        self.tools: list[Any] = []
        """The server's MCP tool descriptions, as listed when it connected."""
        self._client: Any = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def connected(self) -> bool:
        return self._client is not None

    async def open(self) -> None:
        """Start the server (or reach it), and list its tools; raises if that fails or takes too long."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._hold(ready), name=f"mcp-{self.name}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout=self.config.connect_timeout_s)
        except BaseException:
            await self.close()
            raise

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        from mcp import Client

        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(Client(await self._transport(stack)))
                self.tools = await self._list_tools(client)
                self._client = client
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                # Once open() gave up (stop is set) nobody waits on ``ready``: a cancelled future
                # reports nothing later, a failed one would be logged as never retrieved.
                if isinstance(exc, Exception) and not self._stop.is_set():
                    ready.set_exception(exc)
                else:
                    ready.cancel()
            elif not self._stop.is_set():
                log.warning(
                    "MCP server disconnected; its tools fail until the service restarts",
                    extra={"mcp_server": self.name, "error": _describe_error(exc)},
                )
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._client = None

    async def _transport(self, stack: AsyncExitStack) -> Any:
        config = self.config
        if isinstance(config, StdioServerConfig):
            from mcp.client.stdio import StdioServerParameters, stdio_client

            params = StdioServerParameters(
                command=config.command, args=config.args, env=config.env or None, cwd=config.cwd
            )
            return stdio_client(params, errlog=_child_errlog())
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        # Read timeout as the SDK's own default: a server may hold a response stream open.
        http = await stack.enter_async_context(
            httpx2.AsyncClient(headers=config.headers, timeout=httpx2.Timeout(30.0, read=300.0))
        )
        return streamable_http_client(config.url, http_client=http)

    @staticmethod
    async def _list_tools(client: Any) -> list[Any]:
        tools: list[Any] = []
        cursor: str | None = None
        for _ in range(100):  # a server that pages forever must not hang start-up
            page = await client.list_tools(cursor=cursor)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        return tools

    async def call(self, tool: str, arguments: Mapping[str, Any], *, idempotency_key: str = "") -> str:
        """Call one of the server's tools; its error result raises ``MCPToolError``.

        ``idempotency_key`` goes in the request's ``_meta`` (RUNS.md R-05): a server with storage of
        its own can make a repeated call harmless."""
        client = self._client
        if client is None:
            raise MCPServerUnavailableError(f"MCP server {self.name!r} is not connected")
        # The registry bounds the call at timeout_s and reports it; the SDK's own timeout, a little
        # later, is the backstop that frees the request on the session if that ever fails.
        result = await client.call_tool(
            tool,
            dict(arguments),
            read_timeout_seconds=self.config.timeout_s + 1.0,
            meta=_meta(idempotency_key),
        )
        text = result_text(result)
        if result.is_error:
            raise MCPToolError(text or f"MCP tool {tool!r} failed without saying why")
        return text

    async def close(self) -> None:
        self._stop.set()
        task = self._task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
        except (TimeoutError, Exception):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _make_tool(connection: MCPConnection, mcp_tool: Any, name: str) -> Tool:
    remote_name = str(mcp_tool.name)

    async def call_mcp_tool(invocation: ToolInvocation, **arguments: Any) -> str:
        return await connection.call(remote_name, arguments, idempotency_key=invocation.idempotency_key)

    schema = mcp_tool.input_schema if isinstance(mcp_tool.input_schema, dict) else {}
    if schema.get("type") != "object":
        schema = {"properties": {}, **schema, "type": "object"}
    annotations = mcp_tool.annotations
    read_only = bool(annotations is not None and annotations.read_only_hint)
    description = (mcp_tool.description or "").strip() or (
        f"Tool {remote_name!r} of the MCP server {connection.name!r}."
    )
    return Tool(
        name=name,
        description=description,
        parameters=schema,
        func=call_mcp_tool,
        # MCP's default is "may change things" unless the server says the tool only reads.
        writes=not read_only,
        timeout_s=connection.config.timeout_s,
        # A call cut off by a crash runs again only when the server says that does no harm.
        idempotent=read_only or bool(annotations is not None and annotations.idempotent_hint),
        takes_invocation=True,
    )


class MCPToolset:
    """Every connected MCP server of the app and the ``Tool`` objects made from their tools."""

    def __init__(self, connections: Sequence[MCPConnection] = ()) -> None:
        self.connections = list(connections)

    @classmethod
    async def connect(cls, configs: Sequence[StdioServerConfig | HttpServerConfig]) -> MCPToolset:
        """Connect to every server at once; those that fail are logged and left out."""
        candidates = [MCPConnection(config) for config in configs]
        outcomes = await asyncio.gather(*(c.open() for c in candidates), return_exceptions=True)
        connected: list[MCPConnection] = []
        for connection, outcome in zip(candidates, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                reason = _start_failure(connection.config, outcome)
                log.error(
                    "MCP server could not be started or reached; continuing without its tools",
                    extra={"mcp_server": connection.name, "error": reason},
                )
                continue
            log.info(
                "MCP server connected",
                extra={"mcp_server": connection.name, "tools": len(connection.tools)},
            )
            connected.append(connection)
        return cls(connected)

    def tools(self) -> list[Tool]:
        out: list[Tool] = []
        seen: set[str] = set()
        for connection in self.connections:
            for mcp_tool in connection.tools:
                name = tool_name(connection.name, str(mcp_tool.name))
                if name in seen:
                    log.warning(
                        "MCP tool skipped: its name clashes with another after clean-up",
                        extra={"mcp_server": connection.name, "tool": mcp_tool.name},
                    )
                    continue
                seen.add(name)
                out.append(_make_tool(connection, mcp_tool, name))
        return out

    def register_into(self, registry: ToolRegistry) -> list[str]:
        """Register every MCP tool; returns the names registered (clashes are logged and skipped)."""
        names: list[str] = []
        for tool in self.tools():
            if tool.name in registry:
                log.warning("MCP tool skipped: a tool of that name exists", extra={"tool": tool.name})
                continue
            registry.register(tool)
            names.append(tool.name)
        return names

    async def aclose(self) -> None:
        await asyncio.gather(*(c.close() for c in self.connections), return_exceptions=True)
        self.connections.clear()


async def connect_mcp_tools(raw_config: str | None, registry: ToolRegistry) -> MCPToolset:
    """Parse ``MCP_SERVERS`` (``MCPConfigError`` if invalid), connect, and register the tools."""
    toolset = await MCPToolset.connect(parse_mcp_servers(raw_config))
    toolset.register_into(registry)
    return toolset


def _meta(idempotency_key: str) -> dict[str, Any] | None:
    """A call's ``_meta``: its idempotency key, and the calling span's context (``traceparent``,
    as the MCP semantic conventions carry it) when the service traces."""
    meta: dict[str, Any] = {"idempotency_key": idempotency_key} if idempotency_key else {}
    propagate.inject(meta)
    return meta or None


__all__ = [
    "HttpServerConfig",
    "MCPConfigError",
    "MCPConnection",
    "MCPServerConfig",
    "MCPServerUnavailableError",
    "MCPToolError",
    "MCPToolset",
    "StdioServerConfig",
    "connect_mcp_tools",
    "parse_mcp_servers",
    "result_text",
    "tool_name",
]
