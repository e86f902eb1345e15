"""``build_llm(settings)``: the one place that decides which LLM the service talks to.

No ``LLM_BASE_URL`` means the offline ``DemoLLM``; otherwise an ``OpenAICompatibleLLM`` configured from
the settings (the API key is unwrapped from its ``SecretStr`` only here).
"""

from __future__ import annotations

import logging

from app.llm.base import LLM
from app.llm.demo import DemoLLM
from app.llm.openai_client import OpenAICompatibleLLM
from app.llm.providers import profile_for
from app.settings import Settings

logger = logging.getLogger(__name__)


def build_llm(settings: Settings) -> LLM:
    if settings.llm_base_url is None:
        # The demo "thinks" for a while before each loop step, in proportion to its typing speed,
        # so that steps appear one by one and a follow-up can arrive while the loop still works.
        return DemoLLM(delay_s=settings.demo_delay_s, think_s=settings.demo_delay_s * 15)
    api_key = settings.llm_api_key.get_secret_value() if settings.llm_api_key is not None else None
    profile = profile_for(settings.llm_base_url, settings.llm_model, settings.llm_provider)
    logger.info("llm model=%s provider profile=%s", settings.llm_model, profile.name)
    return OpenAICompatibleLLM(
        base_url=settings.llm_base_url,
        api_key=api_key,
        model=settings.llm_model,
        abilities=settings.abilities,
        timeout_s=settings.llm_timeout_s,
        max_retries=settings.llm_max_retries,
        profile=profile,
    )
