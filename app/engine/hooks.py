"""PreToolUse / PostToolUse hook points (E-17, E-18) and the hooks users ask for.

Hooks run outside the LLM's control: the loop calls them around every tool execution, whatever the
model says. A PreToolUse hook may block (the reason becomes the observation), rewrite the
arguments, or cause side effects; a PostToolUse hook may rewrite the observation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from app.tools.registry import Tool, ToolResult


@dataclass(frozen=True, slots=True)
class ToolCallContext:
    run_id: str
    conversation_id: str
    iteration: int
    tool_name: str
    tool_args: Mapping[str, Any]
    tool: Tool | None
    """None when the model named a tool that does not exist."""


@dataclass(frozen=True, slots=True)
class PreToolDecision:
    allow: bool = True
    reason: str | None = None
    args: Mapping[str, Any] | None = None
    """Replacement arguments, or None to keep them."""


class PreToolUseHook(Protocol):
    async def pre_tool_use(self, ctx: ToolCallContext) -> PreToolDecision | None: ...


class PostToolUseHook(Protocol):
    async def post_tool_use(self, ctx: ToolCallContext, result: ToolResult) -> ToolResult | None:
        """Return a replacement result, or None to keep it."""
        ...
