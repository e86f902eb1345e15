"""Tracing cost (issue 16): the engine's CPU per run with OpenTelemetry tracing on, off, and before it.

The benchmark job (``engine_bench job``'s: ``ReActAgent`` on ``OpenAICompatibleLLM`` against the fake
LLM, 5 ``add`` calls then a 200-token streamed answer), wired as the service wires a run: the model's
LLM in ``InstrumentedLLM`` (metrics and, on, ``tracing.chat_spans(spec)``),
the registry through ``tracing.tools(...)`` and each run in ``tracing.run_span(...)`` with its
``outcome``. The sides, each a child process running this file's ``job`` (the same script for all):

* ``before``: the baseline commit's ``app`` (``43354e2``, the last one before tracing, checked out in
  a temporary git worktree; ``cwd`` and ``PYTHONPATH`` at it), the service's wiring of then
  (``InstrumentedLLM`` only);
* ``off``: this tree, ``build_tracing`` of settings without an endpoint (``NO_TRACING``);
* ``on``: this tree, spans exported over OTLP/HTTP to a local receiver (another child process, so
  its CPU is not counted: ``tests/support/otlp_receiver.py``'s, which decodes and counts them);
* ``capture``: as ``on``, with ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` on;
* ``spans`` (only if asked for): this tree's ``Tracing`` whose batch processor feeds an exporter
  that drops everything: the spans' cost without their encoding and sending.

The figure is the process's CPU (``time.process_time()``, every thread: the batch exporter's too)
over the timed runs and a ``force_flush`` of the tracer provider at their end (so that every span of
the window is exported inside it), divided by the runs; the main thread's share during the runs is
noted apart (``force_flush`` exports in the calling thread). The warm-up runs' spans are flushed
before the window opens. The receiver's count is checked after every child against the spans its
runs made (1 ``invoke_agent`` + 1 ``chat`` per LLM call + 1 ``execute_tool`` per tool call); no span
at all fails the bench, and ``before``/``off``/``spans`` must send none.

Rounds are interleaved (the order of the sides turning each round) in one invocation; each round
also runs this tree's modes together in one more child (``mixed``: blocks of runs interleaved, each
traced block flushed inside its window), where every block is compared with the ``off`` block next
to it. Reported: per side the median over rounds, the ratios on/off, capture/off, off/before (of
the medians, and the paired per-round ratios' spread), and the mixed child's paired block ratios.
Children run in sessions of their own and are stopped by process group at the end, also on errors;
the worktree is removed; everything is bounded in count and time and talks to 127.0.0.1 only
(proxies are taken out of the children's environment, and any ``OTEL_*`` variable). Run from the
repository root::

    .venv/bin/python -m bench.tracing_bench [--quick] [--rounds N] [--runs N] [--sides ... spans]

It prints a table and writes the JSON to ``bench/out/tracing.json`` (``--out``). A child alone:
``PYTHONPATH=. .venv/bin/python bench/tracing_bench.py job --mode off [on ...] --url URL
[--endpoint URL]``, with a receiver from ``.venv/bin/python -m bench.tracing_bench receiver``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# Only the standard library at the top: the ``job`` child imports either tree's ``app`` (and
# ``bench.measure``) itself, and the orchestrator's helpers come from ``bench.durable_*`` in ``main``.

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
BASELINE = "43354e2"
SIDES = ("before", "off", "on", "capture", "spans")
DEFAULT_SIDES = ("before", "off", "on", "capture")
TRACED = ("on", "capture")
"""The sides whose spans reach the receiver (``spans`` makes them and throws them away)."""
TARGET = (
    "Engine CPU per run with tracing on (exporting to a local receiver) against off: report the ratio "
    "(goal at most 1.15x); off must be indistinguishable from before this change."
)
TARGET_RATIO = 1.15
ABILITIES = {"tool_call": True, "json_mode": True, "streaming": True}
DESCRIBED = {
    "before": "baseline app, InstrumentedLLM only",
    "off": "this tree, NO_TRACING wiring",
    "on": "this tree, OTLP/HTTP export to the receiver",
    "capture": "as on, message content captured",
    "spans": "this tree, spans made and batched, a no-op exporter",
}


# ---- the job (child process, either tree's app) ----------------------------------------------------


def discarding_tracing() -> Any:
    """This tree's ``Tracing`` as ``build_tracing`` makes it, its batch processor feeding an exporter
    that throws the spans away: what the spans cost without their encoding and sending."""
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from app.tracing import Tracing

    class Discard(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    return Tracing(provider)


class Subject:
    """One mode's agent, wired as the service wires a run: the model's LLM in ``InstrumentedLLM``
    (metrics) on every side, with ``tracing.chat_spans`` in it for this tree, the registry through
    ``tracing.tools`` and each run in ``tracing.run_span`` with its ``outcome``."""

    def __init__(self, mode: str, args: argparse.Namespace) -> None:
        import bench.measure as measure
        from app.engine.agent import AgentConfig, ReActAgent
        from app.llm.openai_client import OpenAICompatibleLLM
        from app.observability import Metrics
        from app.runs.instrumented import InstrumentedLLM
        from app.tools.registry import Tool, ToolRegistry

        async def add(a: int, b: int) -> str:
            return str(a + b)

        self.mode = mode
        self.args = args
        fn = measure.ADD_SCHEMA["function"]
        assert isinstance(fn, dict)
        registry = ToolRegistry.of([Tool("add", str(fn["description"]), fn["parameters"], add)])
        inner = OpenAICompatibleLLM(args.url, "bench", "fake-model", ABILITIES)
        self.llm: Any = InstrumentedLLM(inner, Metrics(), "default")
        self.tracing: Any = None
        self.models: Any = None
        if mode != "before":
            from app.llm.models import ModelRegistry, ModelSpec
            from app.settings import Settings
            from app.tracing import NO_TRACING, build_tracing

            if mode == "off":
                self.tracing = build_tracing(Settings(_env_file=None))  # type: ignore[call-arg]
                if self.tracing is not NO_TRACING:
                    raise SystemExit("off: build_tracing did not return NO_TRACING (an OTEL_* variable set?)")
            elif mode == "spans":
                self.tracing = discarding_tracing()
            else:
                settings = Settings(
                    _env_file=None,  # type: ignore[call-arg]
                    otel_exporter_otlp_endpoint=args.endpoint,
                    otel_instrumentation_genai_capture_message_content=mode == "capture",
                )
                self.tracing = build_tracing(settings)
                if not self.tracing.enabled or self.tracing.capture_content != (mode == "capture"):
                    raise SystemExit(f"{mode}: tracing not on as asked")
            spec = ModelSpec(name="default", model="fake-model", base_url=args.url)
            self.llm = InstrumentedLLM(inner, Metrics(), "default", self.tracing.chat_spans(spec))
            self.models = ModelRegistry([spec], {"default": self.llm})
            registry = self.tracing.tools(registry)
        self.agent = ReActAgent(self.llm, registry, AgentConfig(completion_check=False))
        self.expected = measure.expected_answer(args.tokens)
        self.question = measure.QUESTION
        self.made = 0
        """Spans made so far (1 ``invoke_agent``, 1 ``chat`` per LLM call, 1 ``execute_tool`` per
        tool call a run), had tracing been on."""

    async def run_once(self, n: int) -> None:
        from app.engine.events import AnswerDelta, EngineEvent, IterationDone, Usage
        from app.observability import conversation_id_var, run_id_var

        run_id, conversation_id = f"run_{self.mode}_{n:06d}", f"conv_{self.mode}_{n:06d}"
        run_id_var.set(run_id)  # as the service's attempt does (logs; the chat spans' conversation id)
        conversation_id_var.set(conversation_id)
        parts: list[str] = []
        tools = 0

        async def sink(event: EngineEvent) -> None:
            nonlocal tools
            if type(event) is AnswerDelta:
                parts.append(event.content)
            elif type(event) is IterationDone:
                tools += 1

        usage = Usage()
        kwargs: dict[str, Any] = {"sink": sink, "run_id": run_id, "conversation_id": conversation_id}
        if self.tracing is None:
            await self.agent.run(self.question, usage=usage, **kwargs)
        else:
            span = self.tracing.run_span(
                run_id=run_id,
                conversation_id=conversation_id,
                attempt=1,
                model="default",
                models=self.models,
                traceparent=None,
            )
            with span:
                result = await self.agent.run(self.question, usage=usage, **kwargs)
                span.outcome(result.status, result.error, usage.prompt_tokens, usage.completion_tokens)
        if tools != self.args.k or "".join(parts) != self.expected:
            raise SystemExit(f"{self.mode}: expected {self.args.k} tool calls and the answer, got {tools}")
        self.made += 1 + usage.llm_calls + tools

    def flush(self) -> None:
        provider = self.tracing._provider if self.tracing is not None else None
        if provider is not None and not provider.force_flush(30_000):
            raise SystemExit(f"{self.mode}: force_flush timed out")

    async def block(self, first: int, runs: int, deadline: float) -> dict[str, Any]:
        """``runs`` timed runs and a flush of their spans: the process's CPU (every thread) and the
        main thread's over them, per run."""
        per_run: list[float] = []
        made = self.made
        c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        for n in range(first, first + runs):
            r0 = time.process_time()
            await self.run_once(n)
            per_run.append(time.process_time() - r0)
            if time.monotonic() > deadline:
                break
        f0, ft0 = time.process_time(), time.thread_time()
        self.flush()  # the SDK's force_flush exports in the calling thread
        c1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
        n = len(per_run)
        return {
            "runs": n,
            "cpu_ms_per_run": 1000 * (c1 - c0) / n,
            "main_thread_cpu_ms_per_run": 1000 * (t1 - t0) / n,
            "main_thread_in_runs_cpu_ms_per_run": 1000 * (ft0 - t0) / n,
            "other_threads_cpu_ms_per_run": 1000 * ((c1 - c0) - (t1 - t0)) / n,
            "flush_cpu_ms": 1000 * (c1 - f0),
            "cpu_ms_p50_per_run": 1000 * statistics.median(per_run),
            "wall_ms_per_run": 1000 * (w1 - w0) / n,
            "spans_per_run": (self.made - made) / n,
        }

    async def close(self) -> None:
        if self.tracing is not None:
            await self.tracing.shutdown()
        await self.llm.aclose()


