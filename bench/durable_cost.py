"""Durable runs, ``checkpoints``: what checkpointing costs a run.

The same scripts against the baseline commit (the last one before durable runs, ``eaaa192``,
checked out in a temporary git worktree) and against this tree, interleaved round by round, in one
invocation:

* ``service_bench.py http`` (this tree's script for both: only its workers import the baseline's
  ``app``, through ``--app-path``): the worker's CPU per run of the benchmark job over HTTP, on
  SQLite and on PostgreSQL;
* ``durable_dbwork.py`` (run with either tree's ``app``): the database work of one run's life with
  what the run writes (its events through the real publisher and group commit and, for the new
  code, its checkpoints and follow-up reads): CPU, transactions, statements and rows per run;
* in-process, new code only: ``engine_bench scaling``'s 50-iteration run with a checkpointer that
  does the service's per-checkpoint work (``orjson.dumps`` as ``RunCheckpointer.record``, kept in a
  list), against the same run without one: engine CPU of iteration 50 against iteration 1.

The child processes run in sessions of their own and are stopped by process group when the script
ends, also on errors; the worktree is removed. Run from the repository root (the command line is
``bench/durable_bench.py``'s)::

    .venv/bin/python -m bench.durable_bench checkpoints [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.durable_common import PY, ROOT, git, log, tree_state
from bench.measure import QUESTION
from bench.scratch_pg import ScratchDatabase
from bench.service_stack import HOST

BASELINE = "eaaa192"

TARGET_COST = (
    "Checkpoint cost: a run's worker CPU and database work with checkpoints against the same run "
    "before this change (the previous commit's figures, same scripts, same machine, one report): "
    "at most 1.1x; iteration 50 still at most 2x iteration 1, checkpoint included."
)


# ---- child processes -----------------------------------------------------------------------------


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 20.0) -> None:
    """Stop ``proc``, started in a session of its own, and whatever it started (its process group).

    SIGINT to ``proc`` first: the bench scripts then stop their own children and clean up (Redis
    keys, temporary directories); then SIGTERM to the group, then SIGKILL."""
    for sig, group, wait_s in ((signal.SIGINT, False, grace_s), (signal.SIGTERM, True, 5.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
    # Anything of its group still there (a worker whose parent died first) goes now.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def run_json(
    cmd: Sequence[str], *, env: dict[str, str] | None, cwd: str | Path, timeout_s: float
) -> dict[str, Any]:
    """Run ``cmd`` (its stderr passed through) and return the JSON object on its last stdout line."""
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except BaseException:
        stop_group(proc)
        raise
    stop_group(proc, grace_s=0)  # nothing of it may outlive it
    lines = [line for line in out.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd[:4])}... exited {proc.returncode}: {out[-2000:]}")
    return dict(json.loads(lines[-1]))


@contextlib.contextmanager
def fake_llm(args: Sequence[str]) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    proc = subprocess.Popen(
        [PY, "-m", "bench.fakellm", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        if not url.startswith(f"http://{HOST}:"):
            raise RuntimeError(f"fake LLM did not start: {url!r}")
        yield url, proc
    finally:
        stop_group(proc, grace_s=10)


@contextlib.contextmanager
def baseline_worktree(commit: str) -> Iterator[str]:
    """A detached git worktree of ``commit`` in a temporary directory, removed at the end."""
    tmp = tempfile.mkdtemp(prefix="agentstream-baseline-")
    path = os.path.join(tmp, "tree")
    try:
        git("worktree", "add", "--detach", path, commit)
        yield path
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            git("worktree", "remove", "--force", path)
        shutil.rmtree(tmp, ignore_errors=True)


def tree_env(tree: str) -> dict[str, str]:
    """The environment that makes ``import app`` find ``tree``'s package (ahead of the venv's
    editable install, whose finder comes after the path entries)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))
    return env


