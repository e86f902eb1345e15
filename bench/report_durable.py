"""The "Durable runs" part of bench/RESULTS.md: its rows of the target table and its section, from
``durable_bench checkpoints`` and ``durable_bench resume`` (bench/out/durable_checkpoints.json and
durable_resume.json). Used by bench/report.py.
"""

from __future__ import annotations

from bench.report_common import fmt, verdict

DB_NAMES = {"sqlite": "SQLite", "postgres": "PostgreSQL"}


def _in_tree(path: str) -> str:
    """``path`` from its ``app/`` on: no absolute path of the machine in the report."""
    return path[path.rfind("/app/") + 1 :] if "/app/" in path else path.rsplit("/", 1)[-1]


def durable_targets(cost: dict | None, resume: dict | None) -> list[tuple[str, str, str, bool | None]]:
    """The durable-runs rows of the target table (``bench/durable_bench.py``)."""
    rows: list[tuple[str, str, str, bool | None]] = []
    if cost and not cost.get("error"):
        for db, h in cost.get("http", {}).items():
            rows.append(
                (
                    "D",
                    f"checkpoint cost: worker CPU per HTTP run <= 1.1x baseline ({DB_NAMES.get(db, db)})",
                    fmt(h["ratio"], "x", 2),
                    h["ratio"] <= 1.1,
                )
            )
        for db, d in cost.get("dbwork", {}).items():
            ok = d["ratio_cpu"] <= 1.1 and d["ratio_write_transactions"] <= 1.1
            rows.append(
                (
                    "D",
                    f"checkpoint cost: database work per run (CPU; write transactions) <= 1.1x baseline "
                    f"({DB_NAMES.get(db, db)})",
                    f"{fmt(d['ratio_cpu'], 'x', 2)}; {fmt(d['ratio_write_transactions'], 'x', 2)}",
                    ok,
                )
            )
        sc = cost.get("scaling")
        if sc:
            k = sc["window"]
            rows.append(
                (
                    "D",
                    "iteration 50 engine CPU <= 2x iteration 1, checkpoint included",
                    f"{fmt(sc['ratio_last_first_with'], 'x', 2)} (last {k} / first {k}: "
                    f"{fmt(sc[f'ratio_last{k}_first{k}_with'], 'x', 2)})",
                    sc["ratio_last_first_with"] <= 2 and sc[f"ratio_last{k}_first{k}_with"] <= 2,
                )
            )
    elif cost:
        rows.append(("D", "checkpoint cost", cost["error"], None))
    if resume and not resume.get("error"):
        for key, name in (
            ("sigkill", "resume after SIGKILL (kill -> resumed event)"),
            ("lease", "resume after lease expiry (expiry -> resumed event)"),
        ):
            b = resume[key]
            rows.append(
                (
                    "D",
                    f"{name}, p50 / p99",
                    f"{fmt(b['p50_ms'], ' ms', 0)} / {fmt(b['p99_ms'], ' ms', 0)}",
                    None,
                )
            )
        b = resume["sigterm"]
        rows.append(
            (
                "D",
                "SIGTERM hand-over (release -> resumed event) p99 < 1 s",
                f"p50 {fmt(b['p50_ms'], ' ms', 0)}, p99 {fmt(b['p99_ms'], ' ms', 0)}",
                resume["sigterm_p99_under_1s"],
            )
        )
    elif resume:
        rows.append(("D", "resume time", resume["error"], None))
    return rows


def spread(ratios: list[float] | None) -> str:
    """`` (rounds: lo-hi)``: the rounds' own new/baseline ratios."""
    if not ratios or len(ratios) < 2:
        return ""
    return f" (rounds {min(ratios):.2f}-{max(ratios):.2f})"


