"""The tool registry: named async callables with JSON-schema parameters, run with a timeout.

An exception, a timeout or an unknown tool becomes a ``ToolResult`` with ``error`` set, never a
raised exception (E-26).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class Artifact:
    """A file a tool produced (HTML or markdown) that the UI previews; the LLM sees only a marker."""

    filename: str
    mime_type: str
    content: str


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """What a tool function may return instead of a plain string."""

    content: str
    artifact: Artifact | None = None


@dataclass(frozen=True, slots=True)
class ToolResult:
    content: str
    error: str | None = None
    artifact: Artifact | None = None
    error_type: str | None = None
    """What kind of failure ``error`` is, in a word (``timeout``, ``invalid_arguments``,
    ``not_found``, or the exception's class name), for traces."""

    @property
    def ok(self) -> bool:
        return self.error is None


ToolFunc = Callable[..., Awaitable[str | ToolOutput]]

ToolObserver = Callable[
    ["Tool | None", str, Mapping[str, Any], "ToolInvocation | None", Callable[[], Awaitable[ToolResult]]],
    Awaitable[ToolResult],
]
"""Wraps every execution of a registry that has one (``ToolRegistry.observed``): called with the
tool (None if unknown), its name, the arguments, the invocation and the execution itself, which
it awaits once and whose result it returns (traces: ``app.tracing``)."""


@dataclass(frozen=True, slots=True)
class ToolInvocation:
    """Who calls a tool and under which key, for tools that take it (``Tool.takes_invocation``).

    ``idempotency_key`` is ``"<run_id>:<call_id>"``: the same for every execution of one call, also
    one repeated by a new attempt of the run after a crash (RUNS.md R-05), so a tool with storage
    of its own can make a repeat harmless.
    """

    idempotency_key: str
    owner: str = ""
    run_id: str = ""
    conversation_id: str = ""
    call_id: str = ""


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]
    func: ToolFunc
    writes: bool = False
    """Marks tools with side effects; the read-only hook blocks them."""
    timeout_s: float = 30.0
    idempotent: bool = False
    """Running the same call twice does no harm (it only reads or computes, or its storage honours
    the idempotency key): a call cut off by a crash is run again (RUNS.md R-05). Otherwise the model
    is told that the call was interrupted and may or may not have taken effect."""
    takes_invocation: bool = False
    """``func`` takes the keyword argument ``invocation`` (a ``ToolInvocation``)."""
    client: bool = False
    """A tool the client runs (FACES.md C-01): offered to the model, never run here; a call of it
    waits for its result from the client (``func`` is never called)."""

    def one_line(self, width: int = 80) -> str:
        """Compact catalog line for tool selection: name and first line of the description."""
        first = self.description.strip().splitlines()[0] if self.description.strip() else ""
        line = f"{self.name}: {first}"
        return line if len(line) <= width else line[: width - 1] + "…"

    def openai_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@dataclass(slots=True)
class ToolRegistry:
    _tools: dict[str, Tool] = field(default_factory=dict)
    _observer: ToolObserver | None = None

    def observed(self, observer: ToolObserver) -> ToolRegistry:
        """This registry's tools, each execution passed through ``observer`` (subsets too)."""
        return ToolRegistry(self._tools, observer)

    @classmethod
    def of(cls, tools: Iterable[Tool]) -> ToolRegistry:
        reg = cls()
        for tool in tools:
            reg.register(tool)
        return reg

    def register(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Any:
        return iter(self._tools.values())

    def names(self) -> list[str]:
        return list(self._tools)

    def with_tools(self, tools: Iterable[Tool]) -> ToolRegistry:
        """This registry with ``tools`` added after its own (a name it has is refused)."""
        reg = ToolRegistry(dict(self._tools), self._observer)
        for tool in tools:
            reg.register(tool)
        return reg

    def subset(self, names: Iterable[str]) -> ToolRegistry:
        """A registry of the named tools that exist here, in the order given; unknown names are skipped."""
        reg = ToolRegistry(_observer=self._observer)
        for name in names:
            tool = self._tools.get(name)
            if tool is not None and name not in reg:
                reg.register(tool)
        return reg

    def openai_schemas(self) -> list[dict[str, Any]]:
        return [t.openai_schema() for t in self._tools.values()]

    async def execute(
        self, name: str, args: Mapping[str, Any], *, invocation: ToolInvocation | None = None
    ) -> ToolResult:
        if self._observer is None:
            return await self._execute_clean(name, args, invocation)
        return await self._observer(
            self._tools.get(name), name, args, invocation, lambda: self._execute_clean(name, args, invocation)
        )

    async def _execute_clean(
        self, name: str, args: Mapping[str, Any], invocation: ToolInvocation | None
    ) -> ToolResult:
        return _encodable(await self._execute(name, args, invocation))

    async def _execute(
        self, name: str, args: Mapping[str, Any], invocation: ToolInvocation | None
    ) -> ToolResult:
        tool = self._tools.get(name)
        if tool is None:
            available = ", ".join(self._tools) or "none"
            return ToolResult(
                content="",
                error=f"Tool '{name}' not found. Available tools: {available}",
                error_type="not_found",
            )
        kwargs = dict(args)
        if tool.takes_invocation:
            # Never the model's to set: a key it made up could make a real call look like a repeat.
            kwargs["invocation"] = invocation or ToolInvocation(idempotency_key="")
        try:
            out = await asyncio.wait_for(tool.func(**kwargs), timeout=tool.timeout_s)
        except TimeoutError:
            return ToolResult(
                content="", error=f"Tool '{name}' timed out after {tool.timeout_s:g}s", error_type="timeout"
            )
        except TypeError as exc:
            return ToolResult(
                content="",
                error=f"Invalid arguments for tool '{name}': {exc}",
                error_type="invalid_arguments",
            )
        except Exception as exc:
            return ToolResult(content="", error=f"{type(exc).__name__}: {exc}", error_type=type(exc).__name__)
        if isinstance(out, ToolOutput):
            return ToolResult(content=out.content, artifact=out.artifact)
        return ToolResult(content=str(out))


# NUL and lone surrogates (a tool that read binary data, a file name decoded with surrogateescape)
# have no place in UTF-8 JSON events, and PostgreSQL refuses NUL in text: U+FFFD stands in for them.
_UNENCODABLE = re.compile("[\x00\ud800-\udfff]")


def _clean(text: str) -> str:
    return _UNENCODABLE.sub("\ufffd", text)


def _encodable(result: ToolResult) -> ToolResult:
    artifact = result.artifact
    if artifact is not None:
        artifact = replace(artifact, filename=_clean(artifact.filename), content=_clean(artifact.content))
    error = _clean(result.error) if result.error is not None else None
    return ToolResult(
        content=_clean(result.content), error=error, artifact=artifact, error_type=result.error_type
    )


async def _client_runs_it(**_: Any) -> str:
    raise RuntimeError("a tool the client runs is never run by the service")


def client_tool(name: str, description: str, parameters: Mapping[str, Any]) -> Tool:
    """A tool the client runs (FACES.md C-01), as the model is offered it."""
    return Tool(name, description, dict(parameters), _client_runs_it, client=True)
