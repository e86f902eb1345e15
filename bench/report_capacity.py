"""The "Capacity (issues 17, 29)" part of bench/RESULTS.md: its rows of the target table and its
section, from ``capacity_bench knee`` (with the floor, issue 29), ``burst`` and
``cluster-throughput`` (bench/out/capacity_knee.json, capacity_burst.json and
capacity_cluster.json), and ``bench/instructions.py --split`` of the floor and of a worker
(capacity_instructions_<subject>.json). Used by bench/report.py.

Every figure is read with ``.get``: a ``--quick`` run, a subject that did not run (``not_run``) or a
file that says ``error`` gives "n/a" or the reason, never an exception.
"""

from __future__ import annotations

from bench.report_common import fmt, verdict

Row = tuple[str, str, str, bool | None]

KNEE_RATIO = 0.8
"""Issue 29: one worker's knee at least this share of the floor's (the bare relay's)."""
CPU_RATIO = 2.0
"""Issue 29: one worker's CPU per streamed token at most this multiple of the floor's."""
START_P99_MS = 250.0
"""Issue 29: POST -> first token p99 at the knee under this."""
DATABASES = {"one": "SQLite", "one-pg": "PostgreSQL"}
BURST = (
    "burst: 2,000 POSTs in 1 s, MAX_ACTIVE_RUNS=200: all 202 or 429, none lost, every accepted run completes"
)


def _failed(data: dict | None, name: str) -> str | None:
    """Why ``data`` (capacity_<name>.json) holds no figures, or None when it does."""
    if data is None:
        return f"did not run (no bench/out/capacity_{name}.json)"
    if data.get("error"):
        return str(data["error"])
    return None


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _subject(knee: dict, which: str) -> dict | None:
    """The knee subject ``floor``, ``one``, ``one-pg``, ``two`` or ``langgraph`` of a knee result."""
    for s in knee.get("subjects") or []:
        if s.get("key") == which:
            return s
        if "key" not in s:  # a result of before issue 29
            if which == "langgraph" and "LangGraph" in str(s.get("subject", "")):
                return s
            if which in ("one", "two") and s.get("workers") == {"one": 1, "two": 2}[which]:
                return s
    return None


def _at_knee(subject: dict | None) -> dict:
    """The level row at the subject's knee ({} when there is none)."""
    if not subject or subject.get("knee") is None:
        return {}
    return next((r for r in subject.get("levels") or [] if r.get("users") == subject["knee"]), {})


def _floor_rows(knee: dict) -> list[Row]:
    """Issue 29's rows: the floor, each one-worker knee and CPU per token against it, the start."""
    floor = _subject(knee, "floor")
    text = _knee_measured(floor)[0]
    rows: list[Row] = [("C", "floor: the knee of a bare relay (bench/peers/bare_relay.py)", text, None)]
    compared = knee.get("floor") or {}
    for key, db in DATABASES.items():
        subject = _subject(knee, key)
        got = compared.get(key) or {}
        ratio = got.get("knee_ratio")
        one_text = _knee_measured(subject)[0]
        rows.append(
            (
                "C",
                f"knee: one worker ({db}) >= {KNEE_RATIO} x the floor's",
                f"{fmt(ratio, 'x', 2)} ({one_text} / {text})" if ratio is not None else f"n/a ({one_text})",
                (ratio >= KNEE_RATIO) if ratio is not None else None,
            )
        )
        cpu = got.get("cpu_per_token") or {}
        cpu_ratio = cpu.get("cpu_per_token_ratio")
        rows.append(
            (
                "C",
                f"worker CPU per streamed token ({db}) <= {CPU_RATIO:g} x the floor's, at one level",
                f"{fmt(cpu_ratio, 'x', 2)} ({fmt(cpu.get('worker_cpu_us_per_token'), ' µs', 0)} / "
                f"{fmt(cpu.get('floor_cpu_us_per_token'), ' µs', 0)} at {cpu.get('users')} users)"
                if cpu_ratio is not None
                else "n/a (no level both met)",
                (cpu_ratio <= CPU_RATIO) if cpu_ratio is not None else None,
            )
        )
        start = _at_knee(subject).get("start_to_first_token_ms_p99")
        rows.append(
            (
                "C",
                f"POST -> first token p99 at the knee ({db}) < {START_P99_MS:g} ms",
                f"{fmt(start, ' ms', 0)} at {subject.get('knee') if subject else '?'} users"
                if start is not None
                else "n/a (no knee)",
                (start < START_P99_MS) if start is not None else None,
            )
        )
    guarded = compared.get("guarded")
    if guarded is not None:
        # What the guarantees cost at the least: the line under which no keeper of them can go.
        cpu = guarded.get("cpu_per_token") or {}
        rows.append(
            (
                "C",
                "knee: the guarded floor (bench/peers/guarded_relay.py) / the floor's; CPU per token",
                f"{fmt(guarded.get('knee_ratio'), 'x', 2)} ({_knee_measured(_subject(knee, 'guarded'))[0]}); "
                f"{fmt(cpu.get('cpu_per_token_ratio'), 'x', 2)} at {cpu.get('users', 'n/a')} users",
                None,
            )
        )
    two = compared.get("two") or {}
    rows.append(
        (
            "C",
            "knee: two workers (SQLite) / the floor's one process",
            f"{fmt(two.get('knee_ratio'), 'x', 2)} ({_knee_measured(_subject(knee, 'two'))[0]})",
            None,
        )
    )
    return rows


