"""Native function calling (E-06): tools go in the ``tools`` parameter, replies carry ``tool_calls``.

All calls of one reply run in parallel and their ``tool`` messages follow the assistant message
directly, in call order; so interrupts are drained only after them (E-23). A reply without tool calls
is the final answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.engine import prompts
from app.engine.calls import CallOutcome, ParsedReply
from app.engine.state import PlannedCall
from app.engine.tool_results import decode_args
from app.llm.base import LLM, ChatMessage, ChatResult
from app.tools.registry import ToolRegistry


class NativeStrategy:
    drains_before_tools = False
    json_mode = False

    def __init__(self, registry: ToolRegistry) -> None:
        # Built once: re-serialising the schemas every iteration would be wasted work.
        self._schemas: list[dict[str, Any]] | None = registry.openai_schemas() or None

    def system_prompt(self, extra: str | None) -> str:
        return prompts.native_system_prompt(extra)

    async def ask(self, llm: LLM, messages: Sequence[ChatMessage]) -> ChatResult:
        return await llm.chat(messages, tools=self._schemas)

    def parse(self, reply: ChatResult) -> ParsedReply:
        if not reply.tool_calls:
            content = reply.content or ""
            assistant = ChatMessage(role="assistant", content=content, reasoning=reply.kept_reasoning)
            return ParsedReply("final", reply.reasoning_content or "", assistant, answer=content)
        calls = []
        for tc in reply.tool_calls:
            args, error = decode_args(tc.name, tc.arguments)
            calls.append(PlannedCall(tc.id, tc.name, args, error))
        assistant = ChatMessage(
            role="assistant",
            content=reply.content,
            tool_calls=reply.tool_calls,
            reasoning=reply.kept_reasoning,  # for a provider that wants it back
        )
        reasoning = reply.content or reply.reasoning_content or ""
        return ParsedReply("tools", reasoning, assistant, calls=tuple(calls))

    def observation_messages(self, outcomes: Sequence[CallOutcome]) -> list[ChatMessage]:
        return [
            ChatMessage(
                role="tool", content=o.observation, tool_call_id=o.call.call_id, name=o.call.tool_name
            )
            for o in outcomes
        ]
