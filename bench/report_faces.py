"""The "Protocol faces (issue 26)" part of bench/RESULTS.md: its rows of the target table and its
section, from ``faces_bench`` (bench/out/faces.json). Used by bench/report.py.

Every figure is read with ``.get``: a file that says ``error``, a face that was not available or a
run without the thread part gives "n/a" or the reason, never an exception.
"""

from __future__ import annotations

from bench.report_common import fmt, verdict

Row = tuple[str, str, str, bool | None]
NAMES = {
    "own": "own API (`GET .../stream`)",
    "ai-sdk": "AI SDK (`POST /api/ai-sdk/chat`)",
    "ag-ui": "AG-UI (`POST /api/ag-ui`)",
}


def _x(value: float | None) -> str:
    return fmt(value, "x", 2)


def _then(last: dict, first: dict, key: str, digits: int) -> str:
    """``last (first)``: a thread's later runs' figure, its first run's in brackets."""
    return f"{fmt(last.get(key), '', digits)} ({fmt(first.get(key), '', digits)})"


def _cells(*values: str) -> str:
    return "| " + " | ".join(values) + " |"


def faces_targets(faces: dict | None) -> list[Row]:
    """Per face: worker CPU per run and stream bytes per answer token <= 1.5x the own stream's, for
    first runs (the issue's figure) and for a thread's later runs."""
    if faces is None:
        return [("F", "protocol faces <= 1.5x the own stream (CPU, bytes)", "did not run", None)]
    if faces.get("error"):
        return [("F", "protocol faces <= 1.5x the own stream (CPU, bytes)", str(faces["error"]), None)]
    rows: list[Row] = []
    ratios = faces.get("ratios") or {}
    thread = (faces.get("thread") or {}).get("ratios") or {}
    window = (faces.get("thread") or {}).get("window")
    for face in ("ai-sdk", "ag-ui"):
        subject = (faces.get("subjects") or {}).get(face) or {}
        if not subject.get("available", False):
            rows.append(
                (
                    "F",
                    f"{face}: CPU/run and stream bytes/token <= 1.5x own",
                    subject.get("reason", "n/a"),
                    None,
                )
            )
            continue
        r = ratios.get(face) or {}
        rows.append(
            (
                "F",
                f"{face}: CPU/run and stream bytes/token <= 1.5x own (first runs)",
                f"CPU {_x(r.get('cpu'))}, bytes {_x(r.get('stream_wire_bytes'))}",
                r.get("within_target"),
            )
        )
        t = thread.get(face)
        if t:
            rows.append(
                (
                    "F",
                    f"{face}: same, a thread's runs {window[0]}-{window[1]}",
                    f"CPU {_x(t.get('cpu'))}, bytes {_x(t.get('stream_wire_bytes'))}",
                    t.get("within_target"),
                )
            )
    return rows


def faces_section(faces: dict | None) -> list[str]:
    """The "Protocol faces (issue 26)" section of RESULTS.md."""
    md = ["## Protocol faces (issue 26)\n"]
    if faces is None or faces.get("error"):
        md.append(f"`bench/faces_bench.py` did not run{': ' + str(faces['error']) if faces else ''}.\n")
        return md
    md.append(
        f"`bench/faces_bench.py`: the job of the other HTTP benchmarks through each face, one worker on "
        f"{faces.get('database', '?')}, {faces.get('rounds')} interleaved rounds of "
        f"{faces.get('runs_per_block')} runs a subject (first runs of new conversations, chats, threads); "
        "CPU is the worker's (/proc) per run; bytes are the stream response as received (status line, "
        "headers, chunked framing, body) per answer token, the requests apart. Ratios are face / own in "
        f"the same run. Machine busy {fmt(faces.get('machine_busy_pct'), '%', 0)}, stolen "
        f"{fmt(faces.get('machine_steal_pct'), '%', 0)}. How it is measured: bench/README.md; what the "
        'figures mean: bench/NOTES.md "Protocol faces".\n'
    )
    md.append("| target | measured | |\n|---|---|---|")
    md.extend(
        f"| {t} | {m} | {verdict(ok) if ok is not None else 'reported'} |"
        for _, t, m, ok in faces_targets(faces)
    )
    md.append("")
    md.append(
        "| subject | CPU ms/run | wall ms p50 | stream B/token (wire) | SSE body B/token | requests B/run "
        "| all B/token | delta frame B | CPU x | bytes x |"
    )
    md.append("|---|---|---|---|---|---|---|---|---|---|")
    ratios = faces.get("ratios") or {}
    for name, s in (faces.get("subjects") or {}).items():
        if not s.get("available", False):
            md.append(_cells(NAMES.get(name, name), f"not available: {s.get('reason')}", *[""] * 8))
            continue
        r = ratios.get(name) or {}
        md.append(
            _cells(
                NAMES.get(name, name),
                fmt(s.get("cpu_ms_per_run"), "", 1),
                fmt(s.get("wall_ms_p50"), "", 1),
                fmt(s.get("stream_wire_bytes_per_token"), "", 1),
                fmt(s.get("stream_body_bytes_per_token"), "", 1),
                fmt(s.get("request_bytes_per_run"), "", 0),
                fmt(s.get("all_bytes_per_token"), "", 1),
                fmt(s.get("delta_frame_overhead_bytes"), "", 0),
                _x(r.get("cpu")) if r else "1",
                _x(r.get("stream_wire_bytes")) if r else "1",
            )
        )
    md.append("")
    thread = faces.get("thread") or {}
    if thread.get("subjects"):
        lo, hi = thread["window"]
        md.append(
            f"A thread's later runs: {thread.get('threads')} thread(s) of {thread.get('runs_per_thread')} "
            "runs a subject, interleaved run by run, each client sending back the history it holds; runs "
            f"{lo}-{hi} (answer only: the fake calls no tool once the history has its 5 results):\n"
        )
        md.append(
            "| subject | CPU ms/run (run 1) | stream B/run (run 1) | requests B/run | CPU x | stream bytes x "
            "| all bytes x |"
        )
        md.append("|---|---|---|---|---|---|---|")
        for name, s in thread["subjects"].items():
            last, first = s.get("last") or {}, s.get("first") or {}
            r = (thread.get("ratios") or {}).get(name) or {}
            md.append(
                _cells(
                    NAMES.get(name, name),
                    _then(last, first, "cpu_ms", 1),
                    _then(last, first, "stream_wire_bytes", 0),
                    fmt(last.get("request_bytes"), "", 0),
                    _x(r.get("cpu")) if r else "1",
                    _x(r.get("stream_wire_bytes")) if r else "1",
                    _x(r.get("all_bytes")) if r else "1",
                )
            )
        md.append("")
    return md
