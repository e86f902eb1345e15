"""Every text the tool loop and the synthesis step show the model.

Kept in one module so that wording changes are reviewed in one place and tests can compare against
the same constants the engine uses. Nothing here calls a model or emits events.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from app.engine.interrupts import INTERRUPT_MARKER
from app.tools.registry import ToolRegistry

PARSE_FAILURE_REASONING = "(could not parse LLM output as JSON)"

_LOOP_ROLE = (
    "You are a capable assistant that solves the user's task step by step, using tools when they help. "
    "Think about what information you still need, get it with the most direct tool call, and stop as soon "
    "as you can answer. A separate step turns your final answer into the reply the user reads, so keep "
    "the final answer short and factual."
)

_INTERRUPT_NOTE = (
    f"Messages that start with {INTERRUPT_MARKER} are follow-ups the user sent while you were working: "
    "take them into account before you finish."
)

_JSON_FORMAT = """## How to reply
Reply with exactly ONE JSON object and nothing else, in one of these two forms:
{"type": "tool_call", "tool_name": "<tool name>", "tool_args": {<arguments>}, "reasoning": "<why this step>"}
{"type": "final_answer", "answer": "<your answer>", "reasoning": "<why you can answer now>"}
Rules:
- One tool call per reply. Use only the tools listed above, with arguments matching their parameters.
- Tool results come back as user messages that start with "Observation".
- When you have enough information, reply with final_answer."""

_NATIVE_FORMAT = """## How to work
- Call the provided tools when you need information or need to act; you may call several at once
  when they do not depend on each other.
- When you have enough information, reply with your answer as plain text and no tool call."""


def _with_extra(extra: str | None, body: str) -> str:
    if extra and extra.strip():
        return f"{extra.strip()}\n\n{body}"
    return body


def json_system_prompt(registry: ToolRegistry, extra: str | None = None) -> str:
    """JSON mode (E-05): the tool descriptions live in the prompt, with their parameter schemas."""
    if len(registry):
        blocks = []
        for tool in registry:
            schema = json.dumps(dict(tool.parameters), ensure_ascii=False, sort_keys=True)
            blocks.append(f"### {tool.name}\n{tool.description.strip()}\nParameters (JSON Schema): {schema}")
        tools = "## Tools\n" + "\n\n".join(blocks)
    else:
        tools = "## Tools\nNo tools are available: answer directly with final_answer."
    return _with_extra(extra, f"{_LOOP_ROLE}\n\n{tools}\n\n{_JSON_FORMAT}\n\n{_INTERRUPT_NOTE}")


def native_system_prompt(extra: str | None = None) -> str:
    """Native mode (E-06): the tools travel in the ``tools`` parameter, not in the prompt."""
    return _with_extra(extra, f"{_LOOP_ROLE}\n\n{_NATIVE_FORMAT}\n\n{_INTERRUPT_NOTE}")


REFORMAT_INSTRUCTION = (
    "Your previous reply could not be parsed as a JSON object. Reply again with exactly one JSON object "
    'and no text around it: either {"type": "tool_call", "tool_name": ..., "tool_args": {...}, '
    '"reasoning": ...} or {"type": "final_answer", "answer": ..., "reasoning": ...}.'
)


def json_observation(tool_name: str, observation: str, *, failed: bool) -> str:
    """JSON mode feeds tool results back as user messages (E-05)."""
    label = f"Observation from `{tool_name}`" + (" (error)" if failed else "")
    return f"{label}:\n{observation}"


def artifact_observation(filename: str, note: str = "") -> str:
    """What the LLM sees instead of an artifact's body (E-26), so it does not echo a whole file."""
    text = (
        f"[Artifact generated: {filename}] The content is rendered as a preview in the UI, so the user "
        "already sees it: do not repeat the file's content in your answer, refer to it by its file name."
    )
    return f"{text}\n{note}" if note else text


def cycle_warning(tool_name: str, count: int) -> str:
    """E-20: the exact wording of the source."""
    return (
        f"You have called `{tool_name}` with identical arguments {count} times and received the same "
        "result. Please try a different approach or tool."
    )


def self_reflection(tool_calls: int, question: str) -> str:
    """E-19: a pause every N real tool calls to fight goal drift."""
    goal = question if len(question) <= 300 else question[:299] + "…"
    return (
        f"[Self-reflection] You have made {tool_calls} tool calls so far. Before the next step, check:\n"
        f'1. Are you still working toward the original goal: "{goal}"?\n'
        "2. Have you been repeating similar actions or going in circles?\n"
        "3. What is the most direct next step to complete the task?\n"
        "4. Do you already have enough information to give the final answer? If so, answer now."
    )