async def job(args: argparse.Namespace) -> dict[str, Any]:
    """One mode (``args.mode`` one name): warm-up, flush, one timed block of ``args.runs``. Several
    (the mixed child): each warmed up, then ``args.blocks`` rounds of one block of ``args.runs``
    per mode, the order turning each round, in this one process."""
    import app
    import bench.measure as measure

    subjects = [Subject(mode, args) for mode in args.mode]
    for subject in subjects:
        for n in range(args.warmup):
            await subject.run_once(n)
        subject.flush()
    gc.collect()
    deadline = time.monotonic() + args.max_seconds
    blocks: dict[str, list[dict[str, Any]]] = {s.mode: [] for s in subjects}
    first = args.warmup
    for b in range(args.blocks):
        k = b % len(subjects)
        for subject in (*subjects[k:], *subjects[:k]):
            blocks[subject.mode].append(await subject.block(first, args.runs, deadline))
        first += args.runs
        if time.monotonic() > deadline:
            break
    for subject in subjects:
        await subject.close()
    versions: dict[str, str] = {}
    if any(mode != "before" for mode in args.mode):
        from importlib.metadata import version

        versions = {p: version(p) for p in ("opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http")}
    out: dict[str, Any] = {
        "modes": {
            s.mode: {
                "blocks": blocks[s.mode],
                "cpu_ms_per_run": sum(b["cpu_ms_per_run"] * b["runs"] for b in blocks[s.mode])
                / sum(b["runs"] for b in blocks[s.mode]),
                "spans_made": s.made if s.mode in TRACED else 0,
            }
            for s in subjects
        },
        "app_file": app.__file__,
        "measure_file": measure.__file__,
        "warmup": args.warmup,
        "versions": versions,
        "python": sys.version.split()[0],
    }
    if len(subjects) == 1:  # the single side's figures at the top level
        out.update(blocks[subjects[0].mode][0], mode=subjects[0].mode)
        out["spans_made"] = out["modes"][subjects[0].mode]["spans_made"]
    return out


