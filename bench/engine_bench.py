"""The engine alone: ``ReActAgent`` on ``OpenAICompatibleLLM`` against the fake LLM, no service around it.

``job``: the benchmark job (K ``add`` calls, then the streamed answer), timed like the peers
(bench/measure.py), so its CPU time per run compares with theirs. ``scaling``: one run of 50 loop
iterations (50 tool calls, the max-iterations fallback, then synthesis), repeated; per iteration it
reports the wall time, the CPU time spent inside the LLM client and the engine's own CPU time
(everything else the process did in that iteration). ``intake``: CPU per streamed token of the LLM
client when each token is its own network read, on httpx's transport and on aiohttp's.

Run from the repository root: ``.venv/bin/python -m bench.engine_bench job --url URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from app.engine.agent import AgentConfig, ReActAgent
from app.engine.events import (
    AnswerDelta,
    AnswerSignalled,
    EngineEvent,
    IterationDone,
    RunDone,
    ThinkingStarted,
)
from app.llm.base import ChatMessage, ChatResult, TextDelta
from app.llm.openai_client import OpenAICompatibleLLM, default_http_client
from app.tools.registry import Tool, ToolRegistry
from bench.measure import ADD_SCHEMA, QUESTION, RunCheck, emit, measure

ABILITIES = {"tool_call": True, "json_mode": True, "streaming": True}


async def add(a: int, b: int) -> str:
    return str(a + b)


def add_registry() -> ToolRegistry:
    fn = ADD_SCHEMA["function"]
    assert isinstance(fn, dict)
    return ToolRegistry.of([Tool("add", str(fn["description"]), fn["parameters"], add)])


class TimedLLM:
    """Wraps the LLM to record the wall and CPU time spent inside each call."""

    def __init__(self, inner: OpenAICompatibleLLM) -> None:
        self.inner = inner
        self.calls: list[tuple[float, float, float]] = []
        """(started monotonic, wall s, cpu s) per non-streaming call."""

    @property
    def abilities(self) -> Mapping[str, bool]:
        return self.inner.abilities

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    async def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResult:
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            return await self.inner.chat(messages, **kwargs)
        finally:
            self.calls.append((w0, time.perf_counter() - w0, time.process_time() - c0))

    def stream_chat(self, messages: Sequence[ChatMessage]) -> Any:
        return self.inner.stream_chat(messages)


class IterationMarks:
    """A sink noting (wall, CPU) when each iteration starts and when the loop hands over to synthesis."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []
        self.done: list[RunDone] = []

    async def __call__(self, event: EngineEvent) -> None:
        if type(event) is ThinkingStarted or type(event) is AnswerSignalled:
            self.marks.append((time.perf_counter(), time.process_time()))
        elif type(event) is RunDone:
            self.done.append(event)


async def job(args: argparse.Namespace) -> None:
    llm = OpenAICompatibleLLM(args.url, "bench", "fake-model", ABILITIES)
    # The peers do no completion checklist (E-21): switch it off so that every subject does the same job.
    agent = ReActAgent(llm, add_registry(), AgentConfig(completion_check=False))

    async def run_once() -> RunCheck:
        parts: list[str] = []
        tools = 0

        async def sink(event: EngineEvent) -> None:
            nonlocal tools
            if type(event) is AnswerDelta:
                parts.append(event.content)
            elif type(event) is IterationDone:
                tools += 1

        await agent.run(QUESTION, sink=sink)
        return RunCheck(tool_calls=tools, answer="".join(parts), deltas=len(parts))

    emit(await measure("AgentStream engine", run_once, args))
    await llm.aclose()


