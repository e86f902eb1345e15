"""The models agents can use (LLM_MODELS, or the one ``default``): never their keys."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import OwnerDep, ServicesDep
from app.api.schemas import ModelInfo, error_responses

router = APIRouter(tags=["models"])


@router.get("/api/models", response_model=list[ModelInfo], responses=error_responses(401))
async def list_models(services: ServicesDep, _owner: OwnerDep) -> list[ModelInfo]:
    return [ModelInfo(**model) for model in services.models.public()]
