"""Durable runs: what checkpointing costs a run, and how soon a run lives on after its worker.

``checkpoints``: the same scripts against the baseline commit (the last one before durable runs,
``eaaa192``, checked out in a temporary git worktree) and against this tree, interleaved round by
round, in one invocation:

* ``service_bench.py http`` (this tree's script for both: only its workers import the baseline's
  ``app``, through ``--app-path``): the worker's CPU per run of the benchmark job over HTTP, on
  SQLite and on PostgreSQL;
* ``durable_dbwork.py`` (run with either tree's ``app``): the database work of one run's life with
  what the run writes (its events through the real publisher and group commit and, for the new
  code, its checkpoints and follow-up reads): CPU, transactions, statements and rows per run;
* in-process, new code only: ``engine_bench scaling``'s 50-iteration run with a checkpointer that
  does the service's per-checkpoint work (``orjson.dumps`` as ``RunCheckpointer.record``, kept in a
  list), against the same run without one: engine CPU of iteration 50 against iteration 1.

``resume``: uvicorn workers on a PostgreSQL database of their own and Redis; a run in flight
(answer tokens streamed slowly by the fake LLM) followed through another worker's stream. Three
ways a run's worker goes, each timed to the ``resumed`` phase event arriving at the client:
SIGKILL (from the kill; a worker of this host whose process is gone), a lease that runs out (a run
row held by a worker of "another host", from the lease's expiry) and SIGTERM (from the release
seen in the run's row, polled every few ms, to the event).

Loopback only; every loop is bounded in count and time; the child processes are stopped by pid
(or by the process group of a child started in a session of its own) when the script ends, also
on errors. Run from the repository root::

    .venv/bin/python -m bench.durable_bench checkpoints [--quick]
    .venv/bin/python -m bench.durable_bench resume [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from redis.asyncio import Redis

from bench.measure import QUESTION, emit, percentile
from bench.scratch_pg import POSTGRES_URL, ScratchDatabase
from bench.service_bench import HOST, REDIS_URL, free_port, new_conversation, start_run
from bench.wire import Connection, SseStream

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
BASELINE = "eaaa192"

TARGET_COST = (
    "Checkpoint cost: a run's worker CPU and database work with checkpoints against the same run "
    "before this change (the previous commit's figures, same scripts, same machine, one report): "
    "at most 1.1x; iteration 50 still at most 2x iteration 1, checkpoint included."
)
TARGET_RESUME = (
    "Resume time after SIGKILL (lease expiry to the resumed run's first event) and after SIGTERM "
    "(release to first event), p50/p99 over at least 20 kills; the SIGTERM hand-over under 1 s p99."
)


def log(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def tree_state() -> dict[str, Any]:
    """This tree's commit, and whether (and how) its app/ differs from that commit."""
    diff = git("diff", "HEAD", "--", "app")
    untracked = git("ls-files", "--others", "--exclude-standard", "--", "app").split()
    digest = hashlib.sha1(diff.encode())
    for name in untracked:
        digest.update(name.encode() + b"\0" + (ROOT / name).read_bytes())
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "app_uncommitted": bool(diff or untracked),
        "app_diff_sha1": digest.hexdigest()[:12] if diff or untracked else None,
    }


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


def summary(values: Sequence[float]) -> dict[str, float]:
    ms = list(values)
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 0.5),
        "p90_ms": percentile(ms, 0.9),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms) if ms else float("nan"),
        "min_ms": min(ms) if ms else float("nan"),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- checkpoints: cost ----------------------------------------------------------------------------


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


# ---- resume: time to the resumed event -----------------------------------------------------------


