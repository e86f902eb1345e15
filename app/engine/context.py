"""The context guard: keeps a run's message list within a token budget before each LLM call (E-16).

Tokens are estimated cheaply (no tokenizer). Over budget, the guard keeps the system prompt, pinned
messages and the most recent messages, and replaces the older middle with one summary written by
the run's LLM (or, if that call fails, a plain marker of what was dropped). An assistant message
with ``tool_calls`` and its ``tool`` results are kept or dropped together, so the result is always a
valid OpenAI conversation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from app.engine.events import Compacted, Usage
from app.llm.base import LLM, ChatMessage

logger = logging.getLogger(__name__)

MESSAGE_OVERHEAD_TOKENS = 4
TOOL_CALL_OVERHEAD_TOKENS = 4
SUMMARY_PREFIX = "[CONTEXT SUMMARY]"
MARKER_PREFIX = "[CONTEXT COMPACTED]"
TRANSCRIPT_MESSAGE_MAX_CHARS = 2000
GOAL_MAX_CHARS = 2000

SUMMARY_SYSTEM_PROMPT = (
    "You compact the working memory of an AI agent so that it can continue its task within a limited "
    "context window. Summarise the excerpt of its conversation that you are given. The summary must "
    "preserve:\n"
    "1. the user's goal, in the user's own terms;\n"
    "2. the recent reasoning chain: what the agent tried, in which order and why, with the latest "
    "steps in the most detail, so that it can pick up exactly where it left off;\n"
    "3. key facts, figures, names and decisions established so far;\n"
    "4. tool results that are still needed to finish the task (quote exact values, ids and errors);\n"
    "5. what remains to be done.\n"
    "Do not invent anything and do not address the user. Write plain text, at most about {max_tokens} "
    "tokens."
)


def text_tokens(text: str | None) -> int:
    """A cheap token estimate for a text (no tokenizer)."""
    if not text:
        return 0
    ascii_chars = len(text.encode("ascii", "ignore"))
    # About four ASCII characters a token; CJK and other scripts are closer to one a character.
    return (ascii_chars + 3) // 4 + (len(text) - ascii_chars)


def estimate_tokens(message: ChatMessage) -> int:
    """A cheap token estimate for one message: text length plus per-message and per-tool-call overhead."""
    tokens = MESSAGE_OVERHEAD_TOKENS + text_tokens(message.content)
    for call in message.tool_calls:
        tokens += TOOL_CALL_OVERHEAD_TOKENS + text_tokens(call.id) + text_tokens(call.name)
        tokens += text_tokens(call.arguments)
    tokens += text_tokens(message.tool_call_id) + text_tokens(message.name)
    # Kept only for a provider that wants it back, so it is sent with every request.
    return tokens + text_tokens(message.reasoning)


@dataclass(frozen=True, slots=True)
class _Unit:
    """Messages that must stay together: an assistant ``tool_calls`` message and its tool results."""

    start: int
    end: int
    pinned: bool


@dataclass(frozen=True, slots=True)
class _Plan:
    head: int
    units: list[_Unit]
    tail_first: int
    summary_tokens: int

    def dropped(self) -> list[_Unit]:
        return [u for u in self.units[: self.tail_first] if not u.pinned]


def _units(messages: Sequence[ChatMessage], start: int) -> list[_Unit]:
    units: list[_Unit] = []
    i = start
    while i < len(messages):
        end = i + 1
        if messages[i].role == "assistant" and messages[i].tool_calls:
            while end < len(messages) and messages[end].role == "tool":
                end += 1
        pinned = any(m.pinned for m in messages[i:end])
        units.append(_Unit(i, end, pinned))
        i = end
    return units


class ContextGuard:
    """One per run: call ``check_and_compact`` before every LLM call.

    The under-budget check is O(1) amortised: estimates are cached per message object, and a running
    total is kept for the list seen last time, so a list that only grew by appending costs just the
    new messages. (A message replaced in place in the middle of the list is not noticed until the
    first or last-seen message changes; the loop only appends.)
    """

    def __init__(self, llm: LLM, budget_tokens: int, *, keep_recent: int = 8) -> None:
        if budget_tokens <= 0:
            raise ValueError("budget_tokens must be positive")
        if keep_recent < 0:
            raise ValueError("keep_recent must not be negative")
        self._llm = llm
        self._budget = budget_tokens
        self._keep_recent = keep_recent
        # Keyed by id(); the entry holds the message itself, so the id cannot be reused while cached.
        self._estimates: dict[int, tuple[ChatMessage, int]] = {}
        self._seen_len = 0
        self._seen_first: ChatMessage | None = None
        self._seen_last: ChatMessage | None = None
        self._seen_total = 0

    @property
    def budget_tokens(self) -> int:
        return self._budget

    def total_tokens(self, messages: Sequence[ChatMessage]) -> int:
        """The estimated size of ``messages``, reusing what was counted on the previous call."""
        n = len(messages)
        seen = self._seen_len
        if 0 < seen <= n and messages[0] is self._seen_first and messages[seen - 1] is self._seen_last:
            total = self._seen_total
            for i in range(seen, n):
                total += self._estimate(messages[i])
        else:
            total = sum(self._estimate(m) for m in messages)
            if len(self._estimates) > 2 * n + 64:
                self._estimates = {id(m): self._estimates[id(m)] for m in messages}
        self._seen_len = n
        self._seen_first = messages[0] if n else None
        self._seen_last = messages[-1] if n else None
        self._seen_total = total
        return total

    async def check_and_compact(
        self, messages: list[ChatMessage], usage: Usage
    ) -> tuple[list[ChatMessage], Compacted | None]:
        """``messages`` unchanged and ``None`` when within budget, else the compacted list and its event."""
        if self.total_tokens(messages) <= self._budget:
            return messages, None
        plan = self._plan(messages)
        dropped = plan.dropped() if plan is not None else []
        if plan is None or not dropped:
            logger.warning(
                "context_over_budget nothing_to_drop messages=%d budget=%d", len(messages), self._budget
            )
            return messages, None

        dropped_messages = [m for u in dropped for m in messages[u.start : u.end]]
        note = await self._summary_message(messages, dropped_messages, plan.summary_tokens, usage)
        compacted: list[ChatMessage] = list(messages[: plan.head])
        placed = False
        for index, unit in enumerate(plan.units):
            if index < plan.tail_first and not unit.pinned:
                if not placed:
                    compacted.append(note)
                    placed = True
                continue
            compacted.extend(messages[unit.start : unit.end])

        self._estimates = {id(m): self._estimates[id(m)] for m in compacted if id(m) in self._estimates}
        self._seen_len = 0
        total = self.total_tokens(compacted)
        logger.info(
            "context_compacted original=%d kept=%d dropped=%d tokens=%d budget=%d",
            len(messages),
            len(compacted),
            len(dropped_messages),
            total,
            self._budget,
        )
        return compacted, Compacted(original_messages=len(messages), kept_messages=len(compacted))

    def _estimate(self, message: ChatMessage) -> int:
        entry = self._estimates.get(id(message))
        if entry is not None and entry[0] is message:
            return entry[1]
        tokens = estimate_tokens(message)
        self._estimates[id(message)] = (message, tokens)
        return tokens

    def _plan(self, messages: Sequence[ChatMessage]) -> _Plan | None:
        head = 1 if messages and messages[0].role == "system" else 0
        units = _units(messages, head)
        if not units:
            return None
        boundary = max(head, len(messages) - self._keep_recent)
        tail_first = next((k for k, u in enumerate(units) if u.end > boundary), len(units) - 1)
        summary_tokens = min(1024, max(64, self._budget // 8))

        cost = [sum(self._estimate(m) for m in messages[u.start : u.end]) for u in units]
        kept = sum(self._estimate(m) for m in messages[:head]) + summary_tokens
        kept += sum(c for c, u in zip(cost[:tail_first], units, strict=False) if u.pinned)
        kept += sum(cost[tail_first:])
        # Still too big: give up recent units too, down to the last one (the last message stays).
        while kept > self._budget and tail_first < len(units) - 1:
            if not units[tail_first].pinned:
                kept -= cost[tail_first]
            tail_first += 1
        return _Plan(head=head, units=units, tail_first=tail_first, summary_tokens=summary_tokens)

    async def _summary_message(
        self,
        messages: Sequence[ChatMessage],
        dropped: Sequence[ChatMessage],
        max_tokens: int,
        usage: Usage,
    ) -> ChatMessage:
        prompt = [
            ChatMessage(role="system", content=SUMMARY_SYSTEM_PROMPT.format(max_tokens=max_tokens)),
            ChatMessage(role="user", content=self._summary_request(messages, dropped)),
        ]
        try:
            reply = await self._llm.chat(prompt)
        except Exception as exc:  # any failure falls back to the marker; CancelledError passes through
            usage.add(Usage(llm_calls=int(getattr(exc, "attempts", 1))))
            logger.warning("context_summary_failed error=%s: %s", type(exc).__name__, exc)
            return ChatMessage(role="user", content=_marker(dropped))
        usage.add(
            Usage(
                prompt_tokens=reply.usage.prompt_tokens,
                completion_tokens=reply.usage.completion_tokens,
                total_tokens=reply.usage.total_tokens,
                llm_calls=reply.attempts,
            )
        )
        summary = (reply.content or "").strip()
        if not summary:
            logger.warning("context_summary_empty")
            return ChatMessage(role="user", content=_marker(dropped))
        summary = _clip_tokens(summary, max_tokens)
        return ChatMessage(
            role="user",
            content=f"{SUMMARY_PREFIX} Summary of {len(dropped)} earlier messages:\n{summary}",
        )

    def _summary_request(self, messages: Sequence[ChatMessage], dropped: Sequence[ChatMessage]) -> str:
        goal = next((m.content for m in messages if m.role == "user" and m.content), None) or "(not stated)"
        entries = _transcript(dropped)
        # The summary call must fit the budget itself; the most recent entries matter most.
        room = max(4000, self._budget * 2)
        kept: list[str] = []
        used = 0
        for entry in reversed(entries):
            if used + len(entry) > room and kept:
                break
            kept.append(entry)
            used += len(entry) + 1
        kept.reverse()
        omitted = len(entries) - len(kept)
        lines = "\n".join(kept)
        if omitted:
            lines = f"({omitted} older messages omitted)\n{lines}"
        return (
            f"The user's goal:\n{_clip(goal, GOAL_MAX_CHARS)}\n\n"
            f"Conversation excerpt to summarise ({len(dropped)} messages, oldest first):\n{lines}"
        )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " …[truncated]"


def _clip_tokens(text: str, max_tokens: int) -> str:
    clipped = _clip(text, max_tokens * 4)
    if text_tokens(clipped) > max_tokens:
        clipped = _clip(text, max_tokens)
    return clipped


def _transcript(dropped: Sequence[ChatMessage]) -> list[str]:
    tool_names = {c.id: c.name for m in dropped for c in m.tool_calls}
    entries: list[str] = []
    for m in dropped:
        if m.role == "tool":
            name = tool_names.get(m.tool_call_id or "") or m.name or "tool"
            entries.append(f"[tool result: {name}] {_clip(m.content or '', TRANSCRIPT_MESSAGE_MAX_CHARS)}")
            continue
        parts = [f"[{m.role}] {_clip(m.content, TRANSCRIPT_MESSAGE_MAX_CHARS)}"] if m.content else []
        parts += [f"[{m.role} called {c.name}] {_clip(c.arguments, 500)}" for c in m.tool_calls]
        entries.append("\n".join(parts) if parts else f"[{m.role}] (empty)")
    return entries


def _marker(dropped: Sequence[ChatMessage]) -> str:
    names: list[str] = []
    for m in dropped:
        for call in m.tool_calls:
            if call.name not in names:
                names.append(call.name)
        if m.role == "tool" and m.name and m.name not in names:
            names.append(m.name)
    involved = ", ".join(names) if names else "none"
    return (
        f"{MARKER_PREFIX} {len(dropped)} earlier messages were removed to stay within the context "
        f"budget and could not be summarised. Tools involved: {involved}."
    )