# ---- the receiver (child process) ------------------------------------------------------------------


def serve_receiver(seconds: float) -> None:
    """``tests/support/otlp_receiver.py``'s receiver on a free port: prints its endpoint, then
    answers each line on stdin with the counts so far (JSON), until stdin closes or time runs out."""
    from tests.support.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver(0, keep=False).start()
    try:
        print(receiver.endpoint, flush=True)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([sys.stdin], [], [], min(left, 1.0))
            if not ready:
                continue
            if not sys.stdin.readline():
                break
            print(json.dumps({"requests": receiver.requests, "spans": receiver.span_count}), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        receiver.stop()


class Receiver:
    def __init__(self, proc: subprocess.Popen[str], endpoint: str) -> None:
        self.proc = proc
        self.endpoint = endpoint

    def count(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], 10)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the OTLP receiver did not answer (exit code {self.proc.poll()})")
        return dict(json.loads(line))


# ---- the orchestrator ------------------------------------------------------------------------------


def child_env(tree: str | Path) -> dict[str, str]:
    """``import app`` finds ``tree``'s (ahead of the venv's editable install); no ``OTEL_*``
    variable (each side sets up tracing itself) and no proxy (everything is on 127.0.0.1)."""
    proxies = {"http_proxy", "https_proxy", "all_proxy"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k.lower() not in proxies}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