class Worker:
    """One uvicorn worker of the app (this tree's), restartable; stopped by its pid."""

    def __init__(self, name: str, env: dict[str, str], tmp: str) -> None:
        self.name = name
        self.env = env
        self.tmp = tmp
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1
        self.port = free_port()
        log_file = open(Path(self.tmp) / f"{self.name}-{self.starts}.log", "wb")  # noqa: ASYNC230
        self.proc = subprocess.Popen(  # noqa: ASYNC220
            [
                PY,
                "-m",
                "uvicorn",
                "app.main:create_app",
                "--factory",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                "--no-access-log",
                "--timeout-keep-alive",
                "300",
            ],
            cwd=self.tmp,
            env=self.env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        log_file.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"worker {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            conn = Connection(HOST, self.port)
            try:
                status, _ = await conn.request("GET", "/readyz")
                if status == 200:
                    return
            except OSError:
                pass
            finally:
                await conn.close()
            await asyncio.sleep(0.05)
        raise RuntimeError(f"worker {self.name} not ready in 60 s")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def wait_exit(self, timeout_s: float) -> bool:
        assert self.proc is not None
        try:
            await asyncio.to_thread(self.proc.wait, timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    async def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        if not await self.wait_exit(20):
            self.proc.kill()
            await self.wait_exit(10)

    def log_tail(self) -> str:
        path = Path(self.tmp) / f"{self.name}-{self.starts}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


class Follower:
    """A client following a conversation through a worker's SSE stream, to its ``done``."""

    def __init__(self, port: int, conversation_id: str) -> None:
        self.stream = SseStream(HOST, port, f"/api/conversations/{conversation_id}/stream")
        self.first_delta = asyncio.Event()
        self.resumed = asyncio.Event()
        self.resumed_at: float | None = None
        """When the ``resumed`` phase event's bytes arrived (unix time, s)."""
        self.resumed_data: dict[str, Any] | None = None
        self.parts: list[str] = []
        """Answer deltas since the last ``resumed`` (what done.answer must be)."""
        self.done: dict[str, Any] | None = None
        self.events = 0

    async def follow(self) -> None:
        async for received, event, data in self.stream.events():
            self.events += 1
            if event == "answer":
                payload = orjson.loads(data)
                if payload.get("status") == "delta":
                    self.parts.append(payload["content"])
                    self.first_delta.set()
            elif event == "phase":
                payload = orjson.loads(data)
                if payload.get("phase") == "resumed" and self.resumed_at is None:
                    self.resumed_at = received / 1e6
                    self.resumed_data = payload
                    self.parts.clear()
                    self.resumed.set()
            elif event == "done":
                self.done = orjson.loads(data)
        self.first_delta.set()  # never leave a waiter behind
        self.resumed.set()

    @property
    def answer_ok(self) -> bool:
        return (
            self.done is not None
            and self.done.get("status") == "completed"
            and self.done.get("answer") == "".join(self.parts)
        )


@dataclasses.dataclass
class Sample:
    kind: str
    ms: float | None = None
    error: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class ResumeBench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = tempfile.TemporaryDirectory(prefix="agentstream-durable-")
        self.prefix = f"agentstream-bench:{uuid.uuid4().hex[:12]}"
        self.scratch = ScratchDatabase()
        self.fake: subprocess.Popen[str] | None = None
        self.llm_url = ""
        self.s: Worker | None = None
        self.v: Worker | None = None
        self.db: Any = None
        self.pg: Any = None
        self.restarts = 0

    # -- set-up and tear-down

    async def __aenter__(self) -> ResumeBench:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _start(self) -> None:
        import asyncpg

        from app.db.session import Database

        a = self.args
        self.fake = subprocess.Popen(  # noqa: ASYNC220
            [
                PY,
                "-m",
                "bench.fakellm",
                "--k",
                "1",
                "--tool",
                "calculator",
                "--tokens",
                str(a.tokens),
                "--timed",
                "--delay-s",
                str(a.delay_s),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            # A killed worker's connection makes it print tracebacks: kept out of the way.
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.fake.stdout is not None
        self.llm_url = (await asyncio.to_thread(self.fake.stdout.readline)).strip()
        if not self.llm_url.startswith(f"http://{HOST}:"):
            raise RuntimeError(f"fake LLM did not start: {self.llm_url!r}")
        await self.scratch.create()
        env = {
            **os.environ,
            "LLM_BASE_URL": self.llm_url,
            "LLM_API_KEY": "bench",
            "LLM_MODEL": "fake-model",
            "REDIS_URL": REDIS_URL,
            "REDIS_KEY_PREFIX": self.prefix,
            "DATABASE_URL": self.scratch.url,
            "LOG_LEVEL": "WARNING",
            "RUN_LEASE_S": str(a.run_lease_s),
            "SHUTDOWN_GRACE_S": str(a.grace_s),
            "TOOL_RATE_LIMIT_PER_MINUTE": "1000000",
        }
        self.s = Worker("S", env, self.tmp.name)
        self.v = Worker("V", env, self.tmp.name)
        await self.s.start()  # one at a time: each migrates the database as it starts
        await self.v.start()
        self.db = Database(self.scratch.url)
        self.pg = await asyncpg.connect(f"{POSTGRES_URL}/{self.scratch.name}", timeout=5)

    async def __aexit__(self, *exc: object) -> None:
        if exc and exc[0] is not None:
            for w in (self.s, self.v):
                if w is not None:
                    print(f"--- worker {w.name} log (tail) ---\n{w.log_tail()}", file=sys.stderr)
        for w in (self.s, self.v):
            if w is not None:
                with contextlib.suppress(Exception):
                    await w.stop()
        if self.fake is not None and self.fake.poll() is None:
            self.fake.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.fake.wait, 10)
            except subprocess.TimeoutExpired:
                self.fake.kill()
        if self.pg is not None:
            with contextlib.suppress(Exception):
                await self.pg.close()
        if self.db is not None:
            with contextlib.suppress(Exception):
                await self.db.dispose()
        redis = Redis.from_url(REDIS_URL)
        try:
            keys = [k async for k in redis.scan_iter(match=f"{self.prefix}:*", count=1000)]
            for i in range(0, len(keys), 500):
                await redis.delete(*keys[i : i + 500])
        finally:
            await redis.aclose()
        with contextlib.suppress(Exception):
            await self.scratch.drop()
        self.tmp.cleanup()

    async def ensure_victim(self) -> None:
        """V up again (bounded: a restart per round, and a few more)."""
        assert self.v is not None
        if self.v.alive:
            return
        self.restarts += 1
        if self.restarts > self.args.max_restarts:
            raise RuntimeError(f"more than {self.args.max_restarts} worker restarts")
        await self.v.start()

    # -- the pieces of a round

    async def _follow(self, conv: str, port: int) -> tuple[Follower, asyncio.Task[None]]:
        follower = Follower(port, conv)
        return follower, asyncio.create_task(follower.follow())

    async def _run_on_victim(self) -> tuple[str, str, Follower, asyncio.Task[None]]:
        """A run started on V, followed through S; returns once its answer streams."""
        assert self.s is not None and self.v is not None
        conn = Connection(HOST, self.v.port)
        try:
            conv = await new_conversation(conn)
            run = await start_run(conn, conv)
        finally:
            await conn.close()
        follower, task = await self._follow(conv, self.s.port)
        await asyncio.wait_for(follower.first_delta.wait(), 30)
        if follower.done is not None:
            raise RuntimeError("the run finished before it could be stopped")
        await asyncio.sleep(random.uniform(0, self.args.jitter_s))
        return conv, str(run["run_id"]), follower, task

    async def _finish(self, sample: Sample, follower: Follower, task: asyncio.Task[None]) -> None:
        try:
            await asyncio.wait_for(task, 60)
        except TimeoutError:
            follower.stream.abort()
            sample.error = "no done within 60 s of the resume"
            return
        sample.extra["attempt"] = (follower.resumed_data or {}).get("attempt")
        if not follower.answer_ok:
            sample.error = (
                f"done {(follower.done or {}).get('status')}, or its answer differs from the deltas"
            )

    async def _resumed(self, follower: Follower, timeout_s: float) -> float:
        await asyncio.wait_for(follower.resumed.wait(), timeout_s)
        if follower.resumed_at is None:
            raise RuntimeError(f"the stream ended without a resumed event (done: {follower.done})")
        return follower.resumed_at

    async def _dephase(self) -> None:
        """A random pause of up to one claim interval. The workers look for runs to take over every
        claim interval; without it the rounds, which start right after the previous resume, fall
        into step with those looks and every sample shows about the same delay."""
        await asyncio.sleep(random.uniform(0, self.claim_interval))

    # -- the three ways a worker goes

    async def sigkill_round(self) -> Sample:
        assert self.v is not None and self.v.proc is not None
        await self.ensure_victim()
        sample = Sample("sigkill")
        await self._dephase()
        _, _, follower, task = await self._run_on_victim()
        t_kill = time.time()
        self.v.proc.send_signal(signal.SIGKILL)
        # Reaped at once, as a process manager would (a zombie is detected as gone too).
        await self.v.wait_exit(10)
        try:
            arrived = await self._resumed(follower, 3 * self.claim_interval + 10)
            sample.ms = 1000 * (arrived - t_kill)
        except (TimeoutError, RuntimeError) as exc:
            sample.error = f"no resumed event: {exc!r}"
            follower.stream.abort()
        restart = asyncio.create_task(self.ensure_victim())
        if sample.error is None:
            await self._finish(sample, follower, task)
        else:
            task.cancel()
        await restart
        return sample

    async def lease_round(self) -> Sample:
        from app.db.repositories import RunRepo

        assert self.s is not None
        sample = Sample("lease")
        await self._dephase()
        conn = Connection(HOST, self.s.port)
        try:
            conv = await new_conversation(conn)
        finally:
            await conn.close()
        owner = await self.pg.fetchval("SELECT owner FROM conversations WHERE id = $1", conv)
        run, _ = await RunRepo(self.db.sessionmaker).start(
            conv,
            owner,
            QUESTION,
            worker_id=f"otherhost-{uuid.uuid4().hex[:6]}:1:gone",
            lease_s=self.args.other_lease_s,
            start_cursor="0-0",
        )
        expires_at = run.lease_expires_at
        assert expires_at is not None
        if expires_at.tzinfo is None:
            expires_at = expires_at.replace(tzinfo=UTC)
        expiry = expires_at.timestamp()
        follower, task = await self._follow(conv, self.s.port)
        try:
            arrived = await self._resumed(follower, self.args.other_lease_s + 3 * self.claim_interval + 10)
            sample.ms = 1000 * (arrived - expiry)
            if sample.ms < 0:
                sample.error = "resumed before the lease ran out"
        except (TimeoutError, RuntimeError) as exc:
            sample.error = f"no resumed event: {exc!r}"
            follower.stream.abort()
            task.cancel()
            return sample
        await self._finish(sample, follower, task)
        return sample

    async def _poll_release(self, run_id: str, stop_at: float) -> tuple[float, float, float, int, bool]:
        """Poll the run's row until its first attempt's worker no longer holds it: (start of the
        last poll that still saw it held, start and end of the poll that saw it let go, polls, and
        whether that poll saw it already claimed by another worker: the release and the claim can
        both fall between two polls when the machine is busy)."""
        held_since = time.time()
        polls = 0
        holder: str | None = None
        while time.monotonic() < stop_at:
            start = time.time()
            row = await self.pg.fetchrow("SELECT worker_id, attempt FROM runs WHERE id = $1", run_id)
            end = time.time()
            polls += 1
            assert row is not None
            if holder is None and row["attempt"] == 1:
                holder = row["worker_id"]
            if row["worker_id"] is None or row["attempt"] != 1 or row["worker_id"] != holder:
                return held_since, start, end, polls, row["worker_id"] is not None
            held_since = start
            await asyncio.sleep(self.args.poll_s)
        raise TimeoutError("the run was not released")

    async def sigterm_round(self) -> Sample:
        assert self.v is not None and self.v.proc is not None
        await self.ensure_victim()
        sample = Sample("sigterm")
        _, run_id, follower, task = await self._run_on_victim()
        poll = asyncio.create_task(self._poll_release(run_id, time.monotonic() + self.args.grace_s + 20))
        await asyncio.sleep(0)  # the first poll is on its way before the signal
        t_term = time.time()
        self.v.proc.send_signal(signal.SIGTERM)
        stage = "resumed event"
        try:
            arrived = await self._resumed(follower, self.args.grace_s + 20)
            stage = "release seen in the row"
            held, _seen_start, seen_end, polls, claimed = await asyncio.wait_for(poll, 5)
        except (TimeoutError, RuntimeError) as exc:
            sample.error = f"no {stage} within the time allowed: {exc!r}"
            poll.cancel()
            await self._diagnose(sample, run_id, follower, t_term)
            follower.stream.abort()
            task.cancel()
            await self.v.wait_exit(30)
            return sample
        # The release committed after ``held`` (that poll still saw the row held) and before
        # ``seen_end``: the figure counts from ``held``, so it may overstate by one poll.
        sample.ms = 1000 * (arrived - held)
        sample.extra = {
            "release_to_resumed_low_ms": 1000 * (arrived - seen_end),
            "term_to_release_ms": 1000 * ((held + seen_end) / 2 - t_term),
            "term_to_resumed_ms": 1000 * (arrived - t_term),
            "poll_window_ms": 1000 * (seen_end - held),
            "polls": polls,
            "release_seen_claimed_already": claimed,
        }
        if not await self.v.wait_exit(30):
            sample.error = "the worker did not exit within 30 s of SIGTERM"
        restart = asyncio.create_task(self.ensure_victim())
        await self._finish(sample, follower, task)
        await restart
        return sample

    async def _diagnose(self, sample: Sample, run_id: str, follower: Follower, t_start: float) -> None:
        """What a failed round left behind, for the report: the run's row, whether a resumed event
        or the done came later (waiting up to 30 s more), and the workers' logs."""
        assert self.s is not None and self.v is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(follower.resumed.wait(), 30)
        row = await self.pg.fetchrow(
            "SELECT status, worker_id, attempt, lost_attempts, lease_expires_at FROM runs WHERE id = $1",
            run_id,
        )
        sample.extra = {
            "run_row": {k: str(v) for k, v in dict(row or {}).items()},
            "resumed_after_s": None if follower.resumed_at is None else follower.resumed_at - t_start,
            "resumed": follower.resumed_data,
            "done": (follower.done or {}).get("status"),
            "events_seen": follower.events,
            "victim_exit_code": self.v.proc.poll() if self.v.proc is not None else None,
            "log_v": self.v.log_tail()[-1500:],
            "log_s": self.s.log_tail()[-1500:],
        }
        log(f"failed round: {json.dumps({k: v for k, v in sample.extra.items() if not k.startswith('log')})}")

    @property
    def claim_interval(self) -> float:
        # app.runs.takeover.Takeover.claim_loop
        return min(2.0, max(self.args.run_lease_s / 3, 0.05))


async def resume(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    deadline = started + args.max_seconds
    samples: dict[str, list[Sample]] = {"sigkill": [], "lease": [], "sigterm": []}
    async with ResumeBench(args) as bench:
        plan = [("sigkill", args.kills, bench.sigkill_round), ("lease", args.leases, bench.lease_round)]
        plan.append(("sigterm", args.terms, bench.sigterm_round))
        for kind, count, one in plan:
            for i in range(count):
                if time.monotonic() > deadline:
                    log(f"{kind}: stopped after {i} rounds (--max-seconds {args.max_seconds})")
                    break
                sample = await one()
                samples[kind].append(sample)
                shown = f"{sample.ms:.0f} ms" if sample.ms is not None else "-"
                log(f"{kind} {i + 1}/{count}: {shown}{' ERROR ' + sample.error if sample.error else ''}")
        worker_restarts = bench.restarts
        claim_interval = bench.claim_interval

    def block(kind: str) -> dict[str, Any]:
        good = [s for s in samples[kind] if s.ms is not None and s.error is None]
        out: dict[str, Any] = {
            **summary([s.ms for s in good if s.ms is not None]),
            "rounds": len(samples[kind]),
            "errors": [s.error for s in samples[kind] if s.error],
            "failed_rounds": [s.extra for s in samples[kind] if s.error and s.extra],
            "samples_ms": [round(s.ms, 1) if s.ms is not None else None for s in samples[kind]],
        }
        if kind == "sigterm" and good:
            for key in (
                "release_to_resumed_low_ms",
                "term_to_release_ms",
                "term_to_resumed_ms",
                "poll_window_ms",
            ):
                values = [s.extra[key] for s in good]
                out[key] = {
                    "p50": percentile(values, 0.5),
                    "p99": percentile(values, 0.99),
                    "max": max(values),
                }
            out["release_seen_claimed_already"] = sum(
                bool(s.extra.get("release_seen_claimed_already")) for s in good
            )
        return out

    result = {
        "scenario": "durable resume",
        "target": TARGET_RESUME,
        "new": tree_state(),
        "database": "PostgreSQL (asyncpg) on 127.0.0.1, a database made for the run and dropped after",
        "workers": "2 uvicorn workers (S streams, V runs and is stopped; V restarted after each kill)",
        "run_lease_s": args.run_lease_s,
        "claim_interval_s": claim_interval,
        "shutdown_grace_s": args.grace_s,
        "other_host_lease_s": args.other_lease_s,
        "poll_s": args.poll_s,
        "answer": f"{args.tokens} tokens, {1000 * args.delay_s:g} ms apart; stopped "
        f"0-{1000 * args.jitter_s:g} ms after the client's first answer delta",
        "worker_restarts": worker_restarts,
        "sigkill": block("sigkill"),
        "lease": block("lease"),
        "sigterm": block("sigterm"),
        "seconds": time.monotonic() - started,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    term = result["sigterm"]
    result["sigterm_p99_under_1s"] = bool(term["n"]) and term["p99_ms"] < 1000 and not term["errors"]
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("checkpoints", help="checkpoint cost: baseline against new, one invocation")
    c.add_argument("--baseline", default=BASELINE)
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--http-runs", type=int, default=100)
    c.add_argument("--http-warmup", type=int, default=10)
    c.add_argument("--db-runs", type=int, default=200)
    c.add_argument("--db-warmup", type=int, default=20)
    c.add_argument("--dbs", nargs="+", choices=["sqlite", "postgres"], default=["sqlite", "postgres"])
    c.add_argument("--iterations", type=int, default=50)
    c.add_argument("--scale-repeats", type=int, default=20)
    c.add_argument("--max-seconds", type=float, default=600, help="no new round after this long")
    c.add_argument(
        "--parts",
        nargs="+",
        choices=["http", "dbwork", "scaling"],
        default=["http", "dbwork", "scaling"],
        help="measure only these (e.g. more rounds of one part)",
    )
    r = sub.add_parser("resume", help="time from a worker's end to the resumed event at the client")
    r.add_argument("--kills", type=int, default=20, help="SIGKILL rounds")
    r.add_argument("--leases", type=int, default=20, help="rounds of a run whose other-host lease runs out")
    r.add_argument("--terms", type=int, default=20, help="SIGTERM rounds")
    r.add_argument("--run-lease-s", type=float, default=6.0, help="the workers' RUN_LEASE_S")
    r.add_argument("--other-lease-s", type=float, default=1.0, help="lease of the other host's run")
    r.add_argument("--grace-s", type=float, default=0.2, help="the workers' SHUTDOWN_GRACE_S")
    r.add_argument("--tokens", type=int, default=100)
    r.add_argument("--delay-s", type=float, default=0.01)
    r.add_argument("--jitter-s", type=float, default=0.3)
    r.add_argument("--poll-s", type=float, default=0.003)
    r.add_argument("--max-restarts", type=int, default=0, help="default: kills + terms + 5")
    r.add_argument("--max-seconds", type=float, default=420)
    for p in (c, r):
        p.add_argument("--quick", action="store_true", help="fewer rounds and runs")
    args = parser.parse_args(argv)
    if args.quick and args.command == "checkpoints":
        args.rounds, args.http_runs, args.db_runs, args.scale_repeats = 2, 30, 60, 6
    if args.quick and args.command == "resume":
        args.kills = args.leases = args.terms = 5
    if args.command == "resume" and not args.max_restarts:
        args.max_restarts = args.kills + args.terms + 5

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # so that the finally blocks stop the children

    signal.signal(signal.SIGTERM, stop)
    if args.command == "checkpoints":
        emit(cmd_checkpoints(args))
    else:
        emit(asyncio.run(resume(args)))


if __name__ == "__main__":
    main(sys.argv[1:])
