"""What bench/report.py reads and how it writes figures: the raw JSON of bench/out, the in-process
subjects' medians, py-spy profiles (collapsed stacks) summarised, the machine, number formats,
target verdicts and the latency plot (matplotlib, from the peers venv). Also used by
bench/report_durable.py.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import statistics
from pathlib import Path


def load(out: Path, name: str) -> dict | None:
    path = out / name
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def inproc(out: Path) -> dict[str, dict[str, float]]:
    rows: dict[str, list[dict]] = collections.defaultdict(list)
    path = out / "inproc.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["subject"]].append(row)
    med = statistics.median
    return {
        subject: {
            "cpu": med(r["cpu_ms_mean"] for r in rs),
            "wall": med(r["wall_ms_p50"] for r in rs),
            "rounds": len(rs),
            "runs": sum(r["runs"] for r in rs),
        }
        for subject, rs in rows.items()
    }


def fold_summary(path: Path, top: int = 15) -> str:
    if not path.exists() or path.stat().st_size == 0:
        return "(no profile)"
    own: collections.Counter[str] = collections.Counter()
    cum: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = stack.split(";")
        own[frames[-1]] += count
        for frame in set(frames):
            cum[frame] += count
    if not total:
        return "(no samples)"
    lines = [f"{total} samples. Own time (the frame itself):"]
    ranked_own = sorted(own.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    lines += [f"  {100 * c / total:5.1f}%  {f[:140]}" for f, c in ranked_own]
    lines.append("Cumulative (the frame and what it calls), app/ and library frames:")
    shown = 0
    for f, c in sorted(cum.items(), key=lambda kv: (-kv[1], kv[0]))[:200]:
        if any(
            s in f for s in ("runpy", "click/", "uvicorn/main", "_bootstrap", "Runner.run", "asyncio_run")
        ):
            continue
        lines.append(f"  {100 * c / total:5.1f}%  {f[:140]}")
        shown += 1
        if shown >= top:
            break
    return "\n".join(lines)


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    load = os.getloadavg()
    return (
        f"{os.cpu_count()} cores ({model}), {mem} RAM, {platform.system()} {platform.release()}; "
        f"load average at report time {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        "(the machine is shared with other work: absolute figures move, ratios within one run are what count)"
    )


def fmt(x: float | None, unit: str = "", digits: int = 1) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:,.{digits}f}{unit}"


def latency_row(target: str, level: dict | None, judged: bool = True) -> tuple[str, str, str, bool | None]:
    """A target-4 row for the table: ``target`` with ``{n}`` for the level's concurrency."""
    if level is None:
        return "4", target.format(n="?"), "n/a", None
    measured = f"p50 {fmt(level['p50_ms'], ' ms', 2)}, p99 {fmt(level['p99_ms'], ' ms', 1)}"
    ok = level["p50_ms"] < 5 and level["p99_ms"] < 25 if judged else None
    return "4", target.format(n=level["concurrency"]), measured, ok


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**not met**")


def plot(latency: dict | None, path: Path, follow: dict | None = None) -> bool:
    if not latency or not latency.get("levels"):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = latency["levels"]
    xs = [lv["concurrency"] for lv in levels]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for key, label in (("p50_ms", "p50"), ("p90_ms", "p90"), ("p99_ms", "p99")):
        ax.plot(xs, [max(lv[key], 0.01) for lv in levels], marker="o", label=f"{label}, first run")
    if follow and follow.get("levels"):
        fx = [lv["concurrency"] for lv in follow["levels"]]
        for key, label, color in (("p50_ms", "p50", "C0"), ("p99_ms", "p99", "C2")):
            ys = [max(lv[key], 0.01) for lv in follow["levels"]]
            ax.plot(fx, ys, marker="s", linestyle="--", color=color, label=f"{label}, follow-up run")
    ax.axhline(5, color="grey", linestyle=":", linewidth=1)
    ax.axhline(25, color="grey", linestyle="--", linewidth=1)
    ax.text(xs[0], 5.3, "p50 target 5 ms", fontsize=8, color="grey")
    ax.text(xs[0], 26.5, "p99 target 25 ms", fontsize=8, color="grey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("concurrent streaming runs (one worker, Redis)")
    ax.set_ylabel("token delivery latency (ms)")
    ax.set_title("Engine receives token -> SSE client has it")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True