@contextlib.contextmanager
def receiver(seconds: float) -> Iterator[Receiver]:
    from bench.durable_cost import stop_group

    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.tracing_bench", "receiver", "--seconds", str(seconds)],
        cwd=ROOT,
        env=child_env(ROOT),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        endpoint = proc.stdout.readline().strip() if ready else ""
        if not endpoint.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"the OTLP receiver did not start: {endpoint!r}")
        yield Receiver(proc, endpoint)
    finally:
        stop_group(proc, grace_s=5)


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = statistics.median
    sides: dict[str, Any] = {}
    for side, rows in results.items():
        if not rows:
            continue
        sides[side] = {
            "cpu_ms_per_run": [r["cpu_ms_per_run"] for r in rows],
            "cpu_ms": spread([r["cpu_ms_per_run"] for r in rows]),
            "main_thread_cpu_ms": med(r["main_thread_cpu_ms_per_run"] for r in rows),
            "main_thread_in_runs_cpu_ms": med(r["main_thread_in_runs_cpu_ms_per_run"] for r in rows),
            "rest_cpu_ms": med(r["cpu_ms_per_run"] - r["main_thread_in_runs_cpu_ms_per_run"] for r in rows),
            "other_threads_cpu_ms": med(r["other_threads_cpu_ms_per_run"] for r in rows),
            "flush_cpu_ms": med(r["flush_cpu_ms"] for r in rows),
            "cpu_ms_p50_per_run": med(r["cpu_ms_p50_per_run"] for r in rows),
            "wall_ms_per_run": med(r["wall_ms_per_run"] for r in rows),
            "spans_per_run": med(r["spans_per_run"] for r in rows),
            "spans_received": sum(r["spans_received"] for r in rows),
            "spans_made": sum(r["spans_made"] for r in rows),
            "runs_per_round": rows[0]["runs"],
        }
    ratios: dict[str, Any] = {}
    for name, (top, bottom) in {
        "on/off": ("on", "off"),
        "capture/off": ("capture", "off"),
        "spans/off": ("spans", "off"),
        "off/before": ("off", "before"),
        "on/before": ("on", "before"),
    }.items():
        if top not in sides or bottom not in sides:
            continue
        a, b = sides[top]["cpu_ms_per_run"], sides[bottom]["cpu_ms_per_run"]
        paired = [x / y for x, y in zip(a, b, strict=True)]
        ratios[name] = {
            "of_medians": sides[top]["cpu_ms"]["median"] / sides[bottom]["cpu_ms"]["median"],
            "paired": paired,
            "paired_spread": spread(paired),
        }
    return {"sides": sides, "ratios": ratios}