INSTRUCTION_SUBJECTS = {
    "floor": "the floor (the bare relay)",
    "guarded": "the floor with the guarantees kept (bench/peers/guarded_relay.py: Redis and SQLite)",
    "one": "AgentStream, 1 worker, SQLite",
    "ablated": "AgentStream, no event store, no Redis (`--ablate store,redis`: a difference, not a result)",
}
"""bench/out/capacity_instructions_<key>.json: ``bench/instructions.py --split`` of each subject."""


def _per_token_at(result: dict | None, tokens: int) -> float | None:
    """Instructions per token of runs of ``tokens`` tokens, from a ``--split`` result."""
    if not result or result.get("error"):
        return None
    marginal, fixed = result.get("instructions_per_token_marginal"), result.get("instructions_per_run_fixed")
    if marginal is None or fixed is None:
        return None
    return float(marginal) + float(fixed) / tokens


def _run_length(knee: dict | None) -> int:
    return int((knee or {}).get("tokens_per_run") or 500)


def _instructions_row(knee: dict | None, instructions: dict[str, dict | None]) -> Row:
    tokens = _run_length(knee)
    one, floor = (_per_token_at(instructions.get(k), tokens) for k in ("one", "floor"))
    text = (
        f"{fmt(one / floor, 'x', 2)} ({fmt(one / 1000, ' k', 0)} / {fmt(floor / 1000, ' k', 0)})"
        if one is not None and floor
        else "n/a (bench/out/capacity_instructions_*.json missing or failed)"
    )
    target = f"worker instructions per streamed token (SQLite) / the floor's, {tokens}-token runs (callgrind)"
    return ("C", target, text, None)


def _instructions_part(knee: dict | None, instructions: dict[str, dict | None]) -> list[str]:
    """The instruction counts against the floor: the knee's CPU ratio without the machine's noise."""
    tokens = _run_length(knee)
    floor = _per_token_at(instructions.get("floor"), tokens)
    md = [
        "Instructions against the floor (`bench/instructions.py --tokens 100 --split 400 --concurrency 8 "
        "--delay-s 0.05`, each subject under callgrind: 8 runs at two lengths, split into a run's fixed "
        f"count and each token's marginal one; per token at the knee's {tokens}-token runs = marginal + "
        f"fixed / {tokens}).\n",
        f"| subject | per token, marginal | per run, fixed | per token, {tokens}-token runs | / floor's |",
        "|---|---|---|---|---|",
    ]
    for key, name in INSTRUCTION_SUBJECTS.items():
        got = instructions.get(key)
        at = _per_token_at(got, tokens)
        if at is None:
            reason = (got or {}).get("error") or "did not run"
            md.append(f"| {name} | n/a ({reason}) | | | |")
            continue
        assert got is not None
        md.append(
            f"| {name} | {fmt(got['instructions_per_token_marginal'] / 1000, ' k', 1)} | "
            f"{fmt(got['instructions_per_run_fixed'] / 1e6, ' M', 1)} | {fmt(at / 1000, ' k', 1)} | "
            f"{fmt(at / floor, 'x', 2) if floor else 'n/a'} |"
        )
    one, guarded = (_per_token_at(instructions.get(k), tokens) for k in ("one", "guarded"))
    if one is not None and guarded:
        md.append(
            f"\nOne worker against the floor with the guarantees kept: {fmt(one / guarded, 'x', 2)} "
            "(what AgentStream spends beyond keeping them at their cheapest; the guarded floor against "
            "the bare one is what keeping them costs at the least).\n"
        )
    md.append("")
    return md


