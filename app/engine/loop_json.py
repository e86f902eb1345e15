"""JSON mode (E-05, E-08, E-09): tools described in the system prompt, one JSON action a reply.

The model answers ``{"type": "tool_call", ...}`` or ``{"type": "final_answer", ...}``; tool results go
back as user messages. Interrupts are drained right after the assistant message (E-23).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from app.engine import prompts
from app.engine.calls import CallOutcome, ParsedReply
from app.engine.state import PlannedCall
from app.engine.structured import extract_json
from app.engine.tool_results import decode_args
from app.llm.base import LLM, ChatMessage, ChatResult
from app.tools.registry import ToolRegistry


class JsonStrategy:
    drains_before_tools = True
    json_mode = True

    def __init__(self, registry: ToolRegistry) -> None:
        self._registry = registry

    def system_prompt(self, extra: str | None) -> str:
        return prompts.json_system_prompt(self._registry, extra)

    async def ask(self, llm: LLM, messages: Sequence[ChatMessage]) -> ChatResult:
        return await llm.chat(messages)

    def parse(self, reply: ChatResult) -> ParsedReply:
        content = reply.content or ""
        assistant = ChatMessage(role="assistant", content=content, reasoning=reply.kept_reasoning)
        action = extract_json(content) if content.strip() else None
        parsed = self._read_action(action, reply, assistant) if action is not None else None
        if parsed is None:
            # E-08: the sentinel; the loop asks for a reformat once, then takes the raw text.
            return ParsedReply("unparsed", prompts.PARSE_FAILURE_REASONING, assistant, answer=content)
        return parsed

    def _read_action(
        self, action: dict[str, Any], reply: ChatResult, assistant: ChatMessage
    ) -> ParsedReply | None:
        kind = action.get("type")
        reasoning = action.get("reasoning")
        if not isinstance(reasoning, str) or not reasoning.strip():
            # E-09: reasoning models put their thinking beside the content.
            reasoning = reply.reasoning_content or ""
        if kind == "tool_call" or (kind is None and "tool_name" in action):
            name = action.get("tool_name")
            if not isinstance(name, str) or not name.strip():
                return None
            args, error = decode_args(name, action.get("tool_args"))
            # The loop names the call (its id is unique within the run).
            call = PlannedCall("", name, args, error)
            return ParsedReply("tools", reasoning, assistant, calls=(call,))
        if kind == "final_answer" or (kind is None and "answer" in action):
            answer = action.get("answer")
            if answer is None:
                answer = ""
            elif not isinstance(answer, str):
                answer = json.dumps(answer, ensure_ascii=False)
            return ParsedReply("final", reasoning, assistant, answer=answer)
        return None

    def observation_messages(self, outcomes: Sequence[CallOutcome]) -> list[ChatMessage]:
        return [
            ChatMessage(
                role="user",
                content=prompts.json_observation(o.call.tool_name, o.observation, failed=o.error is not None),
            )
            for o in outcomes
        ]