def completion_checklist(*, json_mode: bool) -> str:
    """E-21: one verification pass before the answer is accepted."""
    how = "as a final_answer JSON object" if json_mode else "as plain text without a tool call"
    return (
        "Before you finish, verify your answer:\n"
        "1. Does it fully answer the original question, including every part of it?\n"
        "2. Are the key facts verified by tool results rather than assumed?\n"
        "3. Are there contradictions in the information you gathered?\n"
        f"If everything checks out, give your final answer again {how}. If something is missing, "
        "continue with the tools."
    )


def max_iterations_answer(limit: int, calls: Sequence[tuple[str, str | None]]) -> str:
    """E-15: what the loop answers when it ran out of iterations; ``calls`` are (tool, error) pairs."""
    if not calls:
        return f"I could not finish within {limit} steps and no tool produced a result."
    lines = [
        f"- `{name}`: " + ("succeeded" if error is None else f"failed ({_one_line(error)})")
        for name, error in calls
    ]
    ok = sum(1 for _, error in calls if error is None)
    return (
        f"I could not finish within {limit} steps. I made {len(calls)} tool calls "
        f"({ok} succeeded, {len(calls) - ok} failed):\n" + "\n".join(lines)
    )


def _one_line(text: str, width: int = 120) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


SYNTHESIS_SYSTEM = """You write the final reply to the user. The work is already done: you receive the \
user's question, the tool calls that were made with their results, and a draft answer.

- Present the results directly, as if you had found them yourself. Do not describe the process: never \
write phrases like "based on the tool output", "according to the observations" or "the agent found".
- Use markdown where it helps: short paragraphs, lists, tables, code blocks.
- Rely on the tool results for facts; if a tool failed and something could not be determined, say so \
plainly.
- Do not paste generated files (artifacts): the user already sees them in a preview; refer to them by \
file name.
- Answer in the language of the user's question."""


def synthesis_system_prompt(extra: str | None = None) -> str:
    """E-03. Operator instructions (the agent's ``system_prompt``) shape the reply the user reads too."""
    if extra and extra.strip():
        return f"{SYNTHESIS_SYSTEM}\n\nAdditional instructions from the operator:\n{extra.strip()}"
    return SYNTHESIS_SYSTEM


def interrupted_call(tool_name: str) -> str:
    """R-05: the observation of a call that was running when its worker stopped, for a tool that
    must not run twice."""
    return (
        f"The call of `{tool_name}` was interrupted: the worker running it stopped before it returned, "
        "so it may or may not have taken effect. Do not assume either: check its effect if you can "
        "before you call it again."
    )


def denied_call(tool_name: str, reason: str | None, *, expired: bool = False) -> str:
    """A-03/A-04: the observation of a call that a person refused, or that nobody decided in time."""
    if expired:
        head = (
            f"The call of `{tool_name}` was not executed: it needed a person's approval and nobody "
            "decided in time."
        )
    else:
        head = f"The call of `{tool_name}` was not executed: the user denied it."
    why = f" Reason: {reason.strip()}" if reason and reason.strip() else ""
    return f"{head}{why} Do not repeat this call as it was; change your approach or answer without it."


def approval_unavailable(tool_name: str) -> str:
    """A call that needs a person's approval in a run that cannot ask anyone (the /v1 face)."""
    return (
        f"The call of `{tool_name}` was not executed: it needs a person's approval, and this run cannot "
        "ask for one. Answer without it, or say what you would do and that it needs approval."
    )


def edited_call(tool_name: str, args: Mapping[str, Any], observation: str) -> str:
    """A-03: the observation of a call that ran with arguments a person edited."""
    shown = json.dumps(args, ensure_ascii=False, sort_keys=True)
    note = f"(The user approved the call of `{tool_name}` with edited arguments; it ran with {shown}.)"
    return f"{note}\n{observation}"


def client_call_unavailable(tool_name: str) -> str:
    """C-01: a tool the client runs, called where no client can answer (the run cannot wait)."""
    return (
        f"The call of `{tool_name}` was not executed: it is a tool the user's application runs, and "
        "no application can answer here. Answer without it."
    )


def client_call_expired(tool_name: str) -> str:
    """C-03: a tool the client runs, whose result did not come within CLIENT_TOOL_TIMEOUT_S."""
    return (
        f"The call of `{tool_name}` got no result: the user's application, which runs it, did not "
        "answer in time. Do not wait for it; change your approach or answer without it."
    )