def _first_missed(subject: dict) -> int | None:
    levels = sorted(subject.get("levels") or [], key=lambda r: r.get("users", 0))
    return next((r.get("users") for r in levels if not r.get("ok")), None)


def _knee_measured(subject: dict | None) -> tuple[str, int | None, bool]:
    """(text, knee, measured?) for a subject's row."""
    if subject is None:
        return "not in capacity_knee.json", None, False
    if subject.get("not_run"):
        return f"not run: {subject['not_run']}", None, False
    if not subject.get("levels"):
        return "no levels", None, False
    knee = subject.get("knee")
    missed = _first_missed(subject)
    text = f"{knee:,} runs" if knee is not None else "no level met"
    text += f" (first missed level: {missed:,})" if missed is not None else " (no level missed)"
    return text, knee, True


def capacity_targets(
    knee: dict | None,
    burst: dict | None,
    cluster: dict | None,
    instructions: dict[str, dict | None] | None = None,
) -> list[Row]:
    """The capacity rows of the target table (``bench/capacity_bench.py``)."""
    rows: list[Row] = []
    why = _failed(knee, "knee")
    if why or knee is None:
        rows.append(("C", "knee", why or "", None))
    else:
        rows.extend(_floor_rows(knee))
        one = _subject(knee, "one")
        one = one.get("knee") if one else None
        ratio = knee.get("ratio_agentstream_one_worker_to_langgraph")
        lg = _subject(knee, "langgraph")
        lg_knee = lg.get("knee") if lg else None
        text = (
            f"{fmt(ratio, 'x', 1)} ({one:,} / {lg_knee:,})"
            if ratio is not None and one is not None and lg_knee is not None
            else f"n/a (LangGraph: {_knee_measured(lg)[0]})"
        )
        rows.append(("C", "knee: one worker / LangGraph API server", text, None))
    if instructions:
        rows.append(_instructions_row(knee, instructions))
    why = _failed(burst, "burst")
    if why or burst is None:
        rows.append(("C", "burst", why or "", None))
    else:
        answers = ", ".join(f"{n:,} x {kind}" for kind, n in (burst.get("answers") or {}).items())
        lost = burst.get("lost_or_wrong") or {}
        text = (
            f"{burst.get('posts', 0):,} POSTs in {fmt(burst.get('send_span_s'), ' s', 2)}, "
            f"MAX_ACTIVE_RUNS={(burst.get('env') or {}).get('MAX_ACTIVE_RUNS', '?')}: "
            f"{answers or 'no answers'}; "
            f"{burst.get('accepted_completed', 0):,} of {burst.get('accepted', 0):,} accepted completed; "
            f"lost or wrong: {', '.join(f'{k} {v}' for k, v in lost.items()) or 'none'}"
        )
        rows.append(("C", BURST, text, burst.get("all_good")))
        rows.append(
            (
                "C",
                "burst: time in the queue p50 / p99",
                f"{fmt(_seconds(burst.get('queue_ms_queued_runs_p50')), ' s', 1)} / "
                f"{fmt(_seconds(burst.get('queue_ms_queued_runs_p99')), ' s', 1)} (queued runs)",
                None,
            )
        )
    why = _failed(cluster, "cluster")
    name = "cluster / one Redis node, tokens/s (2 workers)"
    if why or cluster is None:
        rows.append(("C", name, why or "", None))
    elif cluster.get("ratio_cluster_to_node") is None:
        rows.append(("C", name, f"n/a: {cluster.get('not_run') or 'no round ran on both'}", None))
    else:
        n = len(cluster.get("rounds") or [])
        rows.append(
            (
                "C",
                name,
                f"{fmt(cluster['ratio_cluster_to_node'], 'x', 2)} (median of {n} round{'s' * (n != 1)})",
                None,
            )
        )
    return rows


def _cpu_columns(levels: list[dict]) -> list[str]:
    """The ``*_cpu_pct`` keys of the levels, in the order they first appear."""
    keys: list[str] = []
    for row in levels:
        keys += [k for k in row if k.endswith("_cpu_pct") and k not in keys]
    return keys


