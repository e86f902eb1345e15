"""The graph ``langgraph dev`` serves for the benchmark: the prebuilt ReAct agent with an ``add`` tool.

The fake LLM's URL comes from ``BENCH_LLM_URL`` (set by bench/peers/langgraph_server.py).
"""

from __future__ import annotations

import os
import warnings

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from langgraph.prebuilt import create_react_agent


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def make_graph():
    model = ChatOpenAI(
        model="fake-model",
        base_url=os.environ["BENCH_LLM_URL"],
        api_key="bench",
        max_retries=0,
        streaming=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_react_agent(model, [add])


graph = make_graph()