def app_file(tree: str) -> str:
    return subprocess.run(
        [PY, "-c", "import app; print(app.__file__)"],
        cwd=tree,
        env=tree_env(tree),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def http_once(tree: str, db: str, args: argparse.Namespace) -> dict[str, Any]:
    """This tree's ``service_bench http``, its worker importing ``tree``'s app."""
    cmd = [
        PY,
        "-m",
        "bench.service_bench",
        "http",
        "--runs",
        str(args.http_runs),
        "--warmup",
        str(args.http_warmup),
        "--db",
        db,
        "--app-path",
        tree,
        "--max-seconds",
        "120",
    ]
    result = run_json(cmd, env=dict(os.environ), cwd=ROOT, timeout_s=300)
    if not result["app_file"].startswith(tree + os.sep):
        raise RuntimeError(f"the worker imported {result['app_file']}, not {tree}'s app")
    return result


def dbwork_once(
    tree: str, db: str, llm_url: str, args: argparse.Namespace, without: Sequence[str] = ()
) -> dict[str, Any]:
    """``durable_dbwork.py`` with ``tree``'s app, on a database of its own."""
    cmd = [
        PY,
        str(ROOT / "bench" / "durable_dbwork.py"),
        "--llm-url",
        llm_url,
        "--runs",
        str(args.db_runs),
        "--warmup",
        str(args.db_warmup),
    ]
    if without:
        cmd += ["--without", *without]
    scratch: ScratchDatabase | None = None
    if db == "postgres":
        scratch = ScratchDatabase()
        asyncio.run(scratch.create())
        cmd += ["--db-url", scratch.url]
    try:
        result = run_json(cmd, env=tree_env(tree), cwd=tree, timeout_s=300)
    finally:
        if scratch is not None:
            asyncio.run(scratch.drop())
    if not result["app_file"].startswith(tree + os.sep):
        raise RuntimeError(f"durable_dbwork imported {result['app_file']}, not {tree}'s app")
    return result


@dataclasses.dataclass
class SerializingCheckpointer:
    """The service's per-checkpoint work without the database: ``RunCheckpointer.record``'s
    ``orjson.dumps`` and its ``CheckpointRecord``, kept in a list."""

    run_id: str = "bench-run"
    records: list[Any] = dataclasses.field(default_factory=list)

    def record(self, delta: dict[str, Any]) -> None:
        from app.streaming.store import CheckpointRecord

        data = orjson.dumps(delta, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
        self.records.append(CheckpointRecord(self.run_id, 1, len(self.records), data))

    async def durable(self) -> None:
        return None


@dataclasses.dataclass
class TimedCheckpointer(SerializingCheckpointer):
    """The same, noting the CPU time of ``record`` and of the engine's ``Journal.delta`` (patched
    for the run by ``timing_deltas``): where a checkpoint's cost goes. Its runs are not the
    headline figures (the timing costs a little)."""

    record_cpu_s: float = 0.0
    delta_cpu_s: float = 0.0

    def record(self, delta: dict[str, Any]) -> None:
        c0 = time.process_time()
        super().record(delta)
        self.record_cpu_s += time.process_time() - c0


@contextlib.contextmanager
def timing_deltas(checkpointer: TimedCheckpointer) -> Iterator[None]:
    """``Journal.delta`` timed into ``checkpointer.delta_cpu_s`` while the block runs (bench only)."""
    from app.engine import state

    original = state.Journal.delta

    def delta(self: Any, usage: Any, **extra: Any) -> dict[str, Any]:
        c0 = time.process_time()
        try:
            return original(self, usage, **extra)
        finally:
            checkpointer.delta_cpu_s += time.process_time() - c0

    state.Journal.delta = delta  # type: ignore[method-assign]
    try:
        yield
    finally:
        state.Journal.delta = original  # type: ignore[method-assign]


async def scaling(url: str, iterations: int, repeats: int, warmup: int, max_seconds: float) -> dict[str, Any]:
    """``engine_bench scaling`` without a checkpointer, with one, and with a timed one, alternating
    run by run (the order turning round each repeat)."""
    from app.engine.agent import AgentConfig, ReActAgent
    from app.llm.openai_client import OpenAICompatibleLLM
    from app.tools.registry import Tool, ToolRegistry
    from bench.engine_bench import ABILITIES, IterationMarks, TimedLLM, add
    from bench.measure import ADD_SCHEMA

    fn = ADD_SCHEMA["function"]
    assert isinstance(fn, dict)
    # Idempotent, as the service's calculator: no durable wait before the call (none is timed here).
    registry = ToolRegistry.of([Tool("add", str(fn["description"]), fn["parameters"], add, idempotent=True)])
    llm = TimedLLM(OpenAICompatibleLLM(url, "bench", "fake-model", ABILITIES))
    agent = ReActAgent(llm, registry, AgentConfig(max_iterations=iterations, completion_check=False))  # type: ignore[arg-type]
    variants = ("without", "with", "timed")
    engine: dict[str, list[list[float]]] = {v: [[] for _ in range(iterations)] for v in variants}
    client: dict[str, list[list[float]]] = {v: [[] for _ in range(iterations)] for v in variants}
    parts: dict[str, list[list[float]]] = {p: [[] for _ in range(iterations)] for p in ("delta", "record")}
    checkpoints: list[int] = []
    checkpoint_bytes: list[int] = []
    deadline = time.monotonic() + max_seconds
    done = 0
    try:
        for rep in range(warmup + repeats):
            for variant in variants if rep % 2 == 0 else variants[::-1]:
                marks = IterationMarks()
                llm.calls.clear()
                kwargs: dict[str, Any] = {}
                noted: list[tuple[float, float]] = []
                timing: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
                sink: Any = marks
                if variant == "with":
                    kwargs["checkpointer"] = SerializingCheckpointer()
                elif variant == "timed":
                    timed = TimedCheckpointer()
                    kwargs["checkpointer"] = timed
                    timing = timing_deltas(timed)

                    async def sink(
                        event: Any,
                        marks: IterationMarks = marks,
                        cp: TimedCheckpointer = timed,
                        noted: list[tuple[float, float]] = noted,
                    ) -> None:
                        before = len(marks.marks)
                        await marks(event)
                        if len(marks.marks) != before:  # at each iteration's start, and at the loop's end
                            noted.append((cp.delta_cpu_s, cp.record_cpu_s))

                with timing:
                    await agent.run(QUESTION, sink=sink, **kwargs)
                if marks.done[0].iterations != iterations or len(marks.marks) != iterations + 1:
                    raise RuntimeError(f"expected {iterations} iterations, got {marks.done[0].iterations}")
                if rep < warmup:
                    continue
                for i in range(iterations):
                    (_, c0), (_, c1) = marks.marks[i], marks.marks[i + 1]
                    llm_cpu = llm.calls[i][2]
                    engine[variant][i].append(c1 - c0 - llm_cpu)
                    client[variant][i].append(llm_cpu)
                    if variant == "timed":
                        parts["delta"][i].append(noted[i + 1][0] - noted[i][0])
                        parts["record"][i].append(noted[i + 1][1] - noted[i][1])
                if variant == "with":
                    records = kwargs["checkpointer"].records
                    checkpoints.append(len(records))
                    checkpoint_bytes.append(sum(len(r.data) for r in records))
            done += 1
            if rep >= warmup and time.monotonic() > deadline:
                break
    finally:
        await llm.inner.aclose()
    med = statistics.median

    def row(i: int) -> dict[str, float]:
        return {
            "iteration": i + 1,
            "engine_cpu_ms": 1000 * med(engine["with"][i]),
            "engine_cpu_ms_without_checkpointer": 1000 * med(engine["without"][i]),
            "engine_cpu_ms_timed_checkpointer": 1000 * med(engine["timed"][i]),
            "delta_cpu_ms": 1000 * med(parts["delta"][i]),
            "serialise_cpu_ms": 1000 * med(parts["record"][i]),
            "llm_client_cpu_ms": 1000 * med(client["with"][i]),
        }

    rows = [row(i) for i in range(iterations)]

    def window(key: str, first: int, last: int) -> float:
        return med(r[key] for r in rows[first - 1 : last])

    k = min(5, iterations // 2)
    out: dict[str, Any] = {
        "iterations": iterations,
        "repeats": max(0, done - warmup),
        "checkpoints_per_run": med(checkpoints) if checkpoints else None,
        "checkpoint_bytes_per_run": med(checkpoint_bytes) if checkpoint_bytes else None,
        "rows": rows,
        "checkpointer": "orjson.dumps(delta) as RunCheckpointer.record, a CheckpointRecord kept in a list; "
        "the add tool idempotent (as the service's calculator), so no durable wait",
    }
    for key, name in (("engine_cpu_ms", "with"), ("engine_cpu_ms_without_checkpointer", "without")):
        out[f"ratio_last_first_{name}"] = rows[-1][key] / rows[0][key]
        out[f"ratio_last{k}_first{k}_{name}"] = window(key, iterations - k + 1, iterations) / window(
            key, 1, k
        )
        out[f"first{k}_ms_{name}"] = window(key, 1, k)
        out[f"last{k}_ms_{name}"] = window(key, iterations - k + 1, iterations)
    out["window"] = k
    return out


def cmd_checkpoints(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    sides = ("baseline", "new")
    http: dict[str, dict[str, list[dict[str, Any]]]] = {db: {s: [] for s in sides} for db in args.dbs}
    dbwork: dict[str, dict[str, list[dict[str, Any]]]] = {
        db: {s: [] for s in (*sides, "new_without_durable")} for db in args.dbs
    }
    states: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(baseline_worktree(args.baseline))
        trees = {"baseline": base, "new": str(ROOT)}
        files = {side: app_file(tree) for side, tree in trees.items()}
        for side, tree in trees.items():
            if not files[side].startswith(tree + os.sep):
                raise RuntimeError(f"{side}: app imported from {files[side]}, expected under {tree}")
        log(f"baseline app: {files['baseline']}; new app: {files['new']}")
        url5, _ = stack.enter_context(fake_llm(["--k", "5", "--tokens", "200", "--tool", "add"]))
        for r in range(args.rounds):
            # The tree may change under a long run (others at work in it): each round notes its state.
            states.append(tree_state())
            order = sides if r % 2 == 0 else sides[::-1]
            for db in args.dbs:
                for side in order if "http" in args.parts else ():
                    result = http_once(trees[side], db, args)
                    http[db][side].append(result)
                    log(
                        f"round {r + 1} http {db} {side}: worker CPU "
                        f"{result['worker_cpu_ms_per_run']:.2f} ms/run, "
                        f"wall p50 {result['wall_ms_p50']:.1f} ms"
                    )
                if "dbwork" not in args.parts:
                    continue
                for side in order:
                    result = dbwork_once(trees[side], db, url5, args)
                    dbwork[db][side].append(result)
                    log(
                        f"round {r + 1} dbwork {db} {side}: {result['cpu_ms_per_run']:.2f} ms CPU/run, "
                        f"{result['write_transactions_per_run']:.2f} write tx/run, "
                        f"{result['sessions_per_run']:.2f} sessions/run"
                    )
                result = dbwork_once(trees["new"], db, url5, args, without=("checkpoints", "follow-ups"))
                dbwork[db]["new_without_durable"].append(result)
                log(
                    f"round {r + 1} dbwork {db} new without checkpoints/follow-ups: "
                    f"{result['cpu_ms_per_run']:.2f} ms CPU/run"
                )
            if time.monotonic() - started > args.max_seconds:
                log(f"stopping after round {r + 1}: --max-seconds {args.max_seconds} reached")
                break
    scaled: dict[str, Any] | None = None
    if "scaling" in args.parts:
        with fake_llm(["--k", str(args.iterations), "--tokens", "200", "--tool", "add"]) as (url50, _):
            scaled = asyncio.run(scaling(url50, args.iterations, args.scale_repeats, 3, 180))
        k = scaled["window"]
        log(
            f"scaling: iteration {args.iterations}/1 engine CPU with checkpointer "
            f"{scaled['ratio_last_first_with']:.2f}x, "
            f"last {k}/first {k} {scaled[f'ratio_last{k}_first{k}_with']:.2f}x"
        )

    med = statistics.median

    def series(rows: list[dict[str, Any]], key: str) -> list[float]:
        return [float(row[key]) for row in rows]

    http_summary = {}
    for db, by_side in http.items():
        if not by_side["new"]:
            continue
        b, n = (
            series(by_side["baseline"], "worker_cpu_ms_per_run"),
            series(by_side["new"], "worker_cpu_ms_per_run"),
        )
        http_summary[db] = {
            "worker_cpu_ms_per_run": {"baseline": b, "new": n},
            "baseline_ms": med(b),
            "new_ms": med(n),
            "ratio": med(n) / med(b),
            "paired_ratios": [x / y for x, y in zip(n, b, strict=False)],
            "wall_ms_p50": {s: med(series(by_side[s], "wall_ms_p50")) for s in sides},
            "runs_per_round": args.http_runs,
            "database": by_side["new"][0]["database"],
        }
    db_summary = {}
    for db, by_side in dbwork.items():
        if not by_side["new"]:
            continue
        entry: dict[str, Any] = {"runs_per_round": args.db_runs}
        for variant, rows in by_side.items():
            entry[variant] = {
                "cpu_ms_per_run": series(rows, "cpu_ms_per_run"),
                "cpu_ms": med(series(rows, "cpu_ms_per_run")),
                "wall_ms": med(series(rows, "wall_ms_per_run")),
                "write_transactions_per_run": med(series(rows, "write_transactions_per_run")),
                "sessions_per_run": med(series(rows, "sessions_per_run")),
                "statements_per_run": med(series(rows, "statements_per_run")),
                "rows_inserted_per_run": rows[-1]["rows_inserted_per_run"],
                "checkpoints": rows[-1]["checkpoints"],
                "checkpoint_bytes": rows[-1]["checkpoint_bytes"],
                "drains": rows[-1]["drains"],
                "events_published": rows[-1]["events_published"],
            }
        entry["ratio_cpu"] = entry["new"]["cpu_ms"] / entry["baseline"]["cpu_ms"]
        entry["paired_ratios_cpu"] = [
            x / y
            for x, y in zip(entry["new"]["cpu_ms_per_run"], entry["baseline"]["cpu_ms_per_run"], strict=False)
        ]
        entry["ratio_cpu_durable_part"] = entry["new"]["cpu_ms"] / entry["new_without_durable"]["cpu_ms"]
        entry["ratio_write_transactions"] = (
            entry["new"]["write_transactions_per_run"] / entry["baseline"]["write_transactions_per_run"]
        )
        entry["ratio_sessions"] = entry["new"]["sessions_per_run"] / entry["baseline"]["sessions_per_run"]
        db_summary[db] = entry
    return {
        "scenario": "durable checkpoints",
        "target": TARGET_COST,
        "baseline": {"commit": git("rev-parse", "--short", args.baseline), "app_file": files["baseline"]},
        "new": {**states[0], "app_file": files["new"]},
        "new_changed_during_run": any(state != states[0] for state in [*states, tree_state()]),
        "new_states": states,
        "rounds": len(states),
        "parts": list(args.parts),
        "http": http_summary,
        "dbwork": db_summary,
        "scaling": scaled,
        "seconds": time.monotonic() - started,
        "how": (
            "One invocation: a detached git worktree of the baseline in a temporary directory; the "
            "baseline runs with cwd and PYTHONPATH at the worktree (its app.__file__ checked), the new "
            "code from this tree. service_bench http is this tree's script for both, only its worker "
            "imports the baseline's app (--app-path); durable_dbwork.py runs with either app. Interleaved "
            "rounds, baseline and new alternating first; medians of the rounds' per-run figures."
        ),
    }