def _problems(row: dict) -> str:
    problems = row.get("problems") or {}
    return ", ".join(f"{k} {v}" for k, v in problems.items())


def _knee_table(subject: dict) -> list[str]:
    levels = sorted(subject.get("levels") or [], key=lambda r: r.get("users", 0))
    cpu = _cpu_columns(levels)
    head = (
        "| users | p50 / p99 / max ms | tokens/s received / offered | streaming runs | "
        "POST -> first token p50 / p99 ms | worker µs per token | runs good / started | "
        + "".join(f"{k[: -len('_cpu_pct')].replace('_', ' ')} CPU | " for k in cpu)
        + "machine busy | |"
    )
    md = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in levels:
        problems = _problems(row)
        met = "met" if row.get("ok") else "**missed**"
        md.append(
            f"| {row.get('users', '?')} | "
            f"{fmt(row.get('p50_ms'), '', 1)} / {fmt(row.get('p99_ms'), '', 1)} / "
            f"{fmt(row.get('max_ms'), '', 1)} | {fmt(row.get('tokens_per_s'), '', 0)} / "
            f"{fmt(row.get('tokens_per_s_offered'), '', 0)} | {fmt(row.get('streaming_runs_mean'), '', 1)} | "
            f"{fmt(row.get('start_to_first_token_ms_p50'), '', 0)} / "
            f"{fmt(row.get('start_to_first_token_ms_p99'), '', 0)} | "
            f"{fmt(row.get('worker_cpu_us_per_token'), '', 0)} | "
            f"{row.get('runs_good', '?')} / {row.get('runs_started', '?')} | "
            + "".join(f"{fmt(row.get(k), '%', 0)} | " for k in cpu)
            + f"{fmt(row.get('machine_busy_pct'), '%', 0)} | {met}{f' ({problems})' if problems else ''} |"
        )
    return md


def _knee_part(knee: dict | None) -> list[str]:
    md = ["### The knee: streaming runs held at 50 tokens/s\n"]
    why = _failed(knee, "knee")
    if why or knee is None:
        return [*md, f"Did not run: {why}\n"]
    calls = knee.get("tool_calls_per_run", "?")
    md.append(
        f"Met: {knee.get('target', '?')}. Runs of {knee.get('tokens_per_run', '?')} answer tokens "
        f"{fmt(knee.get('token_interval_ms'), ' ms', 0)} apart after {calls} "
        f"tool call{'' if calls == 1 else 's'}; a level's figures cover its "
        f"{fmt(knee.get('window_s'), ' s', 0)} window. The knee is "
        "the largest met level with every lower level met. CPU columns: % of one core over the window.\n"
    )
    for subject in knee.get("subjects") or []:
        head = f"**{subject.get('subject', '?')}**"
        if subject.get("not_run"):
            md.append(f"{head}: not run: {subject['not_run']}\n")
            continue
        details = [subject["database"]] if subject.get("database") else []
        details += [f"pinning: {subject['pinning']}"] if subject.get("pinning") else []
        env = subject.get("env") or {}
        details += [f"`{k}={v}`" for k, v in env.items() if k in ("MAX_ACTIVE_RUNS", "STREAM_LINGER_MS")]
        if subject.get("jobs_per_worker"):
            details.append(f"`--n-jobs-per-worker {subject['jobs_per_worker']}`")
        md.append(head + (": " + "; ".join(details) if details else "") + ".\n")
        md.extend(_knee_table(subject))
        k = subject.get("knee")
        md.append(f"\nKnee: **{k:,}** runs.\n" if k is not None else "\nKnee: no level met.\n")
    md.extend(_floor_part(knee))
    one = _subject(knee, "one")
    lg = _subject(knee, "langgraph")
    ratio = knee.get("ratio_agentstream_one_worker_to_langgraph")
    if ratio is not None and one and lg:
        md.append(
            f"One AgentStream worker / the LangGraph API server, in the same invocation: "
            f"**{fmt(ratio, 'x', 1)}** ({one.get('knee')} / {lg.get('knee')}).\n"
        )
    else:
        md.append("One AgentStream worker / the LangGraph API server: n/a (a knee is missing).\n")
    return md


