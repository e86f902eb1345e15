"""Probes inside a benchmark worker, on when ``BENCH_PROBE_OUT`` names a file (``service_bench
latency --probe``); Python imports this module at start-up when its folder is on ``PYTHONPATH``.

* Event-loop lag: a task sleeps 5 ms over and over and records how late it wakes up (the loop's
  backlog: callbacks queued ahead of it, or a collection pass holding the loop).
* Collection passes: ``gc.callbacks`` time every pass of the cycle collector, with the number of
  objects it had to examine in the generations it collected (counted at the pass's start, for the
  young generations only: counting the old one would itself take as long as a full pass).

Each line of the output is ``<unix time> lag <ms>`` or ``<unix time> gc <generation> <ms> <objects>``;
``service_bench`` reads back the lines that fall within each level.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from typing import Any

LAG_PROBE_S = 0.005


def _install(path: str) -> None:
    out = open(path, "a", buffering=1)  # open for the process's whole life
    started: dict[str, Any] = {}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if phase == "start":
            young = sum(len(gc.get_objects(g)) for g in range(generation + 1)) if generation < 2 else -1
            started.update(at=time.perf_counter(), objects=young)
        elif "at" in started:
            ms = (time.perf_counter() - started["at"]) * 1000
            out.write(f"{time.time():.3f} gc {generation} {ms:.3f} {started['objects']}\n")

    gc.callbacks.append(on_gc)

    async def lag_probe() -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(LAG_PROBE_S)
            late = (loop.time() - before - LAG_PROBE_S) * 1000
            out.write(f"{time.time():.3f} lag {max(0.0, late):.3f}\n")

    from uvicorn.server import Server

    serve = Server.serve

    async def serve_with_probe(self: Server, *args: Any, **kwargs: Any) -> None:
        probe = asyncio.get_running_loop().create_task(lag_probe())
        try:
            await serve(self, *args, **kwargs)
        finally:
            probe.cancel()

    Server.serve = serve_with_probe  # type: ignore[method-assign]


if os.environ.get("BENCH_PROBE_OUT"):
    _install(os.environ["BENCH_PROBE_OUT"])
