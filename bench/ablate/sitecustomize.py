"""Ablations inside a benchmark worker, on when ``BENCH_ABLATE`` names them (``bench/instructions.py
--ablate``); Python imports this module at start-up when its folder is on ``PYTHONPATH``.

An ablation takes a guarantee out to measure what it costs; the worker then keeps fewer promises
than AgentStream does, so its figures are never a result of their own, only a difference:

* ``store``: the event store's saves keep nothing (``EventRepo.save`` returns at once): no row of the
  events a run publishes as it goes, no checkpoint, no lease renewed by a save. What a run's start
  and close write in their own transactions (its row, its messages, its first and its ``done``
  event) is still written.
* ``redis``: no Redis (``REDIS_URL`` unset): the in-process bus, which stores every event before a
  follower gets it; with ``store`` as well, that store is the no-op above.

Only in a uvicorn worker (the fake LLM and the load generator are left alone). A worker that cannot
take out what it was asked to (an unknown name, an app without ``EventRepo``) exits at once with
status 3, so that the benchmark fails instead of counting a worker that kept its guarantees: Python
only prints an error in a ``sitecustomize`` and goes on.
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


def _install_or_exit(names: Sequence[str]) -> None:
    try:
        _install(names)
    except BaseException as exc:  # SystemExit too: site would swallow it
        print(f"bench/ablate: could not take out {list(names)}: {exc!r}", file=sys.stderr, flush=True)
        os._exit(3)


_names = [n for n in os.environ.get("BENCH_ABLATE", "").split(",") if n]
if _names and "uvicorn" in getattr(sys, "orig_argv", ()):
    _install_or_exit(_names)
