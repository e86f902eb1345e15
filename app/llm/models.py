"""The models a service serves: ``LLM_MODELS`` (or the ``LLM_*`` variables), by name, with fallback.

``model_specs(settings)`` reads and checks the configuration (a bad entry stops the start with a
message naming it; keys never appear in it). ``ModelRegistry`` holds one LLM per entry, built once
and shared by every run; ``ModelRegistry.for_run(name, on_fallback)`` gives a run its model as an
LLM that, when a call stays unavailable after its retries, makes it again on the entry's
``fallback`` (and that one's, as configured; never a loop), and says so through ``on_fallback``.
A refusal (400, 401, 404: ``LLMRequestRejectedError``) or an unusable reply never falls back: it
is the caller's mistake, or the model's, not an outage.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from app.llm.base import (
    LLM,
    ChatMessage,
    ChatResult,
    LLMError,
    LLMUnavailableError,
    StreamEnd,
    StreamItem,
)
from app.llm.providers import PROFILES

DEFAULT_MODEL = "default"
RESERVED_NAME = "agentstream"
"""The name ``/v1`` gives the agent on the default model."""
ABILITY_NAMES = ("tool_call", "json_mode", "streaming")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,99}")
_KEYS = {
    "name",
    "base_url",
    "api_key",
    "model",
    "abilities",
    "timeout_s",
    "max_retries",
    "fallback",
    "provider",
}

logger = logging.getLogger(__name__)
OnFallback = Callable[[str, str], Awaitable[None]]


class ModelConfigError(ValueError):
    """``LLM_MODELS`` cannot be used; the message names the entry and never carries a key."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One configured model. ``base_url`` None is the built-in demo model."""

    name: str
    model: str
    base_url: str | None = None
    api_key: str | None = None
    abilities: Mapping[str, bool] | None = None
    timeout_s: float = 60.0
    max_retries: int = 3
    fallback: str | None = None
    provider: str | None = None

    def public(self, *, default: bool) -> dict[str, Any]:
        """What ``GET /api/models`` shows of it: never the key, nor where it is served."""
        return {
            "name": self.name,
            "model": self.model,
            "abilities": dict(self.abilities or {}),
            "default": default,
        }

    def __repr__(self) -> str:  # a spec in a log line or a traceback must not show its key
        return f"ModelSpec(name={self.name!r}, model={self.model!r})"


def parse_abilities(value: object, where: str) -> dict[str, bool]:
    if isinstance(value, str):
        names = [a.strip() for a in value.split(",") if a.strip()]
    elif isinstance(value, list) and all(isinstance(a, str) for a in value):
        names = [a.strip() for a in value]
    elif isinstance(value, Mapping) and all(isinstance(v, bool) for v in value.values()):
        names = [k for k, v in value.items() if v]
    else:
        raise ModelConfigError(f"{where}: abilities must be a list of {', '.join(ABILITY_NAMES)}")
    unknown = sorted(set(names) - set(ABILITY_NAMES))
    if unknown:
        raise ModelConfigError(f"{where}: unknown abilities {unknown}; known: {', '.join(ABILITY_NAMES)}")
    return {a: a in names for a in ABILITY_NAMES}


def parse_models(raw: str, defaults: ModelSpec) -> list[ModelSpec]:
    """``LLM_MODELS`` as specs, checked; ``defaults`` gives what an entry leaves out."""
    try:
        entries = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"LLM_MODELS is not valid JSON: {exc.msg} at character {exc.pos}") from None
    if not isinstance(entries, list) or not entries:
        raise ModelConfigError("LLM_MODELS must be a non-empty JSON list of model objects")
    specs: list[ModelSpec] = []
    for index, entry in enumerate(entries):
        label = f"LLM_MODELS entry {index + 1}"
        if not isinstance(entry, Mapping):
            raise ModelConfigError(f"{label} is not a JSON object")
        name = entry.get("name")
        if isinstance(name, str):
            label += f" ({name!r})"
        specs.append(_entry(entry, label, defaults))
    _check_names_and_fallbacks(specs)
    return specs