def durable_section(cost: dict | None, resume: dict | None) -> list[str]:
    """The "Durable runs" section of RESULTS.md."""
    md = ["## Durable runs\n"]
    if not cost and not resume:
        md.append("`bench/durable_bench.py` did not run.\n")
        return md
    md.append("Targets (from the issue, verbatim):\n")
    md.append(f"> {(cost or {}).get('target') or 'Checkpoint cost: see bench/durable_bench.py'}\n>")
    md.append(f"> {(resume or {}).get('target') or 'Resume time: see bench/durable_bench.py'}\n")
    md.append("| target | measured | |\n|---|---|---|")
    md.extend(
        f"| {t} | {m} | {verdict(ok) if ok is not None else 'reported'} |"
        for _, t, m, ok in durable_targets(cost, resume)
    )
    md.append("")
    md.append("### Checkpoint cost against the commit before durable runs\n")
    if cost and not cost.get("error"):
        new, base = cost["new"], cost["baseline"]
        state = f"{new['commit']}" + (
            f" + uncommitted app/ changes ({new['app_diff_sha1']})" if new.get("app_uncommitted") else ""
        )
        md.append(
            f"Baseline `{base['commit']}` (a git worktree in a temporary directory, its `app` imported "
            f"from the worktree's `{_in_tree(base['app_file'])}`) "
            "against "
            f"`{state}`, {cost['rounds']} interleaved rounds in one invocation, medians of the rounds. "
            + cost["how"]
            + "\n"
        )
        if cost.get("new_changed_during_run"):
            md.append(
                "**The tree changed during the run** (commits or app/ edits by others between rounds): "
                "the new code's rounds did not all measure the same code; see `new_states` in "
                "bench/out/durable_checkpoints.json.\n"
            )
        md.append("| measure | database | baseline | new | new / baseline | target | |")
        md.append("|---|---|---|---|---|---|---|")
        for db, h in cost["http"].items():
            md.append(
                f"| worker CPU per HTTP run, ms (`service_bench http`, {h['runs_per_round']} runs a round) | "
                f"{DB_NAMES.get(db, db)} | {fmt(h['baseline_ms'], '', 2)} | {fmt(h['new_ms'], '', 2)} | "
                f"{fmt(h['ratio'], 'x', 2)}{spread(h.get('paired_ratios'))} | <= 1.1x | "
                f"{verdict(h['ratio'] <= 1.1)} |"
            )
        for db, d in cost["dbwork"].items():
            name = DB_NAMES.get(db, db)
            b, n, w = d["baseline"], d["new"], d["new_without_durable"]
            md.append(
                f"| database work, CPU ms per run (`durable_dbwork`, {d['runs_per_round']} runs a round) | "
                f"{name} | "
                f"{fmt(b['cpu_ms'], '', 2)} | {fmt(n['cpu_ms'], '', 2)} | "
                f"{fmt(d['ratio_cpu'], 'x', 2)}{spread(d.get('paired_ratios_cpu'))} | "
                f"<= 1.1x | {verdict(d['ratio_cpu'] <= 1.1)} |"
            )
            md.append(
                f"| write transactions per run | {name} | {fmt(b['write_transactions_per_run'], '', 2)} | "
                f"{fmt(n['write_transactions_per_run'], '', 2)} | "
                f"{fmt(d['ratio_write_transactions'], 'x', 2)} | "
                f"<= 1.1x | {verdict(d['ratio_write_transactions'] <= 1.1)} |"
            )
            md.append(
                f"| sessions per run (reads and writes) | {name} | {fmt(b['sessions_per_run'], '', 2)} | "
                f"{fmt(n['sessions_per_run'], '', 2)} | {fmt(d['ratio_sessions'], 'x', 2)} | | reported |"
            )
            md.append(
                f"| statements per run | {name} | {fmt(b['statements_per_run'], '', 1)} | "
                f"{fmt(n['statements_per_run'], '', 1)} | "
                f"{fmt(n['statements_per_run'] / b['statements_per_run'], 'x', 2)} | | reported |"
            )
            rows_b = sum(b["rows_inserted_per_run"].values())
            rows_n = sum(n["rows_inserted_per_run"].values())
            md.append(
                f"| rows inserted per run | {name} | {fmt(rows_b, '', 1)} | {fmt(rows_n, '', 1)} "
                f"(checkpoint rows {fmt(n['rows_inserted_per_run'].get('run_checkpoints', 0), '', 1)} "
                f"holding {n['checkpoints']} checkpoints, {n['checkpoint_bytes']:,} bytes of JSON) | "
                f"{fmt(rows_n / rows_b, 'x', 2)} | | reported |"
            )
            md.append(
                "| database work, CPU ms per run, new code with its checkpoints and follow-up queue left out "
                "of the replay (the rest of the new code, fenced writes included) | "
                f"{name} | | {fmt(w['cpu_ms'], '', 2)} | durable part: "
                f"{fmt(d['ratio_cpu_durable_part'], 'x', 2)} of it | | reported |"
            )
        sc = cost.get("scaling")
        if sc:
            k = sc["window"]
            md.append(
                f"| engine CPU, iteration 50 / iteration 1 (`engine_bench scaling` with a checkpointer, "
                f"{sc['repeats']} runs) | - | {fmt(sc['ratio_last_first_without'], 'x', 2)} (no "
                "checkpointer) | "
                f"{fmt(sc['ratio_last_first_with'], 'x', 2)} | | <= 2x | "
                f"{verdict(sc['ratio_last_first_with'] <= 2)} |"
            )
            md.append(
                f"| engine CPU, iterations {sc['iterations'] - k + 1}-{sc['iterations']} / 1-{k} (medians) "
                "| - | "
                f"{fmt(sc[f'ratio_last{k}_first{k}_without'], 'x', 2)} (no checkpointer) | "
                f"{fmt(sc[f'ratio_last{k}_first{k}_with'], 'x', 2)} | | <= 2x | "
                f"{verdict(sc[f'ratio_last{k}_first{k}_with'] <= 2)} |"
            )
        md.append("")
        if sc:
            md.append(
                f"Per iteration (median of {sc['repeats']} runs; a run records "
                f"{fmt(sc['checkpoints_per_run'], '', 0)} checkpoints, "
                f"{fmt(sc['checkpoint_bytes_per_run'], '', 0)} bytes of JSON):\n"
            )
            md.append(
                "| iteration | engine CPU ms, with checkpointer | without | timed checkpointer: engine CPU | "
                "of it `Journal.delta` | of it `orjson.dumps` + record |"
            )
            md.append("|---|---|---|---|---|---|")
            for row in sc["rows"]:
                if row["iteration"] in (1, 2, 5, 10, 25, 46, 49, 50):
                    md.append(
                        f"| {row['iteration']} | {fmt(row['engine_cpu_ms'], '', 3)} | "
                        f"{fmt(row['engine_cpu_ms_without_checkpointer'], '', 3)} | "
                        f"{fmt(row.get('engine_cpu_ms_timed_checkpointer'), '', 3)} | "
                        f"{fmt(row.get('delta_cpu_ms'), '', 3)} | {fmt(row['serialise_cpu_ms'], '', 3)} |"
                    )
            md.append(
                "\nThe timed checkpointer's runs (a third series, interleaved with the others) note the CPU "
                "time of the engine's `Journal.delta` (building the delta) and of `record` (serialising "
                "it); the headline ratios come from the untimed series.\n"
            )
    elif cost:
        md.append(f"Did not run: {cost['error']}\n")
    md.append("### Resume time\n")
    if resume and not resume.get("error"):
        new = resume.get("new") or {}
        md.append(
            f"Measured on `{new.get('commit', '?')}`"
            + (f" + uncommitted app/ changes ({new['app_diff_sha1']})" if new.get("app_uncommitted") else "")
            + f" at {resume.get('measured_at', '?')}.\n"
        )
        md.append(
            f"{resume['workers']}; {resume['database']}; Redis. "
            f"`RUN_LEASE_S={resume['run_lease_s']:g}`: every worker looks for runs to take over every "
            f"{resume['claim_interval_s']:g} s (`min(2 s, RUN_LEASE_S/3)`), so a dead worker's run waits for "
            "the next look, whether its lease ran out or its pid is gone; a released run is announced on "
            f"Redis and taken at once. `SHUTDOWN_GRACE_S={resume['shutdown_grace_s']:g}`. The run answers "
            f"{resume['answer']}; each SIGKILL and lease round starts after a random pause of up to one "
            "claim interval (otherwise the rounds fall into step with the looks). The client follows the "
            "conversation through the other worker's SSE stream and notes when the `resumed` phase event's "
            "bytes arrive (the bench's clock). Lease path: a run row held by a worker of another host with "
            f"a {resume['other_host_lease_s']:g} s lease, timed from its `lease_expires_at`. SIGTERM: the "
            f"run's row polled every {1000 * resume['poll_s']:g} ms, timed from the last poll that still "
            "saw it held (it may overstate by one poll). With 20 samples p99 lies between the two largest.\n"
        )
        md.append("| path | timed | n | p50 ms | p90 ms | p99 ms | max ms | errors | target |")
        md.append("|---|---|---|---|---|---|---|---|---|")
        b = resume["sigkill"]
        label = [
            ("sigkill", "SIGKILL, worker of this host (pid gone)", "kill -> resumed at client", "reported"),
            (
                "lease",
                "lease runs out (worker of another host)",
                "lease expiry -> resumed at client",
                "reported",
            ),
            (
                "sigterm",
                "SIGTERM hand-over",
                "release -> resumed at client",
                f"p99 < 1 s: {verdict(resume['sigterm_p99_under_1s'])}",
            ),
        ]
        for key, path_name, timed, target in label:
            b = resume[key]
            md.append(
                f"| {path_name} | {timed} | {b['n']} | {fmt(b['p50_ms'], '', 0)} | "
                f"{fmt(b['p90_ms'], '', 0)} | "
                f"{fmt(b['p99_ms'], '', 0)} | {fmt(b['max_ms'], '', 0)} | {len(b['errors'])} | {target} |"
            )
        t = resume["sigterm"]
        for key, timed in (
            ("term_to_release_ms", "SIGTERM -> release (the grace period, then storing the state)"),
            ("term_to_resumed_ms", "SIGTERM -> resumed at client"),
        ):
            if key in t:
                md.append(
                    f"| SIGTERM | {timed} | {t['n']} | {fmt(t[key]['p50'], '', 0)} | | "
                    f"{fmt(t[key]['p99'], '', 0)} | {fmt(t[key]['max'], '', 0)} | | reported |"
                )
        md.append("")
        errors = [e for key in ("sigkill", "lease", "sigterm") for e in resume[key]["errors"]]
        if errors:
            md.append("Errors: " + "; ".join(errors[:10]) + "\n")
    elif resume:
        md.append(f"Did not run: {resume['error']}\n")
    return md
