"""The tools agents may use."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import OwnerDep, ServicesDep
from app.api.schemas import ToolInfo, error_responses

router = APIRouter(tags=["tools"])


@router.get("/api/tools", response_model=list[ToolInfo], responses=error_responses(401))
async def list_tools(services: ServicesDep, _owner: OwnerDep) -> list[ToolInfo]:
    return [
        ToolInfo(name=t.name, description=t.description, parameters=dict(t.parameters))
        for t in services.tools
    ]
