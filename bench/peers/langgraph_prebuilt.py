"""LangGraph's prebuilt ReAct agent (``create_react_agent``) on ``langchain-openai``, streamed.

The answer's tokens are read from ``astream(stream_mode="messages")``, which is how a LangGraph
application streams tokens to its user. Run:
``bench/.venv-peers/bin/python -m bench.peers.langgraph_prebuilt --url URL``.
"""

from __future__ import annotations

import asyncio
import os
import warnings

from bench.measure import QUESTION, RunCheck, arguments, emit, measure

os.environ.pop("LANGCHAIN_TRACING_V2", None)
os.environ.pop("LANGSMITH_TRACING", None)


async def main() -> None:
    args = arguments(__doc__ or "")
    from langchain_core.messages import AIMessageChunk, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

    @tool
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    model = ChatOpenAI(model="fake-model", base_url=args.url, api_key="bench", max_retries=0, streaming=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = create_react_agent(model, [add])

    async def run_once() -> RunCheck:
        parts: list[str] = []
        tool_calls = 0
        async for message, meta in agent.astream({"messages": [("user", QUESTION)]}, stream_mode="messages"):
            if isinstance(message, ToolMessage):
                tool_calls += 1
            elif isinstance(message, AIMessageChunk) and meta.get("langgraph_node") == "agent":
                if isinstance(message.content, str) and message.content:
                    parts.append(message.content)
        return RunCheck(tool_calls=tool_calls, answer="".join(parts), deltas=len(parts))

    emit(await measure("LangGraph prebuilt ReAct", run_once, args))


if __name__ == "__main__":
    asyncio.run(main())
