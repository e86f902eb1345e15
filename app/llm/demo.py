"""``DemoLLM``: an offline, deterministic model that really plans with the built-in tools.

It is what the service runs when no ``LLM_BASE_URL`` is set, so a fresh checkout can show a whole run
(tool calls, streamed answer) with no key and no network. It reads the call it gets and plays the part
the engine asks for:

* a loop call (``tools`` given: native; a system prompt describing ``tool_call``/``final_answer``
  actions: JSON mode) plans tool calls for the question and for any ``[USER INTERRUPT]`` follow-ups,
  asks for those not made yet (all at once natively, one per reply in JSON mode), then gives a short
  final answer built from the tool results;
* a structured call (forced ``tool_choice``, ``response_format`` or a prompt naming a JSON schema)
  gets an object that fits the schema, e.g. ``{"tools": [...]}`` for tool selection;
* a context-compaction prompt gets a short summary;
* ``stream_chat`` turns the synthesis prompt's trace into a markdown answer, labelled as coming from
  the demo model, streamed word by word.

It recognises arithmetic, times in cities, unit conversions, word counts, reports and notes (its
planner is ``app.llm.demo_plan``); anything else gets a friendly answer saying what it can do.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.llm.base import ChatMessage, ChatResult, StreamEnd, StreamItem, TextDelta, TokenUsage, ToolCall
from app.llm.demo_plan import PlannedCall, math_expression, plan

__all__ = [
    "CAPABILITIES",
    "DEMO_NOTE",
    "INTERRUPT_MARKER",
    "DemoLLM",
    "PlannedCall",
    "estimate_tokens",
    "math_expression",
    "plan",
    "synthesize_answer",
]

DEMO_NOTE = (
    "_This answer comes from the built-in demo model, which runs offline and only knows the built-in "
    "tools. Set `LLM_BASE_URL` to use a real model._"
)
CAPABILITIES = (
    "I'm the built-in demo model, so I can only plan with the built-in tools. Try for example:\n"
    '- arithmetic: "What is 17*23?"\n'
    '- time zones: "What time is it in Tokyo?"\n'
    '- unit conversion: "Convert 5 km to miles"\n'
    "- text statistics: \"Count the words in 'to be or not to be'\"\n"
    '- a markdown report: "Write a report about solar power"\n'
    '- notes: "Save a note: buy milk", then "List my notes"\n'
    'Several questions at once work too: "What is 2**10 and what time is it in Paris?"'
)
INTERRUPT_MARKER = "[USER INTERRUPT]"
_FEEDBACK_PREFIXES = (
    "Observation",
    "[Self-reflection]",
    "Before you finish",
    "You have called",
    "Your previous",
    "[CONTEXT SUMMARY]",
    "[CONTEXT COMPACTED]",
)


@dataclass(frozen=True, slots=True)
class _Done:
    """A tool call the demo already asked for in this run, and what came back."""

    tool: str
    args: dict[str, Any]
    result: str | None


# -- reading the conversation ------------------------------------------------------------------


def _question_index(messages: Sequence[ChatMessage]) -> int | None:
    """Where this run's question is: the engine pins it; otherwise the last real user message."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "user" and m.pinned and not (m.content or "").startswith(INTERRUPT_MARKER):
            return i
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        content = (m.content or "").lstrip()
        if m.role == "user" and content and not content.startswith((*_FEEDBACK_PREFIXES, INTERRUPT_MARKER)):
            return i
    return None


def _follow_ups(messages: Sequence[ChatMessage]) -> list[str]:
    out: list[str] = []
    for m in messages:
        content = (m.content or "").strip()
        if m.role != "user" or not content.startswith(INTERRUPT_MARKER):
            continue
        body = content[len(INTERRUPT_MARKER) :].strip()
        if "while you were working:" in body:
            lines = body.split("while you were working:", 1)[1].splitlines()
            out.extend(re.sub(r"^\s*(?:\d+\.|-)\s*", "", line) for line in lines if line.strip())
        else:
            out.append(body)
    return out


