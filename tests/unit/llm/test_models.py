"""``app.llm.models``: LLM_MODELS parsing and checking, and a call falling back to another model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.llm.base import (
    ChatMessage,
    LLMRequestRejectedError,
    LLMUnavailableError,
    StreamEnd,
    TextDelta,
    TokenUsage,
)
from app.llm.models import FallbackLLM, ModelConfigError, ModelRegistry, ModelSpec, parse_models
from tests.support.scripted import ScriptedLLM, StreamScript, text

DEFAULTS = ModelSpec(
    name="default", model="m", abilities={"tool_call": True, "json_mode": True, "streaming": True}
)
QUESTION = [ChatMessage(role="user", content="hi")]


def entry(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "base_url": f"http://127.0.0.1:9/{name}/v1", "model": f"{name}-model", **fields}


def models(*entries: dict[str, Any]) -> list[ModelSpec]:
    return parse_models(json.dumps(list(entries)), DEFAULTS)


def test_entries_take_the_defaults_they_leave_out_and_the_first_is_the_default() -> None:
    specs = models(entry("fast", api_key="sk-fast", abilities=["json_mode"]), entry("strong", timeout_s=5))
    registry = ModelRegistry(specs, {})
    assert registry.default == "fast"
    assert specs[0].abilities == {"tool_call": False, "json_mode": True, "streaming": False}
    assert specs[1].abilities == DEFAULTS.abilities
    assert (specs[1].timeout_s, specs[1].max_retries) == (5.0, DEFAULTS.max_retries)


def test_the_public_view_names_models_and_never_shows_keys_or_urls() -> None:
    specs = models(entry("fast", api_key="sk-very-secret"), entry("strong"))
    shown = json.dumps(ModelRegistry(specs, {}).public())
    assert "sk-very-secret" not in shown and "127.0.0.1" not in shown
    assert [m["name"] for m in json.loads(shown)] == ["fast", "strong"]
    assert [m["default"] for m in json.loads(shown)] == [True, False]
    assert "sk-very-secret" not in repr(specs[0])


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("not json", "not valid JSON"),
        ("[]", "non-empty JSON list"),
        ('{"name": "a"}', "non-empty JSON list"),
        ("[1]", "entry 1 is not a JSON object"),
        (json.dumps([{"name": "a", "model": "m"}]), "entry 1 ('a'): base_url"),
        (json.dumps([entry("a", model="")]), "entry 1 ('a'): model"),
        (json.dumps([entry("a"), entry("b", timeout_s=0)]), "entry 2 ('b'): timeout_s"),
        (json.dumps([entry("a", max_retries=99)]), "max_retries"),
        (json.dumps([entry("a", abilities=["tool_call", "telepathy"])]), "unknown abilities ['telepathy']"),
        (json.dumps([entry("a", provider="acme")]), "unknown provider 'acme'"),
        (json.dumps([entry("a", colour="red")]), "unknown fields ['colour']"),
        (json.dumps([entry("bad name")]), "name must be"),
        (json.dumps([entry("a"), entry("a")]), "two entries are named 'a'"),
        (json.dumps([entry("a", fallback="zz")]), "fallback 'zz' names no entry"),
        (json.dumps([entry("a", fallback="b"), entry("b", fallback="a")]), "fallbacks loop (a -> b -> a)"),
        (json.dumps([entry("a", fallback="a")]), "fallbacks loop"),
        (
            json.dumps([entry("a", fallback="b"), entry("b", abilities=["json_mode", "streaming"])]),
            "its fallback 'b' lacks tool_call",
        ),
    ],
)
def test_a_bad_entry_is_refused_with_a_message_naming_it(raw: str, says: str) -> None:
    with pytest.raises(ModelConfigError) as caught:
        parse_models(raw, DEFAULTS)
    assert says in str(caught.value)


def test_a_key_never_appears_in_a_configuration_error() -> None:
    raw = json.dumps([entry("a", api_key="sk-leak-me", timeout_s=-1)])
    with pytest.raises(ModelConfigError) as caught:
        parse_models(raw, DEFAULTS)
    assert "sk-leak-me" not in str(caught.value)


def test_a_chain_follows_the_configured_fallbacks_in_order() -> None:
    specs = models(entry("a", fallback="b"), entry("b", fallback="c"), entry("c"))
    registry = ModelRegistry(specs, {s.name: ScriptedLLM([]) for s in specs})
    assert registry.chain("a") == ["a", "b", "c"]
    assert registry.chain("c") == ["c"]
    assert registry.for_run("c") is registry.llm("c")
    assert registry.resolve("gone") == "a" and registry.resolve(None) == "a" and registry.resolve("b") == "b"


class Recorder:
    def __init__(self) -> None:
        self.fallbacks: list[tuple[str, str]] = []

    async def __call__(self, from_model: str, to_model: str) -> None:
        self.fallbacks.append((from_model, to_model))


async def test_an_unavailable_call_goes_to_the_fallback_once_and_counts_every_attempt() -> None:
    primary = ScriptedLLM([LLMUnavailableError("down", attempts=4)])
    backup = ScriptedLLM([text("from backup", usage=TokenUsage(3, 2, 5))])
    said = Recorder()
    result = await FallbackLLM([("a", primary), ("b", backup)], said).chat(QUESTION)
    assert result.content == "from backup"
    assert result.attempts == 5  # the primary's four and the backup's one
    assert said.fallbacks == [("a", "b")]
    primary.assert_exhausted()
    backup.assert_exhausted()


async def test_a_refused_request_does_not_fall_back() -> None:
    primary = ScriptedLLM([LLMRequestRejectedError("401 bad key", status=401)])
    backup = ScriptedLLM([])
    said = Recorder()
    with pytest.raises(LLMRequestRejectedError):
        await FallbackLLM([("a", primary), ("b", backup)], said).chat(QUESTION)
    assert said.fallbacks == []


async def test_when_the_whole_chain_is_down_the_error_counts_every_attempt() -> None:
    chain = [
        ("a", ScriptedLLM([LLMUnavailableError("a down", attempts=2)])),
        ("b", ScriptedLLM([LLMUnavailableError("b down", attempts=3)])),
    ]
    said = Recorder()
    with pytest.raises(LLMUnavailableError) as caught:
        await FallbackLLM(chain, said).chat(QUESTION)
    assert caught.value.attempts == 5
    assert said.fallbacks == [("a", "b")]


async def test_a_stream_that_fails_before_its_first_token_falls_back() -> None:
    primary = ScriptedLLM([LLMUnavailableError("down", attempts=2)])
    backup = ScriptedLLM([StreamScript(["Hel", "lo"])])
    said = Recorder()
    items = [item async for item in FallbackLLM([("a", primary), ("b", backup)], said).stream_chat(QUESTION)]
    assert [i.text for i in items if isinstance(i, TextDelta)] == ["Hel", "lo"]
    end = items[-1]
    assert isinstance(end, StreamEnd) and end.attempts == 3
    assert said.fallbacks == [("a", "b")]


async def test_a_stream_that_broke_after_tokens_never_falls_back() -> None:
    primary = ScriptedLLM([StreamScript(["Hel"], error=LLMUnavailableError("cut", attempts=1))])
    backup = ScriptedLLM([])
    said = Recorder()
    seen: list[str] = []
    with pytest.raises(LLMUnavailableError):
        async for item in FallbackLLM([("a", primary), ("b", backup)], said).stream_chat(QUESTION):
            if isinstance(item, TextDelta):
                seen.append(item.text)
    assert seen == ["Hel"] and said.fallbacks == []


def test_agentstream_is_reserved_for_the_default() -> None:
    with pytest.raises(ModelConfigError, match="'agentstream' is what /v1 calls the default"):
        models(entry("a"), entry("agentstream"))


def test_a_streaming_model_needs_a_fallback_that_streams() -> None:
    with pytest.raises(ModelConfigError, match="its fallback 'b' lacks streaming"):
        models(entry("a", fallback="b"), entry("b", abilities=["tool_call", "json_mode"]))


async def test_a_fallback_that_refuses_still_counts_the_calls_made_before_it() -> None:
    chain = [
        ("a", ScriptedLLM([LLMUnavailableError("a down", attempts=4)])),
        ("b", ScriptedLLM([LLMRequestRejectedError("401", status=401)])),
    ]
    with pytest.raises(LLMRequestRejectedError) as caught:
        await FallbackLLM(chain, Recorder()).chat(QUESTION)
    assert caught.value.attempts == 5


async def test_a_stream_closed_midway_closes_the_models_stream_at_once() -> None:
    closed: list[bool] = []

    class Streaming(ScriptedLLM):
        async def stream_chat(self, messages: Any) -> Any:
            try:
                yield TextDelta("one")
                yield TextDelta("two")
            finally:
                closed.append(True)

    chain = [("a", Streaming([])), ("b", ScriptedLLM([]))]
    stream = FallbackLLM(chain, Recorder()).stream_chat(QUESTION)
    first = await stream.__anext__()
    await stream.aclose()  # type: ignore[attr-defined]

    assert isinstance(first, TextDelta) and closed == [True]


def test_an_empty_llm_models_as_the_env_example_has_it_is_unset() -> None:
    from app.llm.factory import model_specs
    from app.settings import Settings

    settings = Settings(_env_file=None, llm_models="  ")  # type: ignore[call-arg]

    assert [spec.name for spec in model_specs(settings)] == ["default"]
