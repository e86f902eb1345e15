"""What the durable-runs benchmarks share: this tree's root and interpreter, the progress log (on
stderr) and this tree's state (its commit, and whether its ``app/`` has uncommitted changes), which
each result notes. Used by ``bench/durable_cost.py`` and ``bench/durable_resume.py``, the two parts
of ``python -m bench.durable_bench``.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


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