def _json_action(content: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(content or "")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _done_calls(messages: Sequence[ChatMessage]) -> list[_Done]:
    """Tool calls made after the question, native or JSON, each with the result that came back."""
    done: list[_Done] = []
    results = {m.tool_call_id: m.content or "" for m in messages if m.role == "tool"}
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        for call in m.tool_calls:
            args = _json_action(call.arguments) or {}
            done.append(_Done(call.name, args, results.get(call.id)))
        action = _json_action(m.content) if not m.tool_calls else None
        if action and action.get("type") == "tool_call" and isinstance(action.get("tool_name"), str):
            nxt = messages[i + 1] if i + 1 < len(messages) else None
            result = None
            if nxt is not None and nxt.role == "user" and (nxt.content or "").startswith("Observation"):
                result = (nxt.content or "").split("\n", 1)[-1]
            tool_args = action.get("tool_args")
            done.append(_Done(action["tool_name"], tool_args if isinstance(tool_args, dict) else {}, result))
    return done


def _system_text(messages: Sequence[ChatMessage]) -> str:
    return "\n".join(m.content or "" for m in messages if m.role == "system")


def _is_json_protocol(system: str) -> bool:
    return "final_answer" in system and "tool_call" in system


def _json_prompt_tools(system: str) -> set[str] | None:
    if "No tools are available" in system:
        return set()
    names = set(re.findall(r"^###\s+([A-Za-z0-9_.\-]+)\s*$", system, re.MULTILINE))
    return names or None


def _first_line(text: str, width: int = 300) -> str:
    line = " ".join((text.strip().splitlines() or [""])[0].split())
    return line if len(line) <= width else line[: width - 1] + "…"


def estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4) if text else 0


def _usage(messages: Sequence[ChatMessage], output: str, extra: Any = None) -> TokenUsage:
    prompt_text = "".join((m.content or "") + "".join(c.arguments for c in m.tool_calls) for m in messages)
    prompt = estimate_tokens(prompt_text) + (estimate_tokens(json.dumps(extra)) if extra else 0)
    completion = estimate_tokens(output)
    return TokenUsage(prompt, completion, prompt + completion)


