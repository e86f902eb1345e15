"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import ServicesDep
from app.api.schemas import ReadyOut

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
    db_ok, bus_ok = await asyncio.gather(_check(services.db.ping()), _check(services.bus.ping()))
    checks = {"database": "ok" if db_ok else "down", "event_bus": "ok" if bus_ok else "down"}
    if not services.manager.accepting:
        checks["worker"] = "shutting_down"
    down = [name for name, state in checks.items() if state != "ok"]
    if down:
        return JSONResponse(
            {"status": "unavailable", "down": down, "checks": checks},
            status_code=503,
        )
    return JSONResponse({"status": "ok", "checks": checks})


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST.partition(";")[0]: {"schema": {"type": "string"}}}}},
)
async def metrics(services: ServicesDep) -> Response:
    # Read at scrape time: pending approvals live in the database, across every worker.
    with contextlib.suppress(Exception):
        services.metrics.approvals_pending.set(await services.approvals.count_pending())
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)