def _entry(entry: Mapping[str, Any], label: str, defaults: ModelSpec) -> ModelSpec:
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise ModelConfigError(f"{label}: unknown fields {unknown}")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ModelConfigError(
            f"{label}: name must be 1-100 letters, digits or ._:/- (starting with one of the first two)"
        )
    model = entry.get("model")
    if not isinstance(model, str) or not model.strip():
        raise ModelConfigError(f"{label}: model (the provider's model name) is required")
    base_url = _optional_str(entry, "base_url", label)
    if base_url is None or not base_url.startswith(("http://", "https://")):
        raise ModelConfigError(f"{label}: base_url must be the provider's http(s) URL")
    api_key = _optional_str(entry, "api_key", label)
    provider = _optional_str(entry, "provider", label)
    if provider is not None and provider.lower() not in PROFILES:
        raise ModelConfigError(
            f"{label}: unknown provider {provider!r}; one of: {', '.join(sorted(PROFILES))}"
        )
    timeout_s = entry.get("timeout_s", defaults.timeout_s)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ModelConfigError(f"{label}: timeout_s must be a positive number of seconds")
    max_retries = entry.get("max_retries", defaults.max_retries)
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or not 0 <= max_retries <= 20:
        raise ModelConfigError(f"{label}: max_retries must be an integer from 0 to 20")
    abilities = (
        parse_abilities(entry["abilities"], label) if "abilities" in entry else dict(defaults.abilities or {})
    )
    fallback = _optional_str(entry, "fallback", label)
    return ModelSpec(
        name=name,
        model=model.strip(),
        base_url=base_url,
        api_key=api_key,
        abilities=abilities,
        timeout_s=float(timeout_s),
        max_retries=max_retries,
        fallback=fallback,
        provider=provider,
    )


def _optional_str(entry: Mapping[str, Any], key: str, label: str) -> str | None:
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ModelConfigError(f"{label}: {key} must be a string")
    return value.strip() or None


def _check_names_and_fallbacks(specs: Sequence[ModelSpec]) -> None:
    by_name: dict[str, ModelSpec] = {}
    for spec in specs:
        if spec.name == RESERVED_NAME:
            raise ModelConfigError(
                f"LLM_MODELS: {RESERVED_NAME!r} is what /v1 calls the default model; name the entry otherwise"
            )
        if spec.name in by_name:
            raise ModelConfigError(f"LLM_MODELS: two entries are named {spec.name!r}")
        by_name[spec.name] = spec
    for spec in specs:
        if spec.fallback is None:
            continue
        target = by_name.get(spec.fallback)
        if target is None:
            raise ModelConfigError(
                f"LLM_MODELS entry {spec.name!r}: fallback {spec.fallback!r} names no entry"
            )
        # A run keeps the mode its model's abilities chose (native tool calls, JSON mode), and a
        # streamed answer must be able to stream on the fallback too.
        missing = [
            a for a, on in (spec.abilities or {}).items() if on and not (target.abilities or {}).get(a)
        ]
        if missing:
            raise ModelConfigError(
                f"LLM_MODELS entry {spec.name!r}: its fallback {target.name!r} lacks {', '.join(missing)}"
            )
        seen = [spec.name]
        step: ModelSpec | None = target
        while step is not None:
            if step.name in seen:
                raise ModelConfigError(f"LLM_MODELS: fallbacks loop ({' -> '.join([*seen, step.name])})")
            seen.append(step.name)
            step = by_name.get(step.fallback) if step.fallback is not None else None