class DemoLLM:
    """The LLM protocol, offline and deterministic; see the module docstring."""

    def __init__(
        self,
        tools_hint: Iterable[str] | None = None,
        delay_s: float = 0.02,
        *,
        think_s: float = 0.0,
        abilities: Mapping[str, bool] | None = None,
    ) -> None:
        """``tools_hint``: the tool names to plan with when a call does not say which exist.

        ``delay_s`` paces the streamed words; ``think_s`` is how long each non-streaming call takes,
        so that a person watching (or a follow-up they send) sees the loop at work.
        """
        self._tools_hint = set(tools_hint) if tools_hint is not None else None
        self._delay_s = max(0.0, delay_s)
        self._think_s = max(0.0, think_s)
        self._abilities = dict(abilities or {"tool_call": True, "json_mode": True, "streaming": True})

    @property
    def abilities(self) -> Mapping[str, bool]:
        return self._abilities

    @property
    def model_name(self) -> str:
        return "demo"

    async def aclose(self) -> None:
        """Nothing to release; present so the service can close any LLM the same way."""

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        response_format: Mapping[str, Any] | None = None,
    ) -> ChatResult:
        if self._think_s > 0:
            await asyncio.sleep(self._think_s)
        system = _system_text(messages)
        forced = _forced_name(tool_choice)
        if forced is not None:
            schema = next(
                (dict(t["function"].get("parameters") or {}) for t in tools or () if _tool_name(t) == forced),
                {},
            )
            args = json.dumps(self._fill(schema, messages), ensure_ascii=False)
            call = ToolCall(id="demo_call_0", name=forced, arguments=args)
            return ChatResult(None, (call,), usage=_usage(messages, args, tools), finish_reason="tool_calls")
        if tools:
            return self._loop_reply(messages, json_mode=False, available={_tool_name(t) for t in tools})
        if _is_json_protocol(system):
            return self._loop_reply(messages, json_mode=True, available=_json_prompt_tools(system))
        if re.search(r"summari[sz]e|compact", system, re.IGNORECASE):
            return _text_result(messages, self._summary(messages))
        last = next((m.content or "" for m in reversed(messages) if m.role == "user"), "")
        schema_match = re.search(r"JSON schema:?\s*(\{.*\})", last, re.DOTALL)
        if schema_match or (response_format or {}).get("type") == "json_object":
            found = _json_action(_balanced(schema_match.group(1))) if schema_match else None
            value = self._fill(
                found or {"type": "object", "properties": {"answer": {"type": "string"}}}, messages
            )
            return _text_result(messages, json.dumps(value, ensure_ascii=False))
        if "## Tool calls and results" in last:
            return _text_result(messages, synthesize_answer(last))
        question = messages[_question_index(messages) or 0].content if messages else ""
        return _text_result(messages, self._final_text(question or "", []))

    async def stream_chat(self, messages: Sequence[ChatMessage]) -> AsyncIterator[StreamItem]:
        prompt = next((m.content or "" for m in reversed(messages) if m.role == "user"), "")
        answer = synthesize_answer(prompt)
        for i, word in enumerate(re.findall(r"\s*\S+|\s+", answer)):
            if i and self._delay_s > 0:
                await asyncio.sleep(self._delay_s)
            yield TextDelta(word)
        yield StreamEnd(_usage(messages, answer))

    # -- the tool loop --------------------------------------------------------------------

    def _loop_reply(
        self, messages: Sequence[ChatMessage], *, json_mode: bool, available: set[str] | None
    ) -> ChatResult:
        allowed = available if available is not None else self._tools_hint
        start = _question_index(messages)
        run = list(messages[start:] if start is not None else messages)
        question = (run[0].content or "") if start is not None else ""
        wanted = [c for text in (question, *_follow_ups(run)) for c in plan(text)]
        wanted = [c for c in wanted if allowed is None or c.tool in allowed]
        done = _done_calls(run)
        made = Counter(PlannedCall(d.tool, d.args, "").key() for d in done)
        remaining: list[PlannedCall] = []
        for call in wanted:
            if made[call.key()] > 0:
                made[call.key()] -= 1
            else:
                remaining.append(call)
        # However the conversation was rewritten (compaction, hooks), never call more than planned.
        if len(done) >= len(wanted) + 2:
            remaining = []
        if remaining:
            return self._ask_tools(messages, remaining, json_mode=json_mode)
        text = self._final_text(question, done)
        if json_mode:
            reasoning = "The tool results answer the question." if done else "No tool can help with this."
            action = {"type": "final_answer", "answer": text, "reasoning": reasoning}
            return _text_result(messages, json.dumps(action, ensure_ascii=False))
        return _text_result(messages, text)

    def _ask_tools(
        self, messages: Sequence[ChatMessage], calls: list[PlannedCall], *, json_mode: bool
    ) -> ChatResult:
        if json_mode:
            first = calls[0]
            action = {
                "type": "tool_call",
                "tool_name": first.tool,
                "tool_args": first.args,
                "reasoning": first.why,
            }
            return _text_result(messages, json.dumps(action, ensure_ascii=False))
        tool_calls = tuple(
            ToolCall(id=f"demo_{i}_{c.tool}", name=c.tool, arguments=json.dumps(c.args, ensure_ascii=False))
            for i, c in enumerate(calls, start=_count_calls(messages))
        )
        reasoning = " ".join(c.why for c in calls)
        output = reasoning + "".join(c.arguments for c in tool_calls)
        return ChatResult(reasoning, tool_calls, usage=_usage(messages, output), finish_reason="tool_calls")

    @staticmethod
    def _final_text(question: str, done: Sequence[_Done]) -> str:
        if not done:
            greeting = "Hello! " if re.match(r"\s*(hi|hello|hey)\b", question, re.IGNORECASE) else ""
            return greeting + CAPABILITIES
        lines = []
        for d in done:
            if d.result is None:
                lines.append(f"{d.tool}: no result")
            else:
                lines.append(_first_line(d.result))
        return "\n".join(lines)

    # -- structured output and summaries ----------------------------------------------------

    def _fill(self, schema: Mapping[str, Any], messages: Sequence[ChatMessage]) -> Any:
        kind = schema.get("type")
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return schema["enum"][0]
        if kind == "object" or "properties" in schema:
            props = schema.get("properties") or {}
            return {
                name: (self._select_tools(messages) if name == "tools" else self._fill(sub, messages))
                for name, sub in props.items()
                if isinstance(sub, Mapping)
            }
        if kind == "array":
            return []
        if kind in ("integer", "number"):
            return 0
        if kind == "boolean":
            return False
        if kind == "null":
            return None
        question_at = _question_index(messages)
        question = (messages[question_at].content or "") if question_at is not None else ""
        return self._final_text(question, [])

    def _select_tools(self, messages: Sequence[ChatMessage]) -> list[str]:
        system = _system_text(messages)
        catalog = re.findall(r"^([A-Za-z0-9_.\-]+): ", system.split("Catalog", 1)[-1], re.MULTILINE)
        limit_match = re.search(r"at most (\d+) tools", system)
        limit = int(limit_match.group(1)) if limit_match else 6
        question = next((m.content or "" for m in messages if m.role == "user"), "")
        picked = [c.tool for c in plan(question) if c.tool in catalog]
        picked += [name for name in catalog if name.lower() in question.lower() and name not in picked]
        return list(dict.fromkeys(picked))[:limit]

    @staticmethod
    def _summary(messages: Sequence[ChatMessage]) -> str:
        text = "\n".join(m.content or "" for m in messages if m.role == "user")
        goal = re.search(r"goal:\s*\n?(.+)", text)
        tools = sorted(set(re.findall(r"\[(?:tool result: |assistant called )([A-Za-z0-9_.\-]+)\]", text)))
        results = [_first_line(r, 160) for r in re.findall(r"\[tool result: [^\]]+\] (.+)", text)]
        parts = [f"Goal: {_first_line(goal.group(1), 200) if goal else 'see the question'}."]
        parts.append(f"Tools used so far: {', '.join(tools) if tools else 'none'}.")
        if results:
            parts.append("Latest results: " + "; ".join(results[-3:]) + ".")
        return " ".join(parts)