def _floor_part(knee: dict) -> list[str]:
    """Each other subject (AgentStream's, the guarded floor) against the floor (the bare relay),
    measured in the same invocation."""
    compared = knee.get("floor") or {}
    if not compared:
        return ["Against the floor: n/a (the floor did not run in this invocation).\n"]
    md = [
        "Against the floor (the bare relay, same invocation): the knee's ratio, and worker CPU per "
        "streamed token at the highest level both met (same users: the same tokens and starts a second).\n",
        "| subject | knee / floor's | at users | worker µs per token | floor's | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for key, got in compared.items():
        subject = _subject(knee, key) or {}
        cpu = got.get("cpu_per_token") or {}
        md.append(
            f"| {subject.get('subject', key)} | {fmt(got.get('knee_ratio'), 'x', 2)} "
            f"({got.get('knee')} / {got.get('floor_knee')}) | {cpu.get('users', 'n/a')} | "
            f"{fmt(cpu.get('worker_cpu_us_per_token'), '', 0)} | "
            f"{fmt(cpu.get('floor_cpu_us_per_token'), '', 0)} | "
            f"{fmt(cpu.get('cpu_per_token_ratio'), 'x', 2)} |"
        )
    md.append("")
    return md


def _burst_part(burst: dict | None) -> list[str]:
    md = ["### A burst of starts\n"]
    why = _failed(burst, "burst")
    if why or burst is None:
        return [*md, f"Did not run: {why}\n"]
    env = burst.get("env") or {}
    md.append(
        f"{burst.get('workers', '?')} workers, {burst.get('database', '?')}; "
        + ", ".join(f"`{k}={v}`" for k, v in env.items())
        + f". {burst.get('posts', 0):,} POSTs sent within {fmt(burst.get('send_span_s'), ' s', 3)} "
        f"(aimed at {fmt(burst.get('sent_within_s'), ' s', 1)}). Time in the queue: "
        f"{burst.get('queue_time_from', 'see bench/README.md')}.\n"
    )
    lost = burst.get("lost_or_wrong") or {}
    peak = burst.get("peak_seen") or {}
    active = peak.get("active_runs")
    active_text = " + ".join(str(a) for a in active) if isinstance(active, list) else fmt(active, "", 0)
    cpu_s = burst.get("worker_cpu_s") or []
    cpu_pct = burst.get("worker_cpu_pct") or []
    pg = burst.get("pg_session_samples") or {}
    rows = [
        (
            "answers",
            ", ".join(f"{n:,} x {kind}" for kind, n in (burst.get("answers") or {}).items()) or "none",
        ),
        ("accepted / completed", f"{burst.get('accepted', 0):,} / {burst.get('accepted_completed', 0):,}"),
        ("lost or wrong", ", ".join(f"{k}: {v}" for k, v in lost.items()) or "none"),
        ("all 202 or 429, none lost, every accepted run completed", verdict(burst.get("all_good"))),
        (
            "POST -> 202 p50 / p99",
            f"{fmt(_seconds(burst.get('post_response_ms_p50')), ' s', 2)} / "
            f"{fmt(_seconds(burst.get('post_response_ms_p99')), ' s', 2)}",
        ),
        (
            "time in the queue, queued runs p50 / p99 / max",
            " / ".join(
                fmt(_seconds(burst.get(f"queue_ms_queued_runs_{p}")), " s", 1) for p in ("p50", "p99", "max")
            ),
        ),
        (
            "time in the queue, all accepted runs p50 / p99",
            " / ".join(
                fmt(_seconds(burst.get(f"queue_ms_all_accepted_{p}")), " s", 1) for p in ("p50", "p99")
            ),
        ),
        (
            "peak seen: queued; active runs per worker",
            f"{fmt(peak.get('queued'), '', 0)}; {active_text or 'n/a'}",
        ),
        (
            "drain: first POST -> last `done` (-> both workers seen idle)",
            f"{fmt(burst.get('drain_wall_s_to_last_done'), ' s', 1)} "
            f"({fmt(burst.get('drain_wall_s_to_idle_seen'), ' s', 1)})"
            + ("" if burst.get("drained", True) else ", **not drained**"),
        ),
        (
            "worker CPU over burst and drain",
            ", ".join(f"{fmt(s, ' s', 1)} ({fmt(p, '%', 0)})" for s, p in zip(cpu_s, cpu_pct, strict=False))
            or "n/a",
        ),
        (
            "machine busy / stolen",
            f"{fmt(burst.get('machine_busy_pct'), '%', 0)} / {fmt(burst.get('machine_steal_pct'), '%', 1)}",
        ),
    ]
    if pg:
        rows.append(
            (
                "PostgreSQL sessions sampled (state: wait), most seen",
                ", ".join(f"{k} {v:,}" for k, v in list(pg.items())[:4]),
            )
        )
    md.append("| measure | value |\n|---|---|")
    md.extend(f"| {a} | {b} |" for a, b in rows)
    md.append("")
    return md


def _runs(side: dict) -> str:
    if side.get("not_run"):
        return f"not run: {side['not_run']}"
    return f"{side.get('runs', '?')} ({side.get('runs_wrong', '?')})"


def _cluster_part(cluster: dict | None) -> list[str]:
    md = ["### Redis Cluster against one Redis node\n"]
    why = _failed(cluster, "cluster")
    if why or cluster is None:
        return [*md, f"Did not run: {why}\n"]
    rounds = cluster.get("rounds") or []
    first = next(
        (r.get(k) for r in rounds for k in ("node", "cluster") if "tokens_per_s" in r.get(k, {})), {}
    )
    md.append(
        f"Two workers, {first.get('database', '?')}; {cluster.get('concurrency', '?')} users, runs of "
        f"{first.get('tokens_per_run', '?')} tokens started on one worker and streamed from the other, "
        f"{fmt(first.get('seconds'), ' s', 0)} a side; a Redis node of its own, then a cluster of its own "
        "(3 masters + 3 replicas), the order alternating by round. µs/token: both workers' CPU per token.\n"
    )
    md.append(
        "| round | node tokens/s | cluster tokens/s | cluster / node | node µs/token | cluster µs/token | "
        "runs (wrong) node; cluster |"
    )
    md.append("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rounds, 1):
        node, clu = r.get("node") or {}, r.get("cluster") or {}
        tps_n, tps_c = node.get("tokens_per_s"), clu.get("tokens_per_s")
        ratio = tps_c / tps_n if tps_n and tps_c is not None else None
        md.append(
            f"| {i} | {fmt(tps_n, '', 0)} | {fmt(tps_c, '', 0)} | {fmt(ratio, 'x', 2)} | "
            f"{fmt(node.get('worker_cpu_us_per_token'), '', 1)} | "
            f"{fmt(clu.get('worker_cpu_us_per_token'), '', 1)} | "
            f"{_runs(node)}; {_runs(clu)} |"
        )
    ratio = cluster.get("ratio_cluster_to_node")
    if ratio is not None:
        md.append(f"\nCluster / node, median of the rounds: **{fmt(ratio, 'x', 2)}**.\n")
    else:
        md.append(f"\nCluster / node: n/a ({cluster.get('not_run') or 'no round ran on both'}).\n")
    return md


def capacity_section(
    knee: dict | None,
    burst: dict | None,
    cluster: dict | None,
    instructions: dict[str, dict | None] | None = None,
) -> list[str]:
    """The "Capacity (issue 17)" section of RESULTS.md."""
    md: list[str] = ["## Capacity (issues 17, 29)\n"]
    md.append(
        "`bench/capacity_bench.py`, each subcommand with a Redis of its own (not the machine's 6379). "
        "`knee`: N users each keep one run streaming at 50 tokens/s; token delivery is the client's "
        "receive time minus the fake LLM's send stamp; N steps up until a level misses; the floor is a "
        "bare relay (`bench/peers/bare_relay.py`) driven the same way in the same invocation. `burst`: run "
        "starts in one second against two workers with a small `MAX_ACTIVE_RUNS`; every answer must be "
        "202 or 429 and every accepted run must complete exactly. `cluster-throughput`: the throughput "
        'load through a Redis Cluster against one node. How each is measured: bench/README.md "Capacity '
        '(issue 17)"; what limits each and how the figures moved: bench/NOTES.md "Capacity, second pass".\n'
    )
    md.append("| target | measured | |\n|---|---|---|")
    md.extend(
        f"| {t} | {m} | {verdict(ok) if ok is not None else 'reported'} |"
        for _, t, m, ok in capacity_targets(knee, burst, cluster, instructions)
    )
    md.append("")
    md.extend(_knee_part(knee))
    md.extend(_instructions_part(knee, instructions or {}))
    md.extend(_burst_part(burst))
    md.extend(_cluster_part(cluster))
    return md