MIXED = ("off", "spans", "on", "capture")
"""This tree's modes, also measured together in one process (blocks interleaved), off first."""


def quartiles(values: Sequence[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "q1": q[0],
        "q3": q[2],
        "min": min(values),
        "max": max(values),
    }


def summarise_mixed(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The mixed children: per mode every block of every round; each mode's block against the off
    block of the same round and index (neighbours in time, same process)."""
    if not results:
        return {}
    med = statistics.median
    modes: dict[str, Any] = {}
    for mode in results[0]["modes"]:
        blocks = [b for r in results for b in r["modes"][mode]["blocks"]]
        off = [b for r in results for b in r["modes"]["off"]["blocks"]]
        paired = [b["cpu_ms_per_run"] / o["cpu_ms_per_run"] for b, o in zip(blocks, off, strict=True)]
        modes[mode] = {
            "cpu_ms": quartiles([b["cpu_ms_per_run"] for b in blocks]),
            "main_thread_cpu_ms": med(b["main_thread_cpu_ms_per_run"] for b in blocks),
            "main_thread_in_runs_cpu_ms": med(b["main_thread_in_runs_cpu_ms_per_run"] for b in blocks),
            "rest_cpu_ms": med(b["cpu_ms_per_run"] - b["main_thread_in_runs_cpu_ms_per_run"] for b in blocks),
            "other_threads_cpu_ms": med(b["other_threads_cpu_ms_per_run"] for b in blocks),
            "wall_ms_per_run": med(b["wall_ms_per_run"] for b in blocks),
            "blocks": len(blocks),
            "runs_per_block": blocks[0]["runs"],
            "paired_ratio_to_off": paired,
            "ratio_to_off": quartiles(paired),
            "pooled_ratio_to_off": sum(b["cpu_ms_per_run"] * b["runs"] for b in blocks)
            / sum(o["cpu_ms_per_run"] * o["runs"] for o in off),
            "spans_made": sum(r["modes"][mode]["spans_made"] for r in results),
        }
    return modes


def table(summary: dict[str, Any], rounds: int) -> str:
    sides, ratios = summary["sides"], summary["ratios"]
    lines = [
        "| side | CPU ms/run, median of rounds | rounds min-max | main thread in the runs / the rest | "
        "wall ms/run | spans/run (received, all rounds) |",
        "|---|---|---|---|---|---|",
    ]
    for side in SIDES:
        if side not in sides:
            continue
        s = sides[side]
        if side in TRACED:
            spans = f"{s['spans_per_run']:.0f} ({s['spans_received']:,} of {s['spans_made']:,})"
        elif side == "spans":
            spans = f"{s['spans_per_run']:.0f} made, none sent ({s['spans_received']})"
        else:
            spans = f"- ({s['spans_received']})"
        lines.append(
            f"| {side} ({DESCRIBED[side]}) | {s['cpu_ms']['median']:.2f} | "
            f"{s['cpu_ms']['min']:.2f}-{s['cpu_ms']['max']:.2f} | "
            f"{s['main_thread_in_runs_cpu_ms']:.2f} / {s['rest_cpu_ms']:.2f} | "
            f"{s['wall_ms_per_run']:.2f} | {spans} |"
        )
    lines += [
        "",
        "The rest: the other threads (the batch exporter's, the default executor's) and the closing "
        "force_flush, which exports what is left in the calling thread.",
        "",
        f"| ratio | of the medians | paired per round: median (min-max), {rounds} rounds | target |",
        "|---|---|---|---|",
    ]
    for name, r in ratios.items():
        p = r["paired_spread"]
        if name == "on/off":
            verdict = "**met**" if r["of_medians"] <= TARGET_RATIO else "**not met**"
            target = f"<= {TARGET_RATIO}x: {verdict}"
        elif name == "off/before":
            target = "indistinguishable: 1.00x " + (
                "within the rounds' spread"
                if p["min"] <= 1.0 <= p["max"]
                else "**outside** the rounds' spread"
            )
        else:
            target = "reported"
        paired = f"{p['median']:.3f}x ({p['min']:.3f}-{p['max']:.3f})"
        lines.append(f"| {name} | {r['of_medians']:.3f}x | {paired} | {target} |")
    mixed = summary.get("mixed")
    if mixed:
        any_mode = next(iter(mixed.values()))
        lines += [
            "",
            f"This tree's modes in one process, {any_mode['runs_per_block']}-run blocks interleaved "
            f"({any_mode['blocks']} blocks a mode over the rounds); each block against the off block "
            "of the same round and index:",
            "",
            "| mode | CPU ms/run, median of blocks (quartiles) | main thread in the runs / the rest | "
            "/ off: median of paired blocks (quartiles) | / off: pooled | target |",
            "|---|---|---|---|---|---|",
        ]
        for mode in MIXED:
            if mode not in mixed:
                continue
            m = mixed[mode]
            c, q = m["cpu_ms"], m["ratio_to_off"]
            target = "reported"
            if mode == "on":
                verdict = "**met**" if q["median"] <= TARGET_RATIO else "**not met**"
                target = f"<= {TARGET_RATIO}x: {verdict}"
            lines.append(
                f"| {mode} | {c['median']:.2f} ({c['q1']:.2f}-{c['q3']:.2f}) | "
                f"{m['main_thread_in_runs_cpu_ms']:.2f} / {m['rest_cpu_ms']:.2f} | "
                + (
                    "- | - | |"
                    if mode == "off"
                    else f"{q['median']:.3f}x ({q['q1']:.3f}-{q['q3']:.3f}) | "
                    f"{m['pooled_ratio_to_off']:.3f}x | {target} |"
                )
            )
    return "\n".join(lines)


def mixed_once(
    rec: Receiver, url: str, modes: Sequence[str], args: argparse.Namespace, r: int
) -> dict[str, Any]:
    """This tree's modes in one child, ``args.mixed_blocks`` blocks of ``args.block_runs`` each."""
    from bench.durable_common import log
    from bench.durable_cost import run_json

    cmd = [sys.executable, str(SCRIPT), "job", "--mode", *modes, "--url", url, "--endpoint", rec.endpoint]
    cmd += ["--blocks", str(args.mixed_blocks), "--runs", str(args.block_runs), "--warmup", str(args.warmup)]
    before = rec.count()["spans"]
    result = run_json(cmd, env=child_env(ROOT), cwd=ROOT, timeout_s=300)
    received = rec.count()["spans"] - before
    made = sum(m["spans_made"] for m in result["modes"].values())
    if not result["app_file"].startswith(str(ROOT) + os.sep):
        raise RuntimeError(f"mixed: imported {result['app_file']}, not this tree's app")
    if made and received == 0:
        raise RuntimeError(f"mixed: the receiver got no span ({made} made)")
    if received != made:
        log(f"WARNING mixed: {made} spans made, {received} received")
    result["spans_received"] = received
    result["round"] = r + 1
    figures = ", ".join(
        f"{mode} {statistics.median(b['cpu_ms_per_run'] for b in m['blocks']):.2f}"
        for mode, m in result["modes"].items()
    )
    log(
        f"round {r + 1} mixed (one process, ms CPU/run, median of blocks): {figures}; "
        f"{received} spans received"
    )
    return result


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from bench.durable_common import git, log, tree_state
    from bench.durable_cost import app_file, baseline_worktree, fake_llm, run_json

    started = time.monotonic()
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in args.sides}
    mixed_modes = [m for m in MIXED if m in args.sides]
    mixed: list[dict[str, Any]] = []
    order = [*args.sides, *(["mixed"] if args.mixed_blocks and len(mixed_modes) > 1 else [])]
    states: list[dict[str, Any]] = []
    loads: list[tuple[float, float, float]] = [os.getloadavg()]
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(baseline_worktree(args.baseline)) if "before" in args.sides else ""
        trees = {side: (base if side == "before" else str(ROOT)) for side in args.sides}
        for tree in set(trees.values()):
            found = app_file(tree)
            if not found.startswith(tree + os.sep):
                raise RuntimeError(f"app imported from {found}, expected under {tree}")
        url, _ = stack.enter_context(fake_llm(["--k", "5", "--tokens", "200", "--tool", "add"]))
        rec = stack.enter_context(receiver(args.max_seconds + 900))
        log(f"baseline {args.baseline} at {base}; fake LLM {url}; OTLP receiver {rec.endpoint}")
        for r in range(args.rounds):
            states.append(tree_state())  # the tree may change under a long run (others at work in it)
            k = r % len(order)
            for side in (*order[k:], *order[:k]):
                if side == "mixed":
                    mixed.append(mixed_once(rec, url, mixed_modes, args, r))
                    continue
                tree = trees[side]
                cmd = [sys.executable, str(SCRIPT), "job", "--mode", side, "--url", url]
                cmd += ["--runs", str(args.runs), "--warmup", str(args.warmup), "--endpoint", rec.endpoint]
                before = rec.count()["spans"]
                result = run_json(cmd, env=child_env(tree), cwd=tree, timeout_s=300)
                received = rec.count()["spans"] - before
                if not result["app_file"].startswith(tree + os.sep):
                    raise RuntimeError(f"{side}: imported {result['app_file']}, not {tree}'s app")
                if side in TRACED and received == 0:
                    raise RuntimeError(f"{side}: the receiver got no span ({result['spans_made']} made)")
                if side not in TRACED and received:
                    raise RuntimeError(f"{side}: the receiver got {received} spans with tracing off")
                if received != result["spans_made"]:
                    log(f"WARNING {side}: {result['spans_made']} spans made, {received} received")
                result["spans_received"] = received
                result["round"] = r + 1
                results[side].append(result)
                log(
                    f"round {r + 1} {side}: {result['cpu_ms_per_run']:.2f} ms CPU/run "
                    f"(main thread {result['main_thread_cpu_ms_per_run']:.2f}), "
                    f"wall {result['wall_ms_per_run']:.2f} ms/run, {received} spans received"
                )
            loads.append(os.getloadavg())
            if time.monotonic() - started > args.max_seconds:
                log(f"stopping after round {r + 1}: --max-seconds {args.max_seconds} reached")
                break
    rounds = len(states)
    summary = summarise(results)
    summary["mixed"] = summarise_mixed(mixed)
    end_state = tree_state()
    return {
        "scenario": "tracing cost",
        "target": TARGET,
        "baseline": {"commit": git("rev-parse", "--short", args.baseline)},
        "tree": {**states[0], "changed_during_run": any(s != states[0] for s in [*states, end_state])},
        "tree_states": states,
        "rounds": rounds,
        "runs_per_round": args.runs,
        "warmup": args.warmup,
        "results": results,
        "mixed_results": mixed,
        **summary,
        "table": table(summary, rounds),
        "load_average_per_round": loads,
        "seconds": time.monotonic() - started,
        "how": (
            "One invocation: a detached git worktree of the baseline in a temporary directory; each side "
            "a child process running this tree's bench/tracing_bench.py job by path, cwd and PYTHONPATH "
            "at its tree (app.__file__ checked); the OTLP receiver another child. Rounds interleaved, "
            "the order of the sides rotating; CPU = process_time (all threads) over the timed runs "
            "and a force_flush, per run; medians of the rounds. Mixed: this tree's modes in one more "
            "child each round, blocks of runs interleaved (each traced block flushed inside its window), "
            "each block's CPU against the off block next to it."
        ),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds of 40 runs, mixed 2 blocks of 20")
    parser.add_argument("--rounds", type=int, default=None, help="default 10 (--quick: 2)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs a side a round (default 200)")
    parser.add_argument("--warmup", type=int, default=None, help="default 20 (--quick: 5)")
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument(
        "--sides", nargs="+", choices=SIDES, default=list(DEFAULT_SIDES), help="spans: not by default"
    )
    parser.add_argument(
        "--mixed-blocks", type=int, default=None, help="blocks a mode in the mixed child (default 4; 0: none)"
    )
    parser.add_argument("--block-runs", type=int, default=None, help="runs a block (default 50)")
    parser.add_argument("--max-seconds", type=float, default=540, help="no new round after this long")
    parser.add_argument("--out", default=None, help="the JSON (default: bench/out/tracing.json)")
    sub = parser.add_subparsers(dest="command")
    j = sub.add_parser("job", help="(child) one side's runs, JSON on stdout")
    j.add_argument("--mode", choices=SIDES, nargs="+", required=True, help="several: block-interleaved")
    j.add_argument("--blocks", type=int, default=1, help="timed blocks of --runs per mode")
    j.add_argument("--url", required=True, help="the fake LLM's base URL")
    j.add_argument("--endpoint", default="", help="the OTLP receiver (on, capture)")
    j.add_argument("--runs", type=int, default=200)
    j.add_argument("--warmup", type=int, default=20)
    j.add_argument("--k", type=int, default=5)
    j.add_argument("--tokens", type=int, default=200)
    j.add_argument("--max-seconds", type=float, default=120.0)
    rcv = sub.add_parser("receiver", help="(child) the OTLP receiver, counts on request")
    rcv.add_argument("--seconds", type=float, default=1800.0)
    args = parser.parse_args(argv)
    # A child stops on SIGINT (what stop_group sends first) even if started with it ignored (from a
    # shell's background job, say), and the orchestrator cleans up on it as on SIGTERM.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.command == "job":
        # Run by path: bench/ itself heads sys.path; ``app`` and ``bench`` must come from PYTHONPATH.
        if sys.path and Path(sys.path[0] or ".").resolve() == SCRIPT.parent:
            sys.path.pop(0)
        print(json.dumps(asyncio.run(job(args))), flush=True)
        return
    if args.command == "receiver":
        serve_receiver(args.seconds)
        return
    args.rounds = args.rounds or (2 if args.quick else 10)
    args.runs = args.runs or (40 if args.quick else 200)
    args.mixed_blocks = args.mixed_blocks if args.mixed_blocks is not None else (2 if args.quick else 4)
    args.block_runs = args.block_runs or (20 if args.quick else 50)
    args.warmup = args.warmup if args.warmup is not None else (5 if args.quick else 20)

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # so that the finally blocks stop the children

    signal.signal(signal.SIGTERM, stop)
    result = bench(args)
    out = (
        Path(args.out)
        if args.out
        else Path(os.environ.get("BENCH_OUT", ROOT / "bench" / "out")) / "tracing.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(result["table"])
    changed = " (this tree's app/ changed during the run)" if result["tree"]["changed_during_run"] else ""
    print(
        f"\n{result['rounds']} rounds x {args.runs} runs, {result['seconds']:.0f} s; tree "
        f"{result['tree']['commit']} app diff {result['tree']['app_diff_sha1']}{changed}; JSON in {out}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
