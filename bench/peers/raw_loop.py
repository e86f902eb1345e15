"""The floor: a hand-written tool loop on the ``openai`` client.

``--style streamed`` (the default, what the peers do): each call streams; tool-call deltas are
accumulated and run, and the first reply without tool calls is the answer, whose tokens are the
stream. ``--style two-phase`` makes the same HTTP calls as AgentStream's engine: non-streaming calls
while the model asks for tools, then one streamed call for the answer. Nothing an agent framework
adds: no events, no hooks, no persistence.
Run: ``bench/.venv-peers/bin/python -m bench.peers.raw_loop --url URL [--style two-phase]``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from openai import AsyncOpenAI

from bench.measure import ADD_SCHEMA, QUESTION, RunCheck, arguments, emit, measure


async def add(a: int, b: int) -> int:
    return a + b


async def main() -> None:
    args = arguments(__doc__ or "", style=True)
    client = AsyncOpenAI(base_url=args.url, api_key="bench", max_retries=0)

    async def two_phase() -> RunCheck:
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        tool_calls = 0
        while True:
            reply = await client.chat.completions.create(
                model="fake-model",
                messages=messages,  # type: ignore[arg-type]
                tools=[ADD_SCHEMA],  # type: ignore[list-item]
            )
            message = reply.choices[0].message
            if not message.tool_calls:
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = await add(**json.loads(call.function.arguments))  # type: ignore[union-attr]
                tool_calls += 1
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
        messages.append({"role": "assistant", "content": message.content})
        stream = await client.chat.completions.create(
            model="fake-model",
            messages=messages,  # type: ignore[arg-type]
            stream=True,
        )
        parts = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
        return RunCheck(tool_calls=tool_calls, answer="".join(parts), deltas=len(parts))

    async def streamed() -> RunCheck:
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        tool_calls = 0
        while True:
            stream = await client.chat.completions.create(
                model="fake-model",
                messages=messages,
                tools=[ADD_SCHEMA],
                stream=True,  # type: ignore[list-item]
            )
            parts: list[str] = []
            calls: dict[int, dict[str, str]] = {}
            async for chunk in stream:
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                if delta.content:
                    parts.append(delta.content)
                for tc in delta.tool_calls or ():
                    call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    if tc.id:
                        call["id"] = tc.id
                    if tc.function and tc.function.name:
                        call["name"] += tc.function.name
                    if tc.function and tc.function.arguments:
                        call["arguments"] += tc.function.arguments
            if not calls:
                return RunCheck(tool_calls=tool_calls, answer="".join(parts), deltas=len(parts))
            messages.append(
                {
                    "role": "assistant",
                    "content": "".join(parts) or None,
                    "tool_calls": [
                        {
                            "id": c["id"],
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                        for c in calls.values()
                    ],
                }
            )
            for c in calls.values():
                result = await add(**json.loads(c["arguments"]))
                tool_calls += 1
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": str(result)})

    if args.style == "two-phase":
        emit(await measure("raw openai loop (two-phase)", two_phase, args))
    else:
        emit(await measure("raw openai loop", streamed, args))
    await client.close()


if __name__ == "__main__":
    asyncio.run(main())
