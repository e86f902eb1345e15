"""The OpenAI Agents SDK: one ``Agent`` with a function tool, run with ``Runner.run_streamed``.

It talks Chat Completions to the fake server (``OpenAIChatCompletionsModel``), tracing off (there is
no network). Run: ``bench/.venv-peers/bin/python -m bench.peers.agents_sdk --url URL``.
"""

from __future__ import annotations

import asyncio
import os

from bench.measure import QUESTION, RunCheck, arguments, emit, measure

os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"


async def main() -> None:
    args = arguments(__doc__ or "")
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI
    from openai.types.responses import ResponseTextDeltaEvent

    set_tracing_disabled(True)

    @function_tool
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    client = AsyncOpenAI(base_url=args.url, api_key="bench", max_retries=0)
    agent = Agent(
        name="adder",
        instructions="Use the add tool.",
        model=OpenAIChatCompletionsModel(model="fake-model", openai_client=client),
        tools=[add],
    )

    async def run_once() -> RunCheck:
        parts: list[str] = []
        tool_calls = 0
        result = Runner.run_streamed(agent, QUESTION, max_turns=args.k + 2)
        async for event in result.stream_events():
            if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent):
                parts.append(event.data.delta)
            elif event.type == "run_item_stream_event" and event.name == "tool_output":
                tool_calls += 1
        return RunCheck(tool_calls=tool_calls, answer="".join(parts), deltas=len(parts))

    emit(await measure("OpenAI Agents SDK", run_once, args))
    await client.close()


if __name__ == "__main__":
    asyncio.run(main())
