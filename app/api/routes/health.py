"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import ServicesDep
from app.api.schemas import ReadyOut
from app.container import Services

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def _check(probe: object) -> bool:
    try:
        return bool(await asyncio.wait_for(probe, timeout=2.0))  # type: ignore[arg-type]
    except Exception:
        return False


@router.get(
    "/readyz",
    response_model=ReadyOut,
    responses={503: {"model": ReadyOut, "description": "a dependency is down, or the worker is stopping"}},
)
async def readyz(services: ServicesDep) -> JSONResponse:
    db_ok, bus_ok, queued = await asyncio.gather(
        _check(services.db.ping()), _check(services.bus.ping()), _queue_length(services)
    )
    checks = {"database": "ok" if db_ok else "down", "event_bus": "ok" if bus_ok else "down"}
    if not services.manager.accepting:
        checks["worker"] = "shutting_down"
    down = [name for name, state in checks.items() if state != "ok"]
    if services.auth.tokens is not None:
        # Said, not counted as down: API keys, and tokens signed with cached keys, work without the
        # provider, and every worker depends on the same one (README "Sign-in for browser apps").
        checks["signing_keys"] = services.auth.tokens.keys.state
    # A full worker is ready: what it cannot start queues for any worker with room.
    capacity = _capacity(services, queued)
    if down:
        return JSONResponse(
            {"status": "unavailable", "down": down, "checks": checks, "capacity": capacity},
            status_code=503,
        )
    return JSONResponse({"status": "ok", "checks": checks, "capacity": capacity})


async def _queue_length(services: Services) -> int | None:
    queue = services.manager.queue
    if queue is None:
        return None
    try:
        return await asyncio.wait_for(queue.length(), timeout=2.0)
    except Exception:
        return None


def _capacity(services: Services, queued: int | None) -> dict[str, int | None]:
    manager, settings = services.manager, services.settings
    return {
        "max_active_runs": settings.max_active_runs,
        "active_runs": manager.active_count,
        "room": manager.room.free(),
        "queued": queued,
        "max_queued_runs": settings.max_queued_runs,
    }


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST.partition(";")[0]: {"schema": {"type": "string"}}}}},
)
async def metrics(services: ServicesDep) -> Response:
    # Read at scrape time: pending approvals live in the database, across every worker.
    with contextlib.suppress(Exception):
        services.metrics.approvals_pending.set(await services.approvals.count_pending())
    with contextlib.suppress(Exception):
        services.metrics.webhook_queue.set(await services.webhooks.outbox.pending_count())
    queued = await _queue_length(services)
    if queued is not None:
        services.metrics.queued_runs.set(queued)
    services.metrics.run_room.set(services.manager.room.free())
    services.metrics.run_capacity.set(services.settings.max_active_runs)
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)
