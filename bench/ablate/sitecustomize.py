"""Ablations inside a benchmark worker, on when ``BENCH_ABLATE`` names them (``bench/instructions.py
--ablate``); Python imports this module at start-up when its folder is on ``PYTHONPATH``.

An ablation takes a guarantee out to measure what it costs; the worker then keeps fewer promises
than AgentStream does, so its figures are never a result of their own, only a difference:

* ``store``: the event store keeps nothing (``EventRepo.save`` returns at once): no event row, no
  checkpoint, no lease renewed by a save.
* ``redis``: no Redis (``REDIS_URL`` unset): the in-process bus, which stores every event before a
  follower gets it; with ``store`` as well, that store is the no-op above.

Only in a uvicorn worker (the fake LLM and the load generator are left alone).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

KNOWN = ("store", "redis")


def _install(names: Sequence[str]) -> None:
    unknown = sorted(set(names) - set(KNOWN))
    if unknown:
        raise SystemExit(f"BENCH_ABLATE: unknown ablation(s) {unknown}; known: {list(KNOWN)}")
    if "redis" in names:
        os.environ.pop("REDIS_URL", None)
    if "store" in names:
        from app.db.repositories.events import EventRepo

        async def save_nothing(self: EventRepo, *args: Any, **kwargs: Any) -> None:
            return None

        EventRepo.save = save_nothing  # type: ignore[method-assign]


_names = [n for n in os.environ.get("BENCH_ABLATE", "").split(",") if n]
if _names and "uvicorn" in getattr(sys, "orig_argv", ()):
    _install(_names)
