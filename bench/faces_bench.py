"""The protocol faces against the own SSE stream (issue 26; FACES.md V, G): the worker's CPU per run
and the bytes on the wire per answer token of each face, the same runs, one report; target: at most
1.5x the own stream's.

Subjects, each doing the benchmark job (``bench/fakellm.py``: 5 sequential ``calculator`` calls,
then a 200-token streamed answer) with the same agent settings (``service_stack.AGENT``); the
client side is ``bench/faces_client.py``:

* ``own``: ``POST /api/conversations``, ``POST .../runs``, ``GET .../stream`` read to ``done``;
* ``ai-sdk``: ``POST /api/ai-sdk/chat`` (``trigger: submit-message``), its UI message stream read
  to ``data: [DONE]``;
* ``ag-ui``: ``POST /api/ag-ui`` (a ``RunAgentInput``, protocol 1.0), its events read to
  ``RUN_FINISHED``. A service without the route (404) makes the subject "not available".

Every run is checked through the face's own stream: 5 tool results (``step`` iteration ``done``
events; ``tool-output-available`` chunks; ``TOOL_CALL_RESULT`` events) and exactly the fake's
answer (``answer`` deltas; ``text-delta`` chunks; ``TEXT_MESSAGE_CONTENT`` deltas), ended as the
protocol ends a completed run (``done`` completed; ``finish`` stop then ``[DONE]``;
``RUN_FINISHED`` whose ``result.answer`` is that answer).

One uvicorn worker (``service_stack.Stack``; SQLite, or ``--db postgres``; ``--app-path`` to import
another tree's ``app``), one client reading every response the same way off its socket.

* First runs (the issue's figure): rounds interleave the subjects (own, ai-sdk, ag-ui, own, ...), a
  block of ``--runs`` runs of new conversations/chats/threads each, so the shared machine's load
  weighs on all alike. A block's CPU is the worker's (all threads, /proc, as ``service_bench``
  reads it) from a pause before its first run to a pause after its last (``--settle-s``: a run's
  trailing database work lands in its own block), less the worker's idle CPU over the pause.
* A thread's later runs (``--thread-runs N``, ``--threads T``): one thread per subject, its runs
  1..N interleaved run by run across the subjects, each run's CPU read alone (with the pauses); the
  faces' clients send back the history they hold (the AI SDK client its messages, read with ``GET
  .../messages`` outside the run's window; the AG-UI client the last ``MESSAGES_SNAPSHOT``,
  ``faces_client.remember``). The
  fake LLM calls no tool once the history holds 5 results, so runs 2..N are answer only. Reported:
  the last quarter of the runs (at least 3), averaged over the threads.

Bytes: the stream response as received (``wire``: status line and headers, chunked framing, body;
``body``: the SSE text alone); the requests apart (own: the two JSON calls both ways and the stream's
GET; faces: the POST's head and body). ``delta frame``: an answer-delta frame's bytes besides its
text, what each token would cost if the model's tokens came one per frame (the fake sends the answer
in one read, so each run has one delta). Ratios are face / own: of the totals, and for first runs
also the median (min-max) of the per-round CPU ratios.

Writes the JSON to ``--out`` (default ``$BENCH_OUT`` or bench/out, ``faces.json``) and a table on
stdout; progress on stderr. Loopback only, bounded in runs and time (``--max-seconds``; each run
``--timeout-s``). ``--profile FILE`` runs the worker under py-spy (``--subjects own ag-ui`` to
profile fewer). Run from the repository root::

    .venv/bin/python -m bench.faces_bench [--quick] [--db postgres] [--rounds N] [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.durable_common import tree_state
from bench.faces_client import RUNNERS, NotAvailableError, Run, Thread, check, remember
from bench.measure import expected_answer, percentile
from bench.service_stack import AGENT, HOST, ROOT, Stack, cpu_seconds, machine_cpu, machine_share
from bench.wire import Connection

SUBJECTS = ("own", "ai-sdk", "ag-ui")
FACES = ("ai-sdk", "ag-ui")
TARGET = 1.5


@dataclass
class Tally:
    """One subject's measured first runs."""

    runs: int = 0
    walls: list[float] = field(default_factory=list)
    blocks: list[tuple[int, float, int]] = field(default_factory=list)
    """Per block: (round, CPU seconds less the idle share, runs)."""
    wire: int = 0
    body: int = 0
    head: int = 0
    requests: int = 0
    frames: int = 0
    deltas: list[int] = field(default_factory=list)

    def add(self, run: Run, wall: float) -> None:
        self.runs += 1
        self.walls.append(wall)
        self.wire += run.stream.wire_bytes
        self.body += run.stream.body_bytes
        self.head += run.stream.head_bytes
        self.requests += run.request_bytes
        self.frames += len(run.stream.frames)
        self.deltas += run.delta_overhead

    def cpu_ms(self) -> float:
        return 1000 * sum(c for _, c, _ in self.blocks) / max(1, sum(n for _, _, n in self.blocks))

    def block_ms(self) -> dict[int, float]:
        return {r: 1000 * c / n for r, c, n in self.blocks}

    def summary(self, tokens: int) -> dict[str, Any]:
        n = max(1, self.runs)
        return {
            "available": True,
            "runs": self.runs,
            "cpu_ms_per_run": self.cpu_ms(),
            "cpu_ms_per_run_by_round": [round(v, 2) for v in self.block_ms().values()],
            "wall_ms_p50": 1000 * statistics.median(self.walls),
            "wall_ms_mean": 1000 * statistics.fmean(self.walls),
            "wall_ms_p99": 1000 * percentile(self.walls, 0.99),
            "stream_wire_bytes_per_run": self.wire / n,
            "stream_body_bytes_per_run": self.body / n,
            "stream_head_bytes_per_run": self.head / n,
            "stream_wire_bytes_per_token": self.wire / n / tokens,
            "stream_body_bytes_per_token": self.body / n / tokens,
            "request_bytes_per_run": self.requests / n,
            "all_bytes_per_token": (self.wire + self.requests) / n / tokens,
            "frames_per_run": self.frames / n,
            "answer_deltas_per_run": len(self.deltas) / n,
            "delta_frame_overhead_bytes": statistics.fmean(self.deltas) if self.deltas else None,
        }


