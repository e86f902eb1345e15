"""Tool selection: one cheap LLM call that narrows a large registry to the tools a question needs.

The caller decides whether selection runs (more than ``TOOL_SELECTION_THRESHOLD`` tools, E-12) and
emits the phase event; ``select_tools`` only picks, and falls back to the full registry whenever the
pick is unusable (E-13).
"""

from __future__ import annotations

import logging
from typing import Any

from app.engine.events import Usage
from app.engine.structured import structured_llm_call
from app.llm.base import LLM, ChatMessage
from app.tools.registry import ToolRegistry

logger = logging.getLogger(__name__)

TOOL_SELECTION_MAX = 6
CATALOG_LINE_WIDTH = 80

SELECTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"tools": {"type": "array", "items": {"type": "string"}}},
    "required": ["tools"],
}


class _NotAToolList(ValueError):
    """The model's object has no ``tools`` list of names."""


def tool_catalog(registry: ToolRegistry) -> str:
    """One line a tool, ``name: first line of the description``, cut to about 80 chars; no schemas."""
    return "\n".join(tool.one_line(CATALOG_LINE_WIDTH) for tool in registry)


def _tool_names(raw: dict[str, Any]) -> list[str]:
    tools = raw.get("tools")
    if not isinstance(tools, list):
        raise _NotAToolList(f"'tools' is {type(tools).__name__}, expected a list of tool names")
    return [name.strip() for name in tools if isinstance(name, str) and name.strip()]


def _selection_messages(question: str, catalog: str, max_tools: int) -> list[ChatMessage]:
    system = (
        "You choose which tools an assistant will have for one user request. From the catalog below, "
        f"pick at most {max_tools} tools that are most relevant to the request, most useful first. "
        'Answer with a JSON object {"tools": ["tool_name", ...]} using the exact names from the '
        "catalog.\n\nCatalog (name: description):\n"
        f"{catalog}"
    )
    return [ChatMessage(role="system", content=system), ChatMessage(role="user", content=question)]


def _valid_names(names: list[str], registry: ToolRegistry) -> list[str]:
    # Models sometimes change the case of a name; match exactly first, then case-insensitively.
    by_lower = {name.lower(): name for name in registry.names()}
    valid: list[str] = []
    for name in names:
        resolved = name if name in registry else by_lower.get(name.lower())
        if resolved is not None and resolved not in valid:
            valid.append(resolved)
    return valid


async def select_tools(
    llm: LLM,
    question: str,
    registry: ToolRegistry,
    *,
    usage: Usage,
    max_tools: int = TOOL_SELECTION_MAX,
) -> ToolRegistry:
    """The subset of ``registry`` the model picks for ``question`` (at most ``max_tools``).

    Never raises except on cancellation: unparseable output, no valid names, an empty pick or any
    exception give back the full registry.
    """
    try:
        result = await structured_llm_call(
            llm,
            _selection_messages(question, tool_catalog(registry), max_tools),
            schema=SELECTION_SCHEMA,
            schema_name="select_tools",
            parse_fn=_tool_names,
            usage=usage,
        )
        selected = _valid_names(result.value, registry)[: max(max_tools, 0)]
    except Exception as exc:  # CancelledError is a BaseException and passes through
        logger.warning("tool_selection_failed fallback=all_tools error=%s: %s", type(exc).__name__, exc)
        return registry
    if not selected:
        logger.warning("tool_selection_empty fallback=all_tools picked=%r", result.value)
        return registry
    logger.info("tool_selection total=%d selected=%s", len(registry), ",".join(selected))
    return registry.subset(selected)
