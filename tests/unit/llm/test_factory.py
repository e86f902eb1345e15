"""build_models without LLM_MODELS: the one model "default", the demo model without LLM_BASE_URL,
the OpenAI-compatible client with it."""

from __future__ import annotations

from pydantic import SecretStr

from app.llm.base import ChatMessage
from app.llm.demo import DemoLLM
from app.llm.factory import build_models
from app.llm.openai_client import OpenAICompatibleLLM
from app.settings import Settings
from tests.support.fake_openai import FakeOpenAIServer, FakeReply


def test_without_a_base_url_the_demo_model_answers() -> None:
    registry = build_models(Settings(_env_file=None, llm_base_url=None))
    llm = registry.llm("default")

    assert registry.names == ["default"]

    assert isinstance(llm, DemoLLM)
    assert llm.model_name == "demo"


async def test_with_a_base_url_the_openai_client_is_configured_from_settings() -> None:
    with FakeOpenAIServer() as server:
        server.script(FakeReply.error(429, headers={"retry-after-ms": "1"}), FakeReply.text("hello"))
        settings = Settings(
            _env_file=None,
            llm_base_url=server.base_url,
            llm_api_key=SecretStr("sk-from-settings"),
            llm_model="my-model",
            llm_abilities="json_mode,streaming",
            llm_max_retries=1,
        )
        llm = build_models(settings).llm("default")
        try:
            assert isinstance(llm, OpenAICompatibleLLM)
            assert llm.model_name == "my-model"
            assert llm.abilities == {"tool_call": False, "json_mode": True, "streaming": True}
            result = await llm.chat([ChatMessage(role="user", content="hi")])
        finally:
            await llm.aclose()

        assert (result.content, result.attempts) == ("hello", 2)
        assert server.received[0].headers["authorization"] == "Bearer sk-from-settings"
        assert server.requests[0]["model"] == "my-model"
        server.assert_done()
