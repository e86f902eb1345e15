"""What the durable-run tests share: a model that works through a fixed plan of tool rounds and can
hold at a chosen point, the MCP tools' journal, and the checks every killed run must pass.

The plan (native tool calls; ``completion_check`` is off for these conversations):

1. ``files__lookup`` (an MCP tool that only reads: idempotent) beside ``calculator``, in parallel;
2. ``files__send`` (an MCP tool with a side effect: must never run twice, RUNS.md R-05);
3. ``calculator`` again;
then the final answer, and a streamed synthesis of ``TOKENS`` tokens. The round a loop call is in
is the number of assistant tool-call messages the request carries, so an attempt that carries a run
on from a checkpoint gets the replies the first attempt would have got.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tests.integration.service.workers_support import Api, SseEvent, Stream, answer_of, as_stored, thinking
from tests.support.fake_agents import _forced_function, answer_tokens
from tests.support.fake_openai import FakeReply
from tests.support.server import ROOT, wait_until

TOKENS = 40
PLAN: list[list[tuple[str, dict[str, Any]]]] = [
    [("files__lookup", {"key": "alpha"}), ("calculator", {"expression": "6*7"})],
    [("files__send", {"to": "bob"})],
    [("calculator", {"expression": "2+2"})],
]
KILL_POINTS = ["llm", "tool", "between", "synthesis", "after-loop"]
"""Where a test kills the worker that runs the run: during the loop's second model call (after the
first round's results); inside ``files__send``; during the model call after that tool's result;
mid-way through the streamed answer; and right after the loop's last checkpoint, before the first
answer token."""


def mcp_servers(journal: Path) -> str:
    """``MCP_SERVERS`` for a worker: the test MCP server over stdio, journaling to ``journal``."""
    return json.dumps(
        [
            {
                "name": "files",
                "transport": "stdio",
                "command": sys.executable,
                "args": ["-m", "tests.support.mcp_server"],
                "env": {"MCP_JOURNAL": str(journal)},
                "cwd": str(ROOT),
            }
        ]
    )


def rounds_of(body: Mapping[str, Any]) -> int:
    messages = [m for m in body.get("messages") or () if isinstance(m, Mapping)]
    return sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))


class PlanAgent:
    """The fake model of these tests; ``hold`` (a kill point) makes the first attempt wait there
    until ``release`` is set, after ``reached`` tells the test it is there."""

    def __init__(
        self,
        hold: str | None = None,
        *,
        plan: list[list[tuple[str, dict[str, Any]]]] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.tokens = answer_tokens(TOKENS)
        self.answer = "".join(self.tokens)
        self.hold = hold
        self.plan = PLAN if plan is None else plan
        self.delay_s = delay_s
        self.reached = threading.Event()
        self.release = threading.Event()
        self.gate = self.release  # what the cluster fixture opens when it closes
        self.loop_calls = 0
        self.stream_calls = 0
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> FakeReply:
        with self._lock:
            if body.get("stream"):
                self.stream_calls += 1
                first_stream = self.stream_calls == 1
            elif _forced_function(body) is None:
                self.loop_calls += 1
        if body.get("stream"):
            if first_stream and self.hold in ("synthesis", "after-loop"):
                self.reached.set()
                held_after = TOKENS // 4 if self.hold == "synthesis" else 0
                return FakeReply.stream(self.tokens, hold_after=held_after, hold=self.release)
            return FakeReply.stream(self.tokens, delay_s=self.delay_s)
        if _forced_function(body) == "select_tools":
            # More tools than the selection threshold: keep those of the plan (checkpointed, R-01).
            names = sorted({name for calls in self.plan for name, _ in calls})
            return FakeReply.tool_calls([("select_tools", {"tools": names})])
        done = rounds_of(body)
        plan = self.plan
        reply = FakeReply.tool_calls(plan[done]) if done < len(plan) else FakeReply.text("All rounds done.")
        held_round = {"llm": 1, "between": 2}.get(self.hold or "")
        if held_round == done and not self.reached.is_set():
            self.reached.set()
            return FakeReply.blocked(self.release, reply, timeout_s=60)
        return reply


def journal_entries(journal: Path, run_id: str) -> list[dict[str, Any]]:
    """The MCP server's journal lines for ``run_id`` (by the idempotency key's prefix)."""
    if not journal.exists():
        return []
    entries = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
    return [e for e in entries if str(e.get("key") or "").startswith(f"{run_id}:")]


def is_resumed(event: SseEvent) -> bool:
    return event.event == "phase" and event.data.get("phase") == "resumed"


def check_carried_on(
    api: Api, run_id: str, received: list[SseEvent], agent: PlanAgent, journal: Path, point: str
) -> dict[str, Any]:
    """What every run killed at ``point`` and carried on must show (RUNS.md R-03 to R-05, R-10)."""
    done = received[-1]
    assert done.event == "done", done
    assert done.data["status"] == "completed", done.data
    resumes = [e for e in received if is_resumed(e)]
    assert [e.data["attempt"] for e in resumes] == [2], resumes
    after = resumes[0].data["after"]
    ids = [e.id for e in received]
    assert after in ids or after == "0-0", (after, ids[:3])  # an event the client has, or none
    # the answer is what streamed after the last resume, whole.
    tail = as_stored(received[received.index(resumes[-1]) + 1 :])
    assert answer_of(tail) == done.data["answer"] == agent.answer
    # every event of every attempt, once, in order, as the database keeps them.
    stored = api.wait_stored(run_id)
    assert as_stored(received) == stored
    run = api.run(run_id)
    assert (run["status"], run["attempt"], run["answer"]) == ("completed", 2, agent.answer)
    # the tool with a side effect started exactly once; every call carried its key.
    entries = journal_entries(journal, run_id)
    sends = [e for e in entries if e["tool"] == "send" and e["at"] == "start"]
    assert len(sends) == 1, entries
    lookups = {e["key"] for e in entries if e["tool"] == "lookup" and e["at"] == "start"}
    assert len(lookups) == 1, entries  # run again at most under the same key
    if point == "tool":
        # Cut off inside send: not run again; the model is told it was interrupted.
        redone = received[received.index(resumes[0]) :]
        interrupted = [e for e in redone if e.event == "step" and e.data.get("tool_name") == "files__send"]
        interrupted = [e for e in interrupted if e.data.get("status") == "done"]
        assert len(interrupted) == 1 and "interrupted" in interrupted[0].data["observation"], interrupted
    usage = done.data["usage"]
    assert usage["llm_calls"] >= len(PLAN) + 2, usage  # every loop call and the synthesis, at least
    return run


def send_hold(journal: Path) -> Path:
    """The file that holds ``files__send`` while it exists (``tests.support.mcp_server``)."""
    return journal.with_name(journal.name + ".hold.send")


def read_until_reached(
    stream: Stream, agent: PlanAgent, journal: Path, run_id: str, point: str
) -> list[SseEvent]:
    """The run's events, read from ``stream`` until the run is where the test kills it."""
    received: list[SseEvent] = stream.read(until=thinking)

    def stream_seen(until: Callable[[SseEvent], bool]) -> None:
        received.extend(stream.read(until=until))

    wait_reached(agent, journal, run_id, point, stream_seen)
    return received


def wait_reached(agent: PlanAgent, journal: Path, run_id: str, point: str, stream_seen: Any) -> None:
    """Block until the run is where the test kills it."""
    if point == "tool":
        wait_until(
            lambda: any(e["tool"] == "send" and e["at"] == "start" for e in journal_entries(journal, run_id)),
            timeout=30,
            what="files__send to start",
        )
        return
    assert agent.reached.wait(30), f"the run never reached {point}"
    if point == "synthesis":
        stream_seen(lambda e: e.event == "answer" and e.data.get("status") == "delta")
