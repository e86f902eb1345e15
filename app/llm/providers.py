"""Provider profiles: what each family of OpenAI-compatible servers needs, in one place.

The engine speaks one dialect (``ChatMessage``, ``ToolCall``); what a provider adds to it or refuses
of it lives here, as a ``ProviderProfile`` chosen from the base URL and the model name (or named
by ``LLM_PROVIDER``). A profile decides the request side (``wire_messages``: the history as this
provider accepts it) and how a reply's text is read (``think_tags``); everything a reply may carry
that is harmless to look for anywhere (reasoning fields, content blocks, tool calls in any choice,
usage wherever it is put) is read for every provider by ``app.llm.replies``.

What each family needs, and where that comes from:

* DeepSeek (thinking mode, ``deepseek-reasoner`` and the V3.2+/V4 models with thinking on): the
  next request of a tool loop is refused (400 "The reasoning_content in the thinking mode must be
  passed back to the API") unless every assistant message that called tools carries its
  ``reasoning_content`` back (api-docs.deepseek.com/guides/thinking_mode, "Tool Calls").
* Gemini through its OpenAI-compatible endpoint: Gemini 3 refuses a function call sent back without
  the thought signature it came with, which that endpoint puts in the tool call's
  ``extra_content.google.thought_signature`` (ai.google.dev/gemini-api/docs/thought-signatures).
* Mistral (its API, and Mistral models wherever they are served with Mistral's tokenizer, vLLM's
  ``--tokenizer-mode mistral`` included): a ``user`` message right after a ``tool`` message is
  refused ("Unexpected role 'user' after role 'tool'", code 3230), and tool call ids must be nine
  characters of ``[a-zA-Z0-9]``.
* Servers that run reasoning models without a reasoning parser (vLLM, SGLang, llama.cpp, Ollama,
  LM Studio, Together, Groq's ``raw`` format, many gateways): the thinking arrives in ``content`` as
  ``<think>...</think>``, or only the closing tag when the chat template opened it (QwQ, Qwen3
  thinking-2507, DeepSeek-R1 and its distills): ``think_tags``, and ``opens_thinking``.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from app.llm.base import ChatMessage, ToolCall

# What an assistant says between a tool result and a user message for providers that refuse the
# two side by side: neutral, short, and not something a model would take as an instruction.
ASSISTANT_BRIDGE = "Noted."

_NINE_ID = re.compile(r"[A-Za-z0-9]{9}")
# Models whose chat template opens the thinking tag in the prompt, so that the reply starts inside
# it and only the closing tag arrives.
_OPENS_THINKING = re.compile(
    r"qwq|deepseek[-_]?r1|r1[-_]distill|thinking[-_]?2507|qwen3.*thinking|glm-?z1", re.IGNORECASE
)
_MISTRAL_MODEL = re.compile(r"mistral|magistral|ministral|codestral|devstral|pixtral", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ProviderProfile:
    """The adaptations one family of providers needs. See the module docstring for each."""

    name: str
    think_tags: bool = True
    """``<think>...</think>`` at the start of ``content`` is the model's thinking, not its answer."""
    opens_thinking: bool = False
    """The model's reply starts inside the thinking: text before a lone ``</think>`` is thinking."""
    reasoning_back: bool = False
    """Assistant messages carry their ``reasoning_content`` back (DeepSeek thinking mode)."""
    call_fields_back: tuple[str, ...] = ()
    """Fields of a tool call kept from the reply and sent back with it (Gemini: ``extra_content``)."""
    assistant_after_tool: bool = False
    """Never a ``user`` message right after a ``tool`` message (Mistral)."""
    tool_call_id_length: int | None = None
    """Tool call ids must be exactly this many ``[a-zA-Z0-9]`` characters (Mistral: 9)."""
    api_key_header: bool = False
    """Send the key as an ``api-key`` header too (Azure's dated API versions read only that)."""

    def wire_messages(self, messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
        """The history as this provider accepts it (the engine's own copy is never changed)."""
        out: list[dict[str, Any]] = []
        previous_role: str | None = None
        for message in messages:
            if self.assistant_after_tool and message.role == "user" and previous_role == "tool":
                out.append({"role": "assistant", "content": ASSISTANT_BRIDGE})
            out.append(self._wire_message(message))
            previous_role = message.role
        return out

    def _wire_message(self, message: ChatMessage) -> dict[str, Any]:
        # The plain OpenAI form, with what this provider needs changed or added.
        wire = message.to_openai()
        if message.tool_calls and (self.tool_call_id_length or self.call_fields_back):
            wire["tool_calls"] = [self._wire_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None and self.tool_call_id_length:
            wire["tool_call_id"] = self._call_id(message.tool_call_id)
        if self.reasoning_back and message.role == "assistant" and (message.reasoning or message.tool_calls):
            # A tool-calling message stored before its reasoning was kept still needs the field.
            wire["reasoning_content"] = message.reasoning or ""
        return wire

    def _wire_call(self, call: ToolCall) -> dict[str, Any]:
        wire = call.to_openai()
        wire["id"] = self._call_id(call.id)
        if call.extra and self.call_fields_back:
            wire.update({k: v for k, v in call.extra.items() if k in self.call_fields_back})
        return wire

    def _call_id(self, call_id: str) -> str:
        length = self.tool_call_id_length
        if length is None or (length == 9 and _NINE_ID.fullmatch(call_id)):
            return call_id
        # The same id always maps to the same short one: the assistant's call and its tool result
        # keep matching, in this request and the next.
        digest = base64.b32encode(hashlib.sha256(call_id.encode()).digest()).decode().rstrip("=")
        return digest[:length]

    def kept_call_fields(self, raw_call: Mapping[str, Any]) -> dict[str, Any] | None:
        """The fields of a reply's tool call to keep for sending back, if any."""
        kept = {k: raw_call[k] for k in self.call_fields_back if raw_call.get(k) is not None}
        return kept or None


_BASE = ProviderProfile("openai-compatible")

PROFILES: dict[str, ProviderProfile] = {
    "openai": ProviderProfile("openai", think_tags=False),
    # Azure serves DeepSeek-R1 too, its thinking in <think> tags (Azure AI model inference docs).
    "azure": ProviderProfile("azure", api_key_header=True),
    "deepseek": ProviderProfile("deepseek", reasoning_back=True),
    "gemini": ProviderProfile("gemini", think_tags=False, call_fields_back=("extra_content",)),
    "mistral": ProviderProfile("mistral", assistant_after_tool=True, tool_call_id_length=9),
    "groq": ProviderProfile("groq"),
    "openrouter": ProviderProfile("openrouter"),
    "together": ProviderProfile("together"),
    "vllm": ProviderProfile("vllm"),
    "sglang": ProviderProfile("sglang"),
    "ollama": ProviderProfile("ollama"),
    "lmstudio": ProviderProfile("lmstudio"),
    "llamacpp": ProviderProfile("llamacpp"),
    "openai-compatible": _BASE,
}
"""Every profile by the name ``LLM_PROVIDER`` takes. The self-hosted servers and most gateways
need what the generic profile does: their names are there so that a deployment can say what it
talks to (and a later difference has its place), and are never guessed from a port."""

# Host suffixes of the hosted providers.
_HOSTS: tuple[tuple[str, str], ...] = (
    ("api.openai.com", "openai"),
    ("openai.azure.com", "azure"),
    ("cognitiveservices.azure.com", "azure"),
    ("services.ai.azure.com", "azure"),
    ("api.deepseek.com", "deepseek"),
    ("generativelanguage.googleapis.com", "gemini"),
    ("api.mistral.ai", "mistral"),
    ("api.groq.com", "groq"),
    ("openrouter.ai", "openrouter"),
    ("api.together.xyz", "together"),
    ("api.together.ai", "together"),
)


def profile_for(base_url: str | None, model: str, provider: str | None = None) -> ProviderProfile:
    """The profile for a model at ``base_url``: ``provider`` when named, else found from both.

    Raises ``ValueError`` for an unknown ``provider`` name.
    """
    if provider:  # named: exactly that profile, nothing guessed
        try:
            return PROFILES[provider.strip().lower()]
        except KeyError:
            raise ValueError(
                f"unknown LLM provider {provider!r}; known: {', '.join(sorted(PROFILES))}"
            ) from None
    profile = _from_url(base_url)
    if profile.think_tags and _OPENS_THINKING.search(model):
        profile = replace(profile, opens_thinking=True)
    if profile.name != "mistral" and _MISTRAL_MODEL.search(model):
        # Mistral's models keep Mistral's rules wherever they are served (a gateway passes them
        # through; vLLM's Mistral tokenizer mode enforces them).
        profile = replace(profile, assistant_after_tool=True, tool_call_id_length=9)
    return profile


def _from_url(base_url: str | None) -> ProviderProfile:
    if not base_url:
        return PROFILES["openai"]
    parts = urlsplit(base_url)
    host = (parts.hostname or "").lower()
    for suffix, name in _HOSTS:
        if host == suffix or host.endswith("." + suffix):
            return PROFILES[name]
    if "/openai/deployments/" in parts.path:
        return PROFILES["azure"]
    return _BASE