def _tool_name(tool: Mapping[str, Any]) -> str:
    function = tool.get("function")
    return str(function.get("name", "")) if isinstance(function, Mapping) else ""


def _forced_name(tool_choice: str | Mapping[str, Any] | None) -> str | None:
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return str(function["name"])
    return None


def _count_calls(messages: Sequence[ChatMessage]) -> int:
    return sum(len(m.tool_calls) for m in messages)


def _balanced(text: str) -> str:
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return text[: i + 1]
    return text


def _text_result(messages: Sequence[ChatMessage], text: str) -> ChatResult:
    return ChatResult(text, usage=_usage(messages, text), finish_reason="stop")


# -- synthesis ---------------------------------------------------------------------------------


def _section(prompt: str, title: str) -> str | None:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", prompt, re.MULTILINE | re.DOTALL)
    return match.group(1).strip() if match else None


def synthesize_answer(prompt: str) -> str:
    """The markdown answer for a synthesis prompt: the question, then each tool result, then the note."""
    question = _section(prompt, "Question") or ""
    trace = _section(prompt, "Tool calls and results") or ""
    draft = re.sub(r"\s*Write the reply to the user now\.?\s*$", "", _section(prompt, "Draft answer") or "")
    entries = re.split(r"^\d+\. ", trace, flags=re.MULTILINE)[1:]
    lines: list[str] = []
    for entry in entries:
        head, _, body = entry.partition("\n")
        name_match = re.match(r"`([^`]+)`\s*(.*)", head)
        name = name_match.group(1) if name_match else head.strip()
        args = _json_action(name_match.group(2)) if name_match else None
        lines.append(_describe_step(name, args or {}, body.strip()))
    if not lines:
        return f"{draft or CAPABILITIES}\n\n{DEMO_NOTE}\n"
    heading = f"### {_first_line(question, 120)}\n\n" if question else ""
    return f"{heading}" + "\n".join(lines) + f"\n\n{DEMO_NOTE}\n"


def _describe_step(name: str, args: Mapping[str, Any], body: str) -> str:
    if body.startswith("Error:"):
        return f"- `{name}` could not answer: {_first_line(body.removeprefix('Error:'), 200)}"
    result = body.removeprefix("Result:").strip()
    first = _first_line(result, 300)
    artifact = re.match(r"\[Artifact generated: ([^\]]+)\]", first)
    if artifact:
        return f"- I wrote **{artifact.group(1)}**: open the preview to read it."
    if name == "current_time":
        return f"- Time in **{args.get('timezone', 'UTC')}**: {re.sub(r', in [^,]+$', '', first)}"
    if name == "calculator" and " = " in first:
        expression, _, value = first.rpartition(" = ")
        return f"- `{expression}` = **{value}**"
    if name == "list_notes" and "\n" in result:
        return "- Your notes:\n" + "\n".join(f"  {line.strip()}" for line in result.splitlines()[1:6])
    return f"- {first}"
