"""Builds bench/RESULTS.md and bench/latency.png from bench/out/*.json (run by bench/run, peers venv).

Prints the summary table on stdout too. Historical before/after figures of the optimisations are
kept here as text: they were measured with these scripts before and after each change (see the
commit messages that carry them).

The "Durable runs" section is made by bench/report_durable.py, the "Capacity (issue 17)" one by
bench/report_capacity.py, the "Protocol faces (issue 26)" one by bench/report_faces.py; the helpers
(reading bench/out, formats, the plot) are in bench/report_common.py.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

if not __package__:  # run by path (bench/run: `bench/report.py`): the package from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_capacity import INSTRUCTION_SUBJECTS, capacity_section, capacity_targets
from bench.report_common import fmt, fold_summary, inproc, latency_row, load, machine, plot, verdict
from bench.report_durable import durable_section, durable_targets
from bench.report_faces import faces_section, faces_targets

HERE = Path(__file__).resolve().parent

OPTIMISATIONS = [
    (
        "OpenAICompatibleLLM sends messages/tools as `extra_body` (skips the SDK's per-call TypedDict walk)",
        "`engine_bench scaling`: in-process CPU of iteration 50 = 33.3 ms (7.2x iteration 1)",
        "2.6 ms (0.9x iteration 1); one 100-message `chat()` 30 ms -> 7 ms CPU",
    ),
    (
        "OpenAICompatibleLLM parses stream chunks with orjson off the wire (no pydantic chunk objects)",
        "`engine_bench job`: engine CPU 47.8 ms/run (~150 us CPU per streamed token)",
        "21.9 ms/run",
    ),
    (
        "SQLite: a process's write transactions take turns on a FIFO lock; reads stay concurrent",
        "200 concurrent runs on one worker: HTTP 500 `database is locked` on POST .../runs",
        "no errors; 2,000 streams on 100 quiet runs all open (20 s), pinged, 242 MB",
    ),
    (
        "Each bus entry names the event before it (`prev`): a new stream proves its continuity from "
        "Redis alone instead of waiting (up to 5 s) for the database to store the run's first event",
        "latency, first runs at 200 (start storm): p50 2,446 ms, p99 5,103 ms (full run of 2026-12-02 17:55)",
        "p50 13.3 ms, p99 168 ms (same scripts, the next change not yet made); the rest was CPU",
    ),
    (
        "The LLM client reads over aiohttp (httpx's interface, `httpx-aiohttp`, as "
        "`openai.DefaultAioHttpClient` does) with no connection cap, and parses non-streamed replies "
        "with orjson",
        "CPU per streamed token when each token is its own read: see `intake` below; httpx's pool "
        "capped upstream requests at 100, so at 200 concurrent runs half of them queued",
        "all 200 stream at once (a test holds 150 requests in flight)",
    ),
    (
        "Event saves of all a process's runs commit as one group; a run starts (run row, history, "
        "question) and finishes (messages, close) in one transaction each",
        "200 runs started within 1 s on SQLite: 668 event-save transactions, 600 for starts; POST "
        ".../runs p50 5.0 s",
        "21 event-save transactions, 200 for starts; POST .../runs p50 3.5 s (the rest is the "
        "start storm's CPU)",
    ),
    (
        "Start-up objects frozen out of the cycle collector (`gc.freeze()`) and its full passes "
        "a tenth as often (`gc.set_threshold(700, 10, 100)`)",
        "steady 200 runs: full collections every 2-3 s, 130-260 ms each, holding every stream; "
        "p99 152-240 ms (`LLM->pub` p99 130-216 ms)",
        "one full collection (100 ms) in the level; p99 24 ms (`LLM->pub` p99 9 ms)",
    ),
    (
        "SSE streams run in the request's own task with one watcher task (disconnect, pings while "
        "quiet, send timeout) and one shutdown poller per process, instead of sse-starlette's task "
        "group of four tasks per stream and a cancel scope per send; the stream reader keeps its "
        "`XREAD`'s keys and positions packed in RESP form between reads",
        "worker profile at 200 steady runs (2026-12-03, same scripts): 3,916 GIL samples, of them "
        "`redis_wire` 292, anyio 95, sse-starlette 43; three cancelled helper tasks and their "
        "tracebacks left as cyclic garbage by every finished stream",
        "3,265 samples; `redis_wire` 104, anyio 25, sse-starlette 0; a finished stream's watcher "
        "ends without an exception",
    ),
    (
        "The statements of a run's life (conversation, run start, the stream's reads, finish) are "
        "built once as Core statements on the tables, executed with parameters (no ORM unit of "
        "work, no per-call statement construction or cache key)",
        "`db_bench`, one run at a time: SQLite 18.9 ms CPU per run (user 15.1), PostgreSQL 15.7 "
        "(user 13.5); 50 at once on PostgreSQL 14.2",
        "SQLite 15.0 (user 8.9), PostgreSQL 11.5 (user 8.5); 50 at once on PostgreSQL 8.5 "
        "(the same script run on both commits, one after the other)",
    ),
    (
        "PostgreSQL: a pooled connection is pinged at checkout only when its socket has something "
        "to read (the server closing it), not on every checkout (`pool_pre_ping`)",
        "`db_bench` PostgreSQL, one run at a time: 10.6 ms CPU per run, seven pings per run",
        "7.8 ms; no ping unless the server spoke (a test counts them, another terminates the "
        "backends under the pool)",
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(HERE / "out"))
    parser.add_argument("--quick", default="0")
    parser.add_argument("--results", default=str(HERE / "RESULTS.md"), help="where to write the report")
    args = parser.parse_args()
    out = Path(args.out)
    subjects = inproc(out)
    raw = subjects.get("raw openai loop")
    raw2 = subjects.get("raw openai loop (two-phase)")
    eng = subjects.get("AgentStream engine")
    lg = subjects.get("LangGraph prebuilt ReAct")
    sdk = subjects.get("OpenAI Agents SDK")
    lgs = load(out, "langgraph_server.json")
    scaling = load(out, "scaling.json")
    http = load(out, "http.json")
    latency = load(out, "latency.json")
    follow = load(out, "latency_followups.json")
    storm = load(out, "latency_storm.json")
    on_pg = load(out, "latency_postgres.json")
    intake = load(out, "intake.json")
    dbw = load(out, "db.json")
    tput = load(out, "throughput.json")
    idle = load(out, "idle.json")
    redis_b = load(out, "redis_benchmark.json")
    d_cost = load(out, "durable_checkpoints.json")
    d_resume = load(out, "durable_resume.json")
    c_knee = load(out, "capacity_knee.json")
    c_burst = load(out, "capacity_burst.json")
    c_cluster = load(out, "capacity_cluster.json")
    c_instr = {key: load(out, f"capacity_instructions_{key}.json") for key in INSTRUCTION_SUBJECTS}
    faces = load(out, "faces.json")

    def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
        return a[key] / b[key] if a and b and b[key] else None

    r_raw = ratio(eng, raw, "cpu")
    r_raw2 = ratio(eng, raw2, "cpu")
    r_lg = ratio(eng, lg, "cpu")
    r_sdk = ratio(eng, sdk, "cpu")
    http_wall = http["wall_ms_p50"] if http else None
    r_http_raw = http_wall / raw["wall"] if http_wall and raw else None
    lgs_ok = lgs is not None and "wall_ms_p50" in lgs
    r_http_lgs = http_wall / lgs["wall_ms_p50"] if http_wall and lgs_ok else None
    bpt = http["stream_bytes_per_token"] if http else None
    sc_ratio = scaling["engine_cpu_ratio_last_first"] if scaling else None
    rows_sc = scaling["rows"] if scaling else []
    inproc_ratio = (
        (rows_sc[-1]["engine_cpu_ms"] + rows_sc[-1]["llm_client_cpu_ms"])
        / (rows_sc[0]["engine_cpu_ms"] + rows_sc[0]["llm_client_cpu_ms"])
        if rows_sc
        else None
    )
    top_level = latency["levels"][-1] if latency and latency.get("levels") else None
    top_follow = follow["levels"][-1] if follow and follow.get("levels") else None
    top_storm = storm["levels"][-1] if storm and storm.get("levels") else None
    top_pg = on_pg["levels"][-1] if on_pg and on_pg.get("levels") else None
    tps = tput["tokens_per_s"] if tput else None

    targets = [
        (
            "1",
            "engine CPU/run <= 1.3x raw loop (streamed)",
            fmt(r_raw, "x", 2),
            r_raw is not None and r_raw <= 1.3,
        ),
        (
            "1",
            "engine CPU/run <= 1.3x raw loop (two-phase)",
            fmt(r_raw2, "x", 2),
            r_raw2 is not None and r_raw2 <= 1.3,
        ),
        (
            "1",
            "engine CPU/run <= 0.5x LangGraph prebuilt",
            fmt(r_lg, "x", 2),
            r_lg is not None and r_lg <= 0.5,
        ),
        ("1", "engine CPU/run <= 0.5x Agents SDK", fmt(r_sdk, "x", 2), r_sdk is not None and r_sdk <= 0.5),
        (
            "2",
            "HTTP run wall <= 2x raw loop wall",
            fmt(r_http_raw, "x", 2),
            None if r_http_raw is None else r_http_raw <= 2,
        ),
        (
            "2",
            "HTTP run wall <= 0.1x LangGraph server",
            fmt(r_http_lgs, "x", 3),
            None if r_http_lgs is None else r_http_lgs <= 0.1,
        ),
        (
            "2",
            "<= 150 bytes on the wire per answer token",
            fmt(bpt, " B", 1),
            None if bpt is None else bpt <= 150,
        ),
        (
            "3",
            "iteration 50 engine time <= 2x iteration 1",
            fmt(sc_ratio, "x", 2),
            None if sc_ratio is None else sc_ratio <= 2,
        ),
        latency_row("delivery p50 < 5 ms, p99 < 25 ms at {n} runs (steady load, first runs)", top_level),
        latency_row("same, follow-up runs at {n} runs", top_follow),
        latency_row("same, first runs at {n} runs on PostgreSQL", top_pg),
        latency_row("start storm: {n} runs started within 1 s", top_storm, judged=False),
        (
            "5",
            ">= 50,000 answer tokens/s, 2 workers",
            fmt(tps, " tok/s", 0),
            None if tps is None else tps >= 50_000,
        ),
        (
            "6",
            f"{idle['connections'] if idle else '?'} SSE connections < 300 MB RSS",
            fmt(idle["rss_with_connections_mb"], " MB", 0) if idle else "n/a",
            None
            if not idle
            else idle["rss_with_connections_mb"] < 300 and idle["open_while_idle"] == idle["connections"],
        ),
        (
            "7",
            "POST .../runs -> first step event (p50 / p99)",
            f"{fmt(http['ttft_ms_p50'], ' ms')} / {fmt(http['ttft_ms_p99'], ' ms')}" if http else "n/a",
            None,
        ),
    ]

    targets += durable_targets(d_cost, d_resume)
    targets += capacity_targets(c_knee, c_burst, c_cluster, c_instr)
    targets += faces_targets(faces)

    table = ["| # | target | measured | |", "|---|---|---|---|"]
    table += [
        f"| {n} | {t} | {m} | {verdict(ok) if ok is not None else 'reported'} |" for n, t, m, ok in targets
    ]
    print("\n".join(table))

    md: list[str] = []
    md.append("# Benchmark results\n")
    mode = "quick (`bench/run --quick`)" if args.quick == "1" else "full (`bench/run`)"
    md.append(f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC by a {mode} run. {machine()}.\n")
    md.append("Versions:\n\n```\n" + (out / "project-versions.txt").read_text(errors="replace").strip())
    md.append(
        "\n# peers venv (bench/.venv-peers)\n"
        + (out / "peers-versions.txt").read_text(errors="replace").strip()
        + "\n```\n"
    )
    md.append("## Targets\n")
    md.extend(table)
    md.append("")

    md.append("## 1. Engine CPU per run, against the peers\n")
    md.append(
        "Same job for everyone, same fake LLM (another process, pre-encoded replies): 5 sequential `add` "
        "tool calls, then a 200-token streamed answer; sequential runs, stock asyncio, CPU = "
        "`time.process_time()` of the subject's process. Median over interleaved rounds. The engine runs "
        "with `completion_check=False` (the peers have no completion checklist); it still makes one call "
        "more than the streamed raw loop (two-phase: the loop's final answer, then the synthesis stream). "
        "The two-phase raw loop makes exactly the engine's HTTP calls.\n"
    )
    md.append("| subject | CPU ms/run | wall ms/run (p50) | engine CPU ratio | rounds x runs |")
    md.append("|---|---|---|---|---|")
    for name, s in subjects.items():
        r = eng["cpu"] / s["cpu"] if eng and s is not eng else None
        md.append(
            f"| {name} | {fmt(s['cpu'])} | {fmt(s['wall'])} | {fmt(r, 'x', 2) if r else '-'} | "
            f"{s['rounds']} x {s['runs'] // max(1, s['rounds'])} |"
        )
    md.append("")
    md.append(
        "Engine profile (py-spy, the `job` benchmark):\n\n```\n"
        + fold_summary(out / "engine.folded")
        + "\n```\n"
    )

    md.append("## 2. A run through the HTTP API, and 7. time to first event\n")
    if http:
        md.append(
            f"One uvicorn worker, Redis Streams, {http['database']}. Per run: POST /api/conversations, "
            "POST .../runs, GET .../stream read to `done`; the answer is checked against the fake LLM's, "
            "and GET /api/runs/{id}/events must return exactly the streamed events "
            f"({http['persisted_ok']}/{http['persisted_checked']} did). {http['runs']} sequential runs.\n"
        )
        md.append("| measure | value |\n|---|---|")
        md.append(
            f"| wall per run p50 / mean / p99 | {fmt(http['wall_ms_p50'])} / "
            f"{fmt(http['wall_ms_mean'])} / {fmt(http['wall_ms_p99'])} ms |"
        )
        md.append(f"| raw loop wall per run (p50) | {fmt(raw['wall'] if raw else None)} ms |")
        md.append(
            "| LangGraph API server wall per run (p50) | "
            f"{fmt(lgs['wall_ms_p50']) + ' ms' if lgs_ok else lgs.get('error') if lgs else 'n/a'} |"
        )
        md.append(f"| SSE bytes per answer token (headers included, coalescing counts) | {fmt(bpt)} |")
        md.append(
            "| all HTTP bytes per answer token (both POSTs, the events check, the stream) | "
            f"{fmt(http['all_bytes_per_token'])} |"
        )
        if lgs_ok:
            md.append(
                f"| LangGraph API server SSE bytes per answer token | {fmt(lgs['stream_bytes_per_token'])} |"
            )
        md.append(
            f"| POST .../runs -> first `step` event, p50 / p99 | {fmt(http['ttft_ms_p50'])} / "
            f"{fmt(http['ttft_ms_p99'])} ms |"
        )
        md.append("")

    md.append("## 3. Cost of an iteration over a 50-iteration run\n")
    if scaling:
        md.append(
            "50 tool calls (the max-iterations fallback ends the loop), then synthesis; "
            f"{scaling['repeats']} "
            "runs, median per iteration. Engine CPU = the process's CPU during the iteration minus the CPU "
            "spent inside the LLM client call; the LLM client's CPU (building the request from the whole "
            "history, parsing the reply) is shown apart.\n"
        )
        md.append("| iteration | engine CPU ms | LLM client CPU ms | wall ms |\n|---|---|---|---|")
        for row in rows_sc:
            if row["iteration"] in (1, 2, 10, 25, 40, 49, 50):
                md.append(
                    f"| {row['iteration']} | {fmt(row['engine_cpu_ms'], '', 3)} | "
                    f"{fmt(row['llm_client_cpu_ms'], '', 2)} | {fmt(row['wall_ms'], '', 2)} |"
                )
        md.append(
            f"\nRatio iteration 50 / iteration 1: engine CPU {fmt(sc_ratio, 'x', 2)}, engine + LLM client "
            f"CPU {fmt(inproc_ratio, 'x', 2)}, wall {fmt(scaling['wall_ratio_last_first'], 'x', 2)}.\n"
        )

    md.append("## 4. Delivery latency under concurrency\n")
    if latency:
        md.append(
            f"One worker, Redis Streams, {latency['database']}. The fake LLM sends answer tokens "
            f"{fmt(latency['token_interval_ms'], ' ms', 0)} apart, each stamped with `time.time()` "
            "taken right "
            "before the write; the SSE client (another process, same clock) subtracts the stamp from "
            "the time "
            "the bytes arrived. The stamp is when the engine could first have the token, so the figure "
            "includes the engine's HTTP read of it. Tokens sent before the client's stream was open are "
            "replays, not deliveries, and are counted apart. No app change was needed.\n"
        )
        md.append(
            "Steady load (the target): the users arrive spread over one run's length and each does an "
            "untimed run before and after the timed one, so the timed runs stream while the others' "
            "runs start and end at the rate a steady load of that many runs has. Two series: the first "
            "run of a new conversation (its stream is new on the bus), and a follow-up run in a "
            "conversation that already had one. A third, the start storm, has every user arrive within "
            "the first second (at 200, 400 requests and 200 tool loops in one second) and times every "
            "run: what a burst costs the streams already flowing. `LLM->pub` and `pub->client` split "
            "each latency at the publish time carried in the event's id (ms resolution). `machine busy / "
            "stolen`: all cores of the machine during the level, from /proc/stat; stolen is time the "
            "hypervisor gave to other guests, which slows the worker as well and varies by the hour.\n"
        )
        if on_pg and on_pg.get("levels"):
            md.append(
                "The PostgreSQL series is the first-run steady load again with the worker on "
                f"{on_pg['database']} (the database of the multi-worker setup; asyncpg runs on the "
                "worker's event-loop thread, where aiosqlite has a thread of its own).\n"
            )
        elif on_pg:
            md.append(f"PostgreSQL series: {on_pg.get('error', 'no levels')}.\n")
        md.append(
            "| series | runs | tokens timed | replayed | missing | tok/s | p50 ms | p90 ms | p99 ms | max ms "
            "| LLM->pub p99 | pub->client p99 | worker CPU | worker RSS MB | machine busy / stolen |"
        )
        md.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        rows_lat = [("first run", lv) for lv in latency["levels"]]
        rows_lat += [("follow-up", lv) for lv in (follow or {}).get("levels", [])]
        rows_lat += [("first run, PostgreSQL", lv) for lv in (on_pg or {}).get("levels", [])]
        rows_lat += [("first run, start storm", lv) for lv in (storm or {}).get("levels", [])]
        for series, lv in rows_lat:
            md.append(
                f"| {series} | {lv['concurrency']} | {lv['tokens']} | "
                f"{lv.get('tokens_sent_before_client_connected', 0)} | "
                f"{lv['tokens_missing']} | {fmt(lv['tokens_per_s'], '', 0)} | {fmt(lv['p50_ms'], '', 2)} | "
                f"{fmt(lv['p90_ms'], '', 2)} | {fmt(lv['p99_ms'], '', 1)} | {fmt(lv['max_ms'], '', 0)} | "
                f"{fmt(lv.get('llm_to_publish_p99_ms'), '', 1)} | "
                f"{fmt(lv.get('publish_to_client_p99_ms'), '', 1)} | "
                f"{fmt(lv['worker_cpu_pct'], '%', 0)} | {fmt(lv['worker_rss_mb'], '', 0)} | "
                f"{fmt(lv.get('machine_busy_pct'), '%', 0)} / {fmt(lv.get('machine_steal_pct'), '%', 0)} |"
            )
        if plot(latency, HERE / "latency.png", follow):
            md.append("\n![latency percentiles against concurrency](latency.png)\n")

    md.append("## 5. Throughput across two workers\n")
    if tput:
        md.append(
            f"Two uvicorn workers sharing Redis and {tput['database']}; {tput['concurrency']} clients, each "
            "starting a run on one worker and streaming it from the other (so every token crosses Redis); "
            f"{tput['tokens_per_run']}-token answers served as fast as the fake LLM can. Every run's deltas "
            f"must concatenate to exactly the fake LLM's answer and to `done.answer`: {tput['runs']} runs, "
            f"{tput['runs_wrong']} wrong, {tput['tokens_delivered']:,} tokens in "
            f"{fmt(tput['seconds'], ' s')}: "
            f"**{fmt(tps, ' tokens/s', 0)}**; worker CPU "
            f"{', '.join(fmt(c, '%', 0) for c in tput['worker_cpu_pct'])}, "
            f"{fmt(tput.get('worker_cpu_us_per_token'), ' us', 1)} of worker CPU per token (both workers).\n"
        )
    if redis_b:
        md.append(
            f"`redis-benchmark` XADD on the same machine ({redis_b['requests']:,} requests, "
            f"{redis_b['clients']} clients): plain `{redis_b['plain'].strip()}`, pipelined 16 "
            f"`{redis_b['pipelined_16'].strip()}`.\n"
        )

    md.append("## 6. Idle connections and memory\n")
    if idle:
        md.append(
            f"One worker, {idle['active_runs']} runs held quiet (their first LLM call is held by the "
            "fake LLM), "
            f"{idle['connections']} SSE connections spread over them, "
            f"`SSE_PING_SECONDS={idle['ping_s']:g}`.\n"
        )
        md.append("| measure | value |\n|---|---|")
        md.append(f"| RSS, worker warmed up and idle | {fmt(idle['rss_idle_mb'])} MB |")
        md.append(
            f"| RSS with {idle['active_runs']} active runs | {fmt(idle['rss_with_runs_mb'])} MB "
            f"({fmt(idle['rss_per_active_run_kb'], ' KB', 0)} per run) |"
        )
        md.append(
            f"| RSS with {idle['connections']} connections open | "
            f"{fmt(idle['rss_with_connections_mb'])} MB "
            f"({fmt(idle['rss_per_connection_kb'], ' KB', 0)} per connection) |"
        )
        md.append(
            f"| connections open while idle / got a ping in the window | {idle['open_while_idle']} / "
            f"{idle['connections_pinged']} |"
        )
        md.append(
            f"| seconds until all {idle['connections']} streams answered | "
            f"{fmt(idle['seconds_to_open_all'])} |"
        )
        md.append(
            "| worker CPU while idle (pings, Redis readers) | "
            f"{fmt(idle['worker_cpu_pct_while_idle'], '%', 0)} |"
        )
        md.append(f"| `done` received after release | {idle['done_received']} |")
        md.append("")

    md.extend(durable_section(d_cost, d_resume))
    md.extend(capacity_section(c_knee, c_burst, c_cluster, c_instr))
    md.extend(faces_section(faces))

    md.append("## Optimisations made for these targets\n")
    md.append("| change | before | after |\n|---|---|---|")
    md.extend(f"| {a} | {b} | {c} |" for a, b, c in OPTIMISATIONS)
    md.append("")
    if intake:
        md.append(
            f"`intake` (this run): {intake['streams']} concurrent streams, each token its own network "
            "read, through `OpenAICompatibleLLM.stream_chat`; CPU per token:\n"
        )
        md.append("| transport | CPU us per token |\n|---|---|")
        md.extend(f"| {name} | {fmt(us, '', 1)} |" for name, us in intake["cpu_us_per_token"].items())
        md.append("")

    if dbw and dbw.get("rows"):
        md.append(
            "`db_bench` (this run): the database work of one run's life through the repositories, "
            "in-process (the process's CPU, the driver's threads included):\n"
        )
        md.append("| database | runs at once | CPU ms per run (user + system) | wall ms per run |")
        md.append("|---|---|---|---|")
        md.extend(
            f"| {row['database']} | {row['concurrency']} | {fmt(row['cpu_ms_per_run'], '', 2)} "
            f"({fmt(row['user_ms_per_run'], '', 2)} + {fmt(row['system_ms_per_run'], '', 2)}) | "
            f"{fmt(row['wall_ms_per_run'], '', 2)} |"
            for row in dbw["rows"]
        )
        md.append("")
    elif dbw:
        md.append(f"`db_bench` did not run: {dbw.get('error')}\n")

    notes = (HERE / "NOTES.md").read_text() if (HERE / "NOTES.md").exists() else ""
    if notes:
        md.append(notes.strip() + "\n")
    md.append(
        "Worker profile at 200 steady runs (py-spy `--gil --nonblocking`, the worker's whole life in "
        "a latency run of its own, so that sampling does not weigh on the figures above):\n\n```\n"
        + fold_summary(out / "worker-latency.folded", top=20)
        + "\n```\n"
    )
    md.append(
        "Worker 0's profile during the throughput test (py-spy `--gil`):\n\n```\n"
        + fold_summary(out / "worker-throughput.folded", top=20)
        + "\n```\n"
    )
    md.append("## Commands\n")
    md.append(
        "```\nbench/run            # everything, ~15 min\nbench/run --quick    # fewer runs and levels\n"
        "bash bench/peers/setup.sh\n.venv/bin/python -m bench.fakellm --k 5 --tokens 200\n"
        ".venv/bin/python -m bench.engine_bench job --url URL\n"
        ".venv/bin/python -m bench.engine_bench scaling --url URL_OF_A_K50_FAKE\n"
        "bench/.venv-peers/bin/python -m bench.peers.raw_loop --url URL [--style two-phase]\n"
        "bench/.venv-peers/bin/python -m bench.peers.langgraph_prebuilt --url URL\n"
        "bench/.venv-peers/bin/python -m bench.peers.agents_sdk --url URL\n"
        "bench/.venv-peers/bin/python -m bench.peers.langgraph_server --url URL\n"
        ".venv/bin/python -m bench.service_bench http|latency|throughput|idle [--db postgres]\n"
        ".venv/bin/python -m bench.durable_bench checkpoints [--quick]   # baseline eaaa192 vs this tree\n"
        ".venv/bin/python -m bench.durable_bench resume [--quick]\n"
        ".venv/bin/python -m bench.capacity_bench knee|burst|cluster-throughput [--quick] [--out FILE]\n"
        ".venv/bin/python -m bench.faces_bench [--quick] [--db postgres]   # faces against the own stream\n"
        ".venv/bin/python -m bench.tracing_bench [--quick] [--sides before off on capture spans]"
        "   # baseline 43354e2 vs this tree\n```\n"
    )
    Path(args.results).write_text("\n".join(md))


if __name__ == "__main__":
    main()