class ModelRegistry:
    """One LLM per configured model, built once; see the module docstring."""

    def __init__(self, specs: Sequence[ModelSpec], llms: Mapping[str, LLM]) -> None:
        if not specs:
            raise ValueError("a registry needs at least one model")
        self._specs = {spec.name: spec for spec in specs}
        self._llms = dict(llms)
        self.default = specs[0].name

    @property
    def names(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def llm(self, name: str) -> LLM:
        return self._llms[name]

    def spec(self, name: str) -> ModelSpec:
        return self._specs[name]

    def resolve(self, name: str | None) -> str:
        """``name`` if configured, the default for None or a name no longer configured."""
        return name if name is not None and name in self._specs else self.default

    def public(self) -> list[dict[str, Any]]:
        return [spec.public(default=spec.name == self.default) for spec in self._specs.values()]

    def chain(self, name: str) -> list[str]:
        """``name`` and the fallbacks a call of it may go to, in order."""
        names = [name]
        step = self._specs[name].fallback
        while step is not None and step not in names:
            names.append(step)
            step = self._specs[step].fallback
        return names

    def for_run(self, name: str, on_fallback: OnFallback | None = None) -> LLM:
        """The LLM a run of model ``name`` makes every call with (E-02)."""
        chain = self.chain(name)
        if len(chain) == 1:
            return self._llms[name]
        return FallbackLLM([(n, self._llms[n]) for n in chain], on_fallback)

    async def aclose(self) -> None:
        for name, llm in self._llms.items():
            close = getattr(llm, "aclose", None)
            if close is None:
                continue
            try:
                await close()
            except Exception:  # one model's client must not keep the others open
                logger.warning("closing model %s failed", name, exc_info=True)


class FallbackLLM:
    """A model and its fallbacks, as one LLM: a call unavailable on one goes to the next, once."""

    def __init__(self, chain: Sequence[tuple[str, LLM]], on_fallback: OnFallback | None) -> None:
        self._chain = list(chain)
        self._on_fallback = on_fallback

    @property
    def abilities(self) -> Mapping[str, bool]:
        return self._chain[0][1].abilities

    @property
    def model_name(self) -> str:
        return self._chain[0][1].model_name

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        response_format: Mapping[str, Any] | None = None,
    ) -> ChatResult:
        failed = 0  # calls made on the models that failed: they count too (usage: llm_calls)
        for index, (name, llm) in enumerate(self._chain):
            try:
                result = await llm.chat(
                    messages, tools=tools, tool_choice=tool_choice, response_format=response_format
                )
            except LLMUnavailableError as exc:
                if index + 1 == len(self._chain):
                    raise _counting(exc, failed) from None
                failed += exc.attempts
                await self._fell_back(name, self._chain[index + 1][0])
                continue
            except LLMError as exc:  # refused or unusable: never a fallback
                raise _counting(exc, failed) from None
            return replace(result, attempts=result.attempts + failed) if failed else result
        raise AssertionError("unreachable: the chain is never empty")

    async def stream_chat(self, messages: Sequence[ChatMessage]) -> AsyncIterator[StreamItem]:
        failed = 0
        for index, (name, llm) in enumerate(self._chain):
            sent = False
            try:
                # Closed with this generator: a stream abandoned midway closes its connection now.
                stream = llm.stream_chat(messages)
                try:
                    async for item in stream:
                        if isinstance(item, StreamEnd):
                            item = replace(item, attempts=item.attempts + failed)
                        else:
                            sent = True
                        yield item
                finally:
                    close = getattr(stream, "aclose", None)
                    if close is not None:
                        await close()
                return
            except LLMUnavailableError as exc:
                # Once a token reached the user, another model cannot carry the answer on.
                if sent or index + 1 == len(self._chain):
                    raise _counting(exc, failed) from None
                failed += exc.attempts
                await self._fell_back(name, self._chain[index + 1][0])
            except LLMError as exc:
                raise _counting(exc, failed) from None

    async def _fell_back(self, from_model: str, to_model: str) -> None:
        if self._on_fallback is not None:
            await self._on_fallback(from_model, to_model)


def _counting(exc: LLMError, failed: int) -> LLMError:
    """``exc`` with the calls of the models that failed before it added to its attempts."""
    if failed:
        exc.attempts = getattr(exc, "attempts", 1) + failed  # type: ignore[attr-defined]
    return exc
