"""Runs: their outcome and their durable event log."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import OwnerDep, ServicesDep
from app.api.presenters import event_out, run_out
from app.api.schemas import EventOut, RunOut, error_responses, is_resource_id
from app.container import Services
from app.db.repositories import RunRecord
from app.errors import NotFoundError
from app.runs.approvals import approval_item, tool_call_item

router = APIRouter(tags=["runs"])
ERRORS = error_responses(401, 404, 422)


async def owned_run(services: Services, owner: str, run_id: str) -> RunRecord:
    run = await services.runs.get(owner, run_id) if is_resource_id(run_id) else None
    if run is None:
        raise NotFoundError("run not found")
    return run


@router.get("/api/runs/{run_id}", response_model=RunOut, responses=ERRORS)
async def get_run(run_id: str, services: ServicesDep, owner: OwnerDep) -> RunOut:
    run = await owned_run(services, owner, run_id)
    pending, calls = await services.approvals.waiting_of(run.id)
    return run_out(
        run,
        run.model or services.models.default,
        [approval_item(a) for a in pending],
        [tool_call_item(c) for c in calls],
    )


@router.get("/api/runs/{run_id}/events", response_model=list[EventOut], responses=ERRORS)
async def run_events(run_id: str, services: ServicesDep, owner: OwnerDep) -> list[EventOut]:
    run = await owned_run(services, owner, run_id)
    return [event_out(ev) for ev in await services.events.for_run(run.id)]