def tree(app_path: str) -> dict[str, Any]:
    """The commit of the tree whose ``app`` the worker imports, and whether its app/ differs from it."""
    if not app_path:
        return tree_state()

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", app_path, *args], check=True, capture_output=True, text=True
        ).stdout.strip()

    changed = git("status", "--porcelain", "--", "app")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "app_uncommitted": bool(changed),
        "app_path": app_path,
    }


def log(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(subjects: dict[str, Any], tallies: dict[str, Tally]) -> dict[str, Any]:
    own = subjects.get("own") or {}
    if not own.get("available"):
        return {}
    out: dict[str, Any] = {}
    for face in FACES:
        s = subjects.get(face) or {}
        if not s.get("available"):
            continue
        own_rounds, face_rounds = tallies["own"].block_ms(), tallies[face].block_ms()
        paired = [face_rounds[r] / own_rounds[r] for r in face_rounds if own_rounds.get(r)]
        r: dict[str, Any] = {
            "cpu": s["cpu_ms_per_run"] / own["cpu_ms_per_run"],
            "cpu_by_round_median": statistics.median(paired) if paired else None,
            "cpu_by_round_min": min(paired, default=None),
            "cpu_by_round_max": max(paired, default=None),
        }
        for key, of in (
            ("stream_wire_bytes", "stream_wire_bytes_per_token"),
            ("stream_body_bytes", "stream_body_bytes_per_token"),
            ("all_bytes", "all_bytes_per_token"),
            ("wall_p50", "wall_ms_p50"),
            ("delta_frame_overhead", "delta_frame_overhead_bytes"),
        ):
            r[key] = _ratio(s[of], own[of])
        r["within_target"] = r["cpu"] <= TARGET and r["stream_wire_bytes"] <= TARGET
        out[face] = r
    return out


async def thread_runs(
    args: argparse.Namespace, port: int, pid: int, live: list[str], idle_per_s: float, deadline: float
) -> dict[str, Any]:
    """Runs 1..N of ``--threads`` threads per subject, interleaved run by run (see the docstring)."""
    expected = expected_answer(args.tokens)
    conn = Connection(HOST, port)
    rows: dict[str, list[list[dict[str, float]]]] = {s: [] for s in live}
    for t in range(args.threads):
        threads = {s: Thread() for s in live}
        for s in live:
            rows[s].append([])
        for i in range(args.thread_runs):
            if time.monotonic() > deadline:
                log(f"time is up in thread {t + 1}, run {i + 1} (--max-seconds {args.max_seconds:g})")
                break
            for s in live:
                await asyncio.sleep(args.settle_s)
                cpu0, t0 = cpu_seconds(pid), time.perf_counter()
                run = await asyncio.wait_for(RUNNERS[s](port, conn, threads[s]), args.timeout_s)
                wall = time.perf_counter() - t0
                await asyncio.sleep(args.settle_s)
                cpu = cpu_seconds(pid) - cpu0 - idle_per_s * args.settle_s
                check(s, run, args.k if i == 0 else 0, expected)
                rows[s][-1].append(
                    {
                        "cpu_ms": 1000 * max(0.0, cpu),
                        "wall_ms": 1000 * wall,
                        "stream_wire_bytes": run.stream.wire_bytes,
                        "request_bytes": run.request_bytes,
                    }
                )
                await remember(port, conn, s, threads[s])
        log(f"thread {t + 1}/{args.threads}: {len(rows[live[0]][-1])} runs a subject")
    await conn.close()
    n = min((len(r) for s in live for r in rows[s]), default=0)
    if n == 0:
        return {}
    last = max(1, min(n - 1, max(3, n // 4))) if n > 1 else 1
    window = (n - last + 1, n)

    def mean(s: str, key: str, lo: int, hi: int) -> float:
        return statistics.fmean(r[i][key] for r in rows[s] for i in range(lo - 1, hi))

    subjects: dict[str, Any] = {}
    for s in live:
        by_run = {
            key: [round(mean(s, key, i, i), 1) for i in range(1, n + 1)]
            for key in ("cpu_ms", "stream_wire_bytes", "request_bytes")
        }
        subjects[s] = {
            "first": {key: mean(s, key, 1, 1) for key in ("cpu_ms", "stream_wire_bytes", "request_bytes")},
            "last": {
                key: mean(s, key, *window)
                for key in ("cpu_ms", "wall_ms", "stream_wire_bytes", "request_bytes")
            },
            "by_run": by_run,
        }
    out_ratios: dict[str, Any] = {}
    if "own" in subjects:
        own = subjects["own"]["last"]
        for face in (f for f in FACES if f in subjects):
            f = subjects[face]["last"]
            r: dict[str, Any] = {
                "cpu": f["cpu_ms"] / own["cpu_ms"] if own["cpu_ms"] else None,
                "stream_wire_bytes": f["stream_wire_bytes"] / own["stream_wire_bytes"],
                "all_bytes": (f["stream_wire_bytes"] + f["request_bytes"])
                / (own["stream_wire_bytes"] + own["request_bytes"]),
            }
            r["within_target"] = (r["cpu"] or 0) <= TARGET and r["stream_wire_bytes"] <= TARGET
            out_ratios[face] = r
    return {
        "runs_per_thread": n,
        "threads": len(rows[live[0]]),
        "window": list(window),
        "subjects": subjects,
        "ratios": out_ratios,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    fake = ["--k", str(args.k), "--tokens", str(args.tokens), "--tool", "calculator"]
    expected = expected_answer(args.tokens)
    profile = (args.py_spy, args.profile) if args.profile and args.have_py_spy else None
    tree0 = tree(args.app_path)
    subjects: dict[str, Any] = {}
    tallies = {s: Tally() for s in args.subjects}
    deadline = time.monotonic() + args.max_seconds
    async with Stack(fake, db=args.db, profile=profile, app_path=args.app_path or None) as stack:
        port, pid = stack.workers[0][1], stack.pids[0]
        conn = Connection(HOST, port)
        live: list[str] = []
        for subject in args.subjects:
            try:
                for _ in range(args.warmup):
                    run = await asyncio.wait_for(RUNNERS[subject](port, conn, Thread()), args.timeout_s)
                    check(subject, run, args.k, expected)
                live.append(subject)
            except NotAvailableError as exc:
                subjects[subject] = {"available": False, "reason": str(exc)}
                log(f"{subject}: not available: {exc}")
        # The worker's own CPU while nothing runs (its periodic work), taken off each block's pauses.
        await asyncio.sleep(args.settle_s)
        idle0, t_idle = cpu_seconds(pid), time.perf_counter()
        await asyncio.sleep(args.idle_s)
        idle_per_s = (cpu_seconds(pid) - idle0) / (time.perf_counter() - t_idle)
        machine0, t0 = machine_cpu(), time.perf_counter()
        rounds = 0
        for rnd in range(args.rounds):
            if time.monotonic() > deadline:
                log(f"time is up after {rounds} rounds (--max-seconds {args.max_seconds:g})")
                break
            line = []
            for subject in live:
                tally = tallies[subject]
                await asyncio.sleep(args.settle_s)
                cpu0, t_block = cpu_seconds(pid), time.perf_counter()
                for _ in range(args.runs):
                    w0 = time.perf_counter()
                    run = await asyncio.wait_for(RUNNERS[subject](port, conn, Thread()), args.timeout_s)
                    wall = time.perf_counter() - w0
                    check(subject, run, args.k, expected)
                    tally.add(run, wall)
                await asyncio.sleep(args.settle_s)
                cpu = cpu_seconds(pid) - cpu0
                pauses = time.perf_counter() - t_block - sum(tally.walls[-args.runs :])
                tally.blocks.append((rnd, max(0.0, cpu - idle_per_s * pauses), args.runs))
                line.append(f"{subject} {tally.block_ms()[rnd]:.1f} ms")
            rounds += 1
            log(f"round {rnd + 1}/{args.rounds}: CPU per run " + ", ".join(line))
        await conn.close()
        thread = {}
        if args.thread_runs and args.threads and live:
            thread = await thread_runs(args, port, pid, live, idle_per_s, deadline)
        share = machine_share(machine0, machine_cpu())
        seconds = time.perf_counter() - t0
        database, app_file = stack.database, stack.app_file
    tree1 = tree(args.app_path)
    for subject in live:
        subjects[subject] = tallies[subject].summary(args.tokens)
    return {
        "bench": "faces",
        "target": f"each face's worker CPU per run and stream bytes per answer token <= {TARGET}x "
        "the own stream's",
        "quick": args.quick,
        "database": database,
        "app_file": app_file,
        "tree": {**tree1, "changed_during_run": tree1 != tree0},
        "job": {"k": args.k, "tokens": args.tokens, "tool": "calculator", "agent": AGENT},
        "rounds": rounds,
        "runs_per_block": args.runs,
        "warmup_per_subject": args.warmup,
        "order": live,
        "settle_s": args.settle_s,
        "worker_idle_cpu_ms_per_s": 1000 * idle_per_s,
        "seconds": seconds,
        **share,
        "load_average": list(os.getloadavg()),
        "subjects": {s: subjects[s] for s in args.subjects},
        "ratios": ratios(subjects, tallies),
        "thread": thread,
    }


def table(result: dict[str, Any]) -> str:
    head = (
        f"{'subject':<8} {'runs':>5} {'CPU ms/run':>11} {'wall p50':>9} {'stream B/tok wire':>18} "
        f"{'body':>6} {'requests B/run':>15} {'all B/tok':>10} {'delta frame B':>14} {'CPU x':>6} "
        f"{'bytes x':>8}"
    )
    lines = ["First runs (new conversation, chat, thread):", head, "-" * len(head)]
    for name, s in result["subjects"].items():
        if not s.get("available"):
            lines.append(f"{name:<8} not available: {s.get('reason')}")
            continue
        r = result["ratios"].get(name)
        cpu_x = f"{r['cpu']:.2f}" if r else "1"
        bytes_x = f"{r['stream_wire_bytes']:.2f}" if r else "1"
        lines.append(
            f"{name:<8} {s['runs']:>5} {s['cpu_ms_per_run']:>11.1f} {s['wall_ms_p50']:>7.1f}ms "
            f"{s['stream_wire_bytes_per_token']:>18.1f} {s['stream_body_bytes_per_token']:>6.1f} "
            f"{s['request_bytes_per_run']:>15.0f} {s['all_bytes_per_token']:>10.1f} "
            f"{s['delta_frame_overhead_bytes'] or float('nan'):>14.0f} {cpu_x:>6} {bytes_x:>8}"
        )
    for name, r in result["ratios"].items():
        verdict = "met" if r["within_target"] else "NOT met"
        lines.append(
            f"{name}: CPU {r['cpu']:.2f}x (rounds: median {r['cpu_by_round_median']:.2f}, "
            f"{r['cpu_by_round_min']:.2f}-{r['cpu_by_round_max']:.2f}), "
            f"stream bytes {r['stream_wire_bytes']:.2f}x "
            f"(body {r['stream_body_bytes']:.2f}x, all {r['all_bytes']:.2f}x): <= {TARGET}x {verdict}"
        )
    th = result.get("thread") or {}
    if th:
        lo, hi = th["window"]
        lines.append(
            f"\nA thread's runs {lo}-{hi} (of {th['runs_per_thread']}, {th['threads']} thread(s) a subject; "
            "answer only):"
        )
        for name, s in th["subjects"].items():
            last, first = s["last"], s["first"]
            r = th["ratios"].get(name)
            ratio = (
                f"; CPU {r['cpu']:.2f}x, stream bytes {r['stream_wire_bytes']:.2f}x, all bytes "
                f"{r['all_bytes']:.2f}x: {'met' if r['within_target'] else 'NOT met'}"
                if r
                else ""
            )
            lines.append(
                f"{name:<8} CPU {last['cpu_ms']:.1f} ms/run (run 1: {first['cpu_ms']:.1f}), stream "
                f"{last['stream_wire_bytes']:.0f} B/run (run 1: {first['stream_wire_bytes']:.0f}), requests "
                f"{last['request_bytes']:.0f} B/run{ratio}"
            )
    lines.append(
        f"{result['rounds']} rounds x {result['runs_per_block']} runs a subject, {result['seconds']:.0f} s; "
        f"{result['database']}; machine busy {result['machine_busy_pct']:.0f}%, stolen "
        f"{result['machine_steal_pct']:.0f}%; tree {result['tree']['commit']}"
        + (" (app/ uncommitted changes)" if result["tree"]["app_uncommitted"] else "")
        + (" (changed during the run)" if result["tree"]["changed_during_run"] else "")
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds, runs and thread runs (~40 s)")
    parser.add_argument("--rounds", type=int, default=None, help="default 16 (--quick: 4)")
    parser.add_argument("--runs", type=int, default=None, help="runs a block; default 10 (--quick: 5)")
    parser.add_argument("--warmup", type=int, default=None, help="runs a subject first; default 5 (quick 2)")
    parser.add_argument("--thread-runs", type=int, default=None, help="default 16 (--quick: 6); 0: none")
    parser.add_argument("--threads", type=int, default=None, help="threads a subject; default 2 (quick 1)")
    parser.add_argument("--subjects", nargs="+", choices=SUBJECTS, default=list(SUBJECTS))
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--app-path", default="", help="the worker imports this tree's app package")
    parser.add_argument("--settle-s", type=float, default=0.2, help="pause before and after a measurement")
    parser.add_argument("--idle-s", type=float, default=2.0, help="how long the worker's idle CPU is read")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="bound on one run")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="nothing new starts after this")
    parser.add_argument("--out", default=None, help="the JSON (default: $BENCH_OUT or bench/out, faces.json)")
    parser.add_argument("--profile", default="", help="run the worker under py-spy record, samples here")
    parser.add_argument("--py-spy", default=str(ROOT / "bench/.venv-peers/bin/py-spy"))
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (4 if args.quick else 16)
    args.runs = args.runs or (5 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    args.thread_runs = args.thread_runs if args.thread_runs is not None else (6 if args.quick else 16)
    args.threads = args.threads if args.threads is not None else (1 if args.quick else 2)
    args.have_py_spy = os.path.exists(args.py_spy)
    if args.profile and not args.have_py_spy:
        log(f"no py-spy at {args.py_spy} (bench/peers/setup.sh installs it): no profile")
    result = asyncio.run(bench(args))
    out = (
        Path(args.out)
        if args.out
        else Path(os.environ.get("BENCH_OUT", ROOT / "bench" / "out")) / "faces.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"JSON in {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
