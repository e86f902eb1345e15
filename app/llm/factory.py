"""The one place that decides which LLMs the service talks to.

``model_specs(settings)``: ``LLM_MODELS`` when set, else the one model ``default`` of the ``LLM_*``
variables (no ``LLM_BASE_URL``: the offline ``DemoLLM``). ``build_models`` makes their LLMs (the keys
are unwrapped from their ``SecretStr`` only here) into a ``ModelRegistry``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from app.llm.base import LLM
from app.llm.demo import DemoLLM
from app.llm.models import DEFAULT_MODEL, ModelRegistry, ModelSpec, parse_models
from app.llm.openai_client import OpenAICompatibleLLM
from app.llm.providers import profile_for
from app.settings import Settings

logger = logging.getLogger(__name__)


def model_specs(settings: Settings) -> list[ModelSpec]:
    """The configured models, the default first. Raises ``ModelConfigError`` (naming the entry,
    never a key) for an ``LLM_MODELS`` that cannot be used."""
    key = settings.llm_api_key.get_secret_value() if settings.llm_api_key is not None else None
    default = ModelSpec(
        name=DEFAULT_MODEL,
        model=settings.llm_model if settings.llm_base_url is not None else "demo",
        base_url=settings.llm_base_url,
        api_key=key,
        abilities=settings.abilities,
        timeout_s=settings.llm_timeout_s,
        max_retries=settings.llm_max_retries,
        provider=settings.llm_provider,
    )
    if settings.llm_models is None:
        return [default]
    return parse_models(settings.llm_models.get_secret_value(), default)


def build_one(spec: ModelSpec, settings: Settings) -> LLM:
    if spec.base_url is None:
        # The demo "thinks" for a while before each loop step, in proportion to its typing speed,
        # so that steps appear one by one and a follow-up can arrive while the loop still works.
        return DemoLLM(delay_s=settings.demo_delay_s, think_s=settings.demo_delay_s * 15)
    profile = profile_for(spec.base_url, spec.model, spec.provider)
    logger.info("llm name=%s model=%s provider profile=%s", spec.name, spec.model, profile.name)
    return OpenAICompatibleLLM(
        base_url=spec.base_url,
        api_key=spec.api_key,
        model=spec.model,
        abilities=spec.abilities or {},
        timeout_s=spec.timeout_s,
        max_retries=spec.max_retries,
        profile=profile,
    )


def build_models(settings: Settings, wrap: Callable[[ModelSpec, LLM], LLM] | None = None) -> ModelRegistry:
    """Every configured model's LLM, each passed through ``wrap(spec, llm)`` (metrics, traces) if given."""
    specs: list[ModelSpec] = []
    llms: dict[str, LLM] = {}
    for spec in model_specs(settings):
        llm = build_one(spec, settings)
        if spec.base_url is None:  # the demo says itself what it can do
            spec = dataclasses.replace(spec, abilities=dict(llm.abilities))
        specs.append(spec)
        llms[spec.name] = wrap(spec, llm) if wrap is not None else llm
    return ModelRegistry(specs, llms)