async def scaling(args: argparse.Namespace) -> None:
    llm = TimedLLM(OpenAICompatibleLLM(args.url, "bench", "fake-model", ABILITIES))
    agent = ReActAgent(
        llm, add_registry(), AgentConfig(max_iterations=args.iterations, completion_check=False)
    )  # type: ignore[arg-type]
    per_iter_wall: list[list[float]] = [[] for _ in range(args.iterations)]
    per_iter_engine_cpu: list[list[float]] = [[] for _ in range(args.iterations)]
    per_iter_llm_cpu: list[list[float]] = [[] for _ in range(args.iterations)]
    deadline = time.monotonic() + args.max_seconds
    repeats = 0
    for rep in range(args.warmup + args.repeats):
        recorder = IterationMarks()
        llm.calls.clear()
        await agent.run(QUESTION, sink=recorder)
        marks, done = recorder.marks, recorder.done
        if done[0].iterations != args.iterations or len(marks) != args.iterations + 1:
            raise SystemExit(f"expected {args.iterations} iterations, got {done[0].iterations}")
        if rep < args.warmup:
            continue
        repeats += 1
        for i in range(args.iterations):
            (w0, c0), (w1, c1) = marks[i], marks[i + 1]
            _, _, llm_cpu = llm.calls[i]
            per_iter_wall[i].append(w1 - w0)
            per_iter_llm_cpu[i].append(llm_cpu)
            per_iter_engine_cpu[i].append((c1 - c0) - llm_cpu)
        if time.monotonic() > deadline:
            break
    med = statistics.median
    rows = [
        {
            "iteration": i + 1,
            "wall_ms": 1000 * med(per_iter_wall[i]),
            "llm_client_cpu_ms": 1000 * med(per_iter_llm_cpu[i]),
            "engine_cpu_ms": 1000 * med(per_iter_engine_cpu[i]),
        }
        for i in range(args.iterations)
    ]
    first, last = rows[0], rows[-1]
    emit(
        {
            "subject": "engine scaling",
            "iterations": args.iterations,
            "repeats": repeats,
            "rows": rows,
            "engine_cpu_ratio_last_first": last["engine_cpu_ms"] / first["engine_cpu_ms"],
            "wall_ratio_last_first": last["wall_ms"] / first["wall_ms"],
            "llm_client_cpu_ratio_last_first": last["llm_client_cpu_ms"] / first["llm_client_cpu_ms"],
        }
    )
    await llm.inner.aclose()


async def intake(args: argparse.Namespace) -> None:
    """CPU per streamed token of ``OpenAICompatibleLLM.stream_chat`` when every token is its own
    network read (the fake LLM started with ``--timed --delay-s``), on httpx's own transport (what
    the client used before) and on the default one (aiohttp), interleaved in one run."""
    subjects = {
        "httpx transport (httpcore, h11)": lambda: httpx.AsyncClient(timeout=httpx.Timeout(60)),
        "aiohttp transport (the default)": lambda: default_http_client(60, args.url),
    }
    cpu: dict[str, list[float]] = {name: [] for name in subjects}
    tokens: dict[str, int] = dict.fromkeys(subjects, 0)
    question = [ChatMessage(role="user", content=QUESTION)]
    for round_ in range(args.warmup_rounds + args.rounds):
        for name, make in subjects.items():
            http = make()
            llm = OpenAICompatibleLLM(args.url, "bench", "fake-model", ABILITIES, http_client=http)

            async def one(llm: OpenAICompatibleLLM = llm) -> int:
                return sum([isinstance(i, TextDelta) async for i in llm.stream_chat(question)])

            start = time.process_time()
            counted = sum(await asyncio.gather(*(one() for _ in range(args.streams))))
            spent = time.process_time() - start
            await http.aclose()
            if round_ >= args.warmup_rounds:
                cpu[name].append(spent)
                tokens[name] += counted
    emit(
        {
            "subject": "stream intake",
            "streams": args.streams,
            "rounds": args.rounds,
            "cpu_us_per_token": {name: 1e6 * sum(cpu[name]) / max(1, tokens[name]) for name in subjects},
            "tokens": tokens,
        }
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    j = sub.add_parser("job", help="the benchmark job, timed like the peers")
    j.add_argument("--url", required=True)
    j.add_argument("--runs", type=int, default=100)
    j.add_argument("--warmup", type=int, default=10)
    j.add_argument("--k", type=int, default=5)
    j.add_argument("--tokens", type=int, default=200)
    j.add_argument("--max-seconds", type=float, default=120.0)
    s = sub.add_parser("scaling", help="per-iteration cost over a 50-iteration run")
    s.add_argument("--url", required=True, help="a fake LLM started with --k equal to --iterations")
    s.add_argument("--iterations", type=int, default=50)
    s.add_argument("--repeats", type=int, default=20)
    s.add_argument("--warmup", type=int, default=3)
    s.add_argument("--max-seconds", type=float, default=120.0)
    i = sub.add_parser("intake", help="CPU per streamed token, httpx's transport against aiohttp's")
    i.add_argument("--url", required=True, help="a fake LLM started with --k 0 --timed --delay-s 0.002")
    i.add_argument("--streams", type=int, default=20)
    i.add_argument("--rounds", type=int, default=3)
    i.add_argument("--warmup-rounds", type=int, default=1)
    args = parser.parse_args(argv)
    commands = {"job": job, "scaling": scaling, "intake": intake}
    asyncio.run(commands[args.command](args))


if __name__ == "__main__":
    main(sys.argv[1:])
