"""Fake providers for ``tests.support.fake_openai.FakeOpenAIServer``: one per family of
OpenAI-compatible servers, each speaking that family's real wire shapes.

Every fake is a handler (``server.set_handler(fake)``) that plays the same small, well-behaved
agent (``tests.support.fake_provider_agent.ProviderAgent``), so that a run through the service
ends with an answer the test knows:

* a loop call whose turn (the messages after the last question ``"What is <expr>?"``, or
  ``"What is <expr>, then <expr>?"`` for two steps) has no calculator result yet calls the
  ``calculator`` tool with the next expression (native mode: a tool call; JSON mode: a
  ``tool_call`` action in the text);
* once every expression has its result, it answers ``"The answer is <value>."`` with the value of
  the result that answers its *latest* call, found by that call's id (native) or as the latest
  observation (JSON mode): results that answer the wrong call give a wrong answer;
* a streamed call (synthesis) streams the same sentence, read from the ``Result:`` lines of the
  trace the request carries.

Each family adds what its provider adds (the thinking where that provider puts it, usage where it
reports it, its ids, its error shapes) and REFUSES what the real provider refuses, with the real
provider's status and error body. Every shape names the public source it comes from. What a fake
served is kept for the tests: ``thoughts`` (every piece of thinking, in order), ``reported`` (the
usage of every reply, as the provider meant it: the final count of a stream, once),
``refusals`` (the request bodies it refused), ``served_ids`` and the per-family records below.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Literal

import orjson

from tests.support.fake_provider_agent import (
    ALNUM,
    DONE_LINE,
    ProviderAgent,
    data_line,
    json_reply,
    messages_of,
    pieces,
    sse_reply,
    wants_usage,
)
from tests.support.fake_replies import FakeReply, split_words


class DeepSeekThinking(ProviderAgent):
    """DeepSeek in thinking mode (``deepseek-reasoner``, V3.2+ with thinking on).

    api-docs.deepseek.com/guides/thinking_mode: the thinking is ``reasoning_content``, beside
    ``content`` (in stream deltas ``content`` is null while it thinks); "for turns that do perform
    tool calls, the reasoning_content must be fully passed back to the API in all subsequent
    requests", else a 400 whose body is quoted in e.g. crewAIInc/crewAI#5878 and
    MGdaasLab/WHartTest#95. Usage (with DeepSeek's cache counters) comes on the stream's finish
    chunk.
    """

    model = "deepseek-reasoner"
    thinks = True
    REFUSAL: ClassVar[dict[str, Any]] = {
        "error": {
            "message": "The `reasoning_content` in the thinking mode must be passed back to the API.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_request_error",
        }
    }

    def __init__(self, *, model: str | None = None) -> None:
        super().__init__(model=model)
        self.reasoning_of_call: dict[str, str] = {}
        """The thinking served with each tool call, by the call's id."""

    def refuse(self, body: Mapping[str, Any]) -> FakeReply | None:
        for message in messages_of(body):
            if message.get("role") == "assistant" and message.get("tool_calls"):
                if message.get("reasoning_content") is None:
                    return json_reply(self.REFUSAL, status=400)
        return None

    def call_id(self) -> str:
        call_id = "call_00_" + "".join(secrets.choice(ALNUM) for _ in range(24))
        self.served_ids.append(call_id)
        return call_id

    def usage(self, *, record: bool = True) -> dict[str, int]:
        usage = super().usage(record=record)
        return {
            **usage,
            "prompt_cache_hit_tokens": 64,
            "prompt_cache_miss_tokens": usage["prompt_tokens"] - 64,
        }

    def message(self, content: str | None, call: dict[str, Any] | None, thinking: str) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content or "",
            "reasoning_content": thinking,
        }
        if call is not None:
            message["tool_calls"] = [call]
            self.reasoning_of_call[call["id"]] = thinking
        return message

    def stream(self, body: Mapping[str, Any], answer: str, thinking: str) -> FakeReply:
        lines = [data_line(self.chunk({"role": "assistant", "content": None, "reasoning_content": ""}))]
        lines += [
            data_line(self.chunk({"content": None, "reasoning_content": piece}))
            for piece in split_words(thinking)
        ]
        lines += [
            data_line(self.chunk({"content": piece, "reasoning_content": None}))
            for piece in split_words(answer)
        ]
        finish = self.chunk({"content": "", "reasoning_content": None}, "stop")
        if wants_usage(body):
            finish["usage"] = self.usage()
        lines += [data_line(finish), DONE_LINE]
        return sse_reply(lines)


# -- Gemini -------------------------------------------------------------------------------------


class GeminiOpenAI(ProviderAgent):
    """Gemini 3 through its OpenAI-compatible endpoint (``/v1beta/openai``).

    ai.google.dev/gemini-api/docs/thought-signatures ("OpenAI compatibility"): each function call
    of a reply carries ``extra_content: {"google": {"thought_signature": ...}}`` (the first one of
    parallel calls); function calling is validated strictly "on the current turn" (the steps since
    the last user message): a call sent back without its signature is refused with a 400. The
    error body, a JSON list, is quoted in discuss.ai.google.dev/t/.../109823; a signature the API
    never gave is refused as corrupted (docs.apiyi.com, "Gemini thought signature missing").
    ``key_valid=False``: every request is refused as the endpoint refuses a wrong key, in the same
    list form (continuedev/continue#8516).
    """

    model = "gemini-3-pro-preview"
    BAD_KEY = "API key not valid. Please pass a valid API key."

    def __init__(self, *, model: str | None = None, key_valid: bool = True) -> None:
        super().__init__(model=model)
        self.key_valid = key_valid
        self.signature_of_call: dict[str, str] = {}

    def refuse(self, body: Mapping[str, Any]) -> FakeReply | None:
        if not self.key_valid:
            return self._error(self.BAD_KEY)
        messages = messages_of(body)
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        for position, message in enumerate(messages[last_user + 1 :], start=last_user + 2):
            calls = message.get("tool_calls") if message.get("role") == "assistant" else None
            if not calls:
                continue
            first = calls[0]
            extra = first.get("extra_content")
            google = extra.get("google") if isinstance(extra, Mapping) else None
            signature = google.get("thought_signature") if isinstance(google, Mapping) else None
            name = (first.get("function") or {}).get("name")
            if signature is None:
                text = (
                    "Function call is missing a thought_signature in functionCall parts. This is"
                    " required for tools to work correctly, and missing thought_signature may lead to"
                    f" degraded model performance. Additional data, function call `default_api:{name}`"
                    f" , position {position}. Please refer to"
                    " https://ai.google.dev/gemini-api/docs/thought-signatures for more details."
                )
                return self._error(text)
            if signature not in self.signature_of_call.values():
                return self._error("Corrupted thought signature.")
        return None

    @staticmethod
    def _error(message: str) -> FakeReply:
        return json_reply([{"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}], 400)

    def call_id(self) -> str:
        call_id = f"function-call-{secrets.randbelow(10**19)}"
        self.served_ids.append(call_id)
        return call_id

    def tool_call(self, expression: str) -> dict[str, Any]:
        call = super().tool_call(expression)
        signature = "CiQB" + secrets.token_urlsafe(24)
        self.signature_of_call[call["id"]] = signature
        return {"extra_content": {"google": {"thought_signature": signature}}, **call}


# -- Mistral ------------------------------------------------------------------------------------


class MistralChat(ProviderAgent):
    """Mistral's API (api.mistral.ai), and Magistral with ``magistral=True``.

    Refusals, with the bodies Mistral sends: a ``user`` message right after a ``tool`` message
    (datapizza-labs/datapizza-ai#98, BerriAI/litellm#17761: code 3230) and a tool call id that is
    not nine characters of [a-zA-Z0-9] (nearai/ironclaw#1241, editor-code-assistant/eca#233:
    code 3280). Mistral's own ids are nine such characters; ``ids="gateway"`` serves a Mistral
    model behind a gateway that hands out OpenAI-style ids (``call_...``, as in
    karthink/gptel#1203) while the model behind it keeps Mistral's rule. Magistral's content is
    a list of chunks, ``thinking`` (itself a list of text chunks) then ``text``
    (docs.mistral.ai/capabilities/reasoning); its stream deltas carry the same chunks. Usage
    comes on the last chunk of a stream.
    """

    model = "mistral-large-latest"
    ORDER_REFUSAL: ClassVar[dict[str, Any]] = {
        "object": "error",
        "message": "Unexpected role 'user' after role 'tool'",
        "type": "invalid_request_message_order",
        "param": None,
        "code": "3230",
    }
    _NINE = re.compile(r"[A-Za-z0-9]{9}")

    def __init__(
        self,
        *,
        model: str | None = None,
        magistral: bool = False,
        ids: Literal["mistral", "gateway"] = "mistral",
    ) -> None:
        super().__init__(model=model or ("magistral-medium-latest" if magistral else None))
        self.magistral = magistral
        self.thinks = magistral
        self.ids = ids

    def refuse(self, body: Mapping[str, Any]) -> FakeReply | None:
        previous: str | None = None
        for message in messages_of(body):
            role = message.get("role")
            if role == "user" and previous == "tool":
                return json_reply(self.ORDER_REFUSAL, status=400)
            ids = [c.get("id") for c in message.get("tool_calls") or ()]
            if role == "tool":
                ids.append(message.get("tool_call_id"))
            for call_id in ids:
                if not (isinstance(call_id, str) and self._NINE.fullmatch(call_id)):
                    text = f"Tool call id was {call_id} but must be a-z, A-Z, 0-9, with a length of 9."
                    refusal = {
                        "object": "error",
                        "message": text,
                        "type": "invalid_function_call",
                        "param": None,
                        "code": "3280",
                    }
                    return json_reply(refusal, status=400)
            previous = role
        return None

    def call_id(self) -> str:
        if self.ids == "gateway":
            return super().call_id()
        call_id = "".join(secrets.choice(ALNUM) for _ in range(9))
        self.served_ids.append(call_id)
        return call_id

    def tool_call(self, expression: str) -> dict[str, Any]:
        return {**super().tool_call(expression), "index": 0}

    def _content(self, text: str | None, thinking: str) -> str | list[dict[str, Any]] | None:
        if not self.magistral:
            return text if text is not None else ""
        blocks: list[dict[str, Any]] = [
            {"type": "thinking", "thinking": [{"type": "text", "text": thinking}]}
        ]
        if text:
            blocks.append({"type": "text", "text": text})
        return blocks

    def message(self, content: str | None, call: dict[str, Any] | None, thinking: str) -> dict[str, Any]:
        return {
            "role": "assistant",
            "tool_calls": [call] if call is not None else None,
            "content": self._content(content, thinking),
        }

    def stream(self, body: Mapping[str, Any], answer: str, thinking: str) -> FakeReply:
        lines = [data_line(self.chunk({"role": "assistant", "content": ""}))]
        if self.magistral:
            lines += [
                data_line(
                    self.chunk({"content": [{"type": "thinking", "thinking": [{"type": "text", "text": p}]}]})
                )
                for p in split_words(thinking)
            ]
            lines += [
                data_line(self.chunk({"content": [{"type": "text", "text": p}]})) for p in split_words(answer)
            ]
        else:
            lines += [data_line(self.chunk({"content": p})) for p in split_words(answer)]
        lines += [data_line(self.chunk({"content": ""}, "stop", usage=self.usage())), DONE_LINE]
        return sse_reply(lines)


# -- reasoning models served without a reasoning parser -----------------------------------------


class ThinkTagServer(ProviderAgent):
    """vLLM, SGLang, llama.cpp or Ollama serving Qwen3 or a DeepSeek-R1 distill with no reasoning
    parser: the thinking is at the start of ``content`` as ``<think>...</think>``
    (qwen.readthedocs.io, "Qwen3" on vLLM/SGLang without ``--reasoning-parser``;
    docs.vllm.ai/en/latest/features/reasoning_outputs.html). ``opened=True``: the chat template
    opened the tag in the prompt, so only ``</think>`` arrives (DeepSeek-R1's updated template,
    huggingface.co/deepseek-ai/DeepSeek-R1 "Usage Recommendations"; QwQ, Qwen3 thinking-2507).
    Streams cut the text in a few characters a chunk, so the tags arrive split. In JSON mode the
    thinking drafts a different action than the one the reply takes.

    ``continuous_usage``: usage, cumulative, on every chunk (vLLM's
    ``stream_options.continuous_usage_stats``, docs.vllm.ai "OpenAI-Compatible Server", which
    some gateways turn on), then the usage chunk. ``cut_after``: the stream stops after that many
    characters of the answer with ``finish_reason: "length"`` (``max_tokens`` reached).
    """

    model = "Qwen/Qwen3-32B"
    thinks = True

    def __init__(
        self,
        *,
        model: str | None = None,
        opened: bool = False,
        continuous_usage: bool = False,
        cut_after: int | None = None,
        chunk_chars: int = 4,
    ) -> None:
        super().__init__(model=model)
        self.opened = opened
        self.continuous_usage = continuous_usage
        self.cut_after = cut_after
        self.chunk_chars = chunk_chars

    def _tagged(self, thinking: str, text: str) -> str:
        head = "" if self.opened else "<think>\n"
        return f"{head}{thinking}\n</think>\n\n{text}"

    def message(self, content: str | None, call: dict[str, Any] | None, thinking: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self._tagged(thinking, content or "")}
        if call is not None:
            message["tool_calls"] = [call]
        return message

    def stream(self, body: Mapping[str, Any], answer: str, thinking: str) -> FakeReply:
        finish = "stop"
        if self.cut_after is not None:
            answer, finish = answer[: self.cut_after], "length"
        text = self._tagged(thinking, answer)
        parts = pieces(text, self.chunk_chars)
        final = self.usage(record=wants_usage(body) or self.continuous_usage)
        lines = []
        for index, part in enumerate(parts, start=1):
            extra: dict[str, Any] = {}
            if self.continuous_usage:
                done = final["completion_tokens"] * index // len(parts)
                extra["usage"] = {
                    "prompt_tokens": final["prompt_tokens"],
                    "completion_tokens": done,
                    "total_tokens": final["prompt_tokens"] + done,
                }
            lines.append(data_line(self.chunk({"content": part}, **extra)))
        tail: dict[str, Any] = {"usage": final} if self.continuous_usage else {}
        lines.append(data_line(self.chunk({}, finish, **tail)))
        if wants_usage(body):
            lines.append(data_line({**self.chunk({}), "choices": [], "usage": final}))
        lines.append(DONE_LINE)
        return sse_reply(lines)


# -- OpenRouter ---------------------------------------------------------------------------------


class OpenRouterChat(ProviderAgent):
    """OpenRouter (openrouter.ai/api/v1).

    The thinking is ``reasoning`` (with ``reasoning_details``) in messages and deltas
    (openrouter.ai/docs/use-cases/reasoning-tokens); streams start with ``: OPENROUTER PROCESSING``
    comments (openrouter.ai/docs/api-reference/streaming). Errors once the model started are a 200:
    in a stream an error chunk ``{"error": {"code", "message"}, "choices": [{"finish_reason":
    "error", ...}]}`` ("Handling Errors During Streaming", same page), otherwise a body
    ``{"error": {"code", "message", "metadata"}}`` (openrouter.ai/docs/errors).
    ``error_after``: the synthesis stream fails after that many words of the answer;
    ``rate_limited``: that many first loop calls get a 200 rate-limit error body.
    """

    model = "openai/gpt-oss-120b"
    thinks = True
    STREAM_ERROR = "Provider disconnected unexpectedly"
    RATE_LIMIT = "openai/gpt-oss-120b is temporarily rate-limited upstream. Please retry shortly."

    def __init__(
        self, *, model: str | None = None, error_after: int | None = None, rate_limited: int = 0
    ) -> None:
        super().__init__(model=model)
        self.error_after = error_after
        self.rate_limited = rate_limited

    def __call__(self, body: dict[str, Any]) -> FakeReply:
        if self.rate_limited > 0 and not body.get("stream"):
            self.rate_limited -= 1
            error = {
                "error": {
                    "code": 429,
                    "message": self.RATE_LIMIT,
                    "metadata": {"provider_name": "DeepInfra", "raw": "rate limit exceeded"},
                },
                "user_id": "user_2yzFakeUser",
            }
            return json_reply(error)
        return super().__call__(body)

    def completion(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**super().completion(choices), "provider": "DeepInfra", "system_fingerprint": None}

    def message(self, content: str | None, call: dict[str, Any] | None, thinking: str) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content or "",
            "refusal": None,
            "reasoning": thinking,
            "reasoning_details": [
                {"type": "reasoning.text", "text": thinking, "format": "unknown", "index": 0}
            ],
        }
        if call is not None:
            message["tool_calls"] = [{**call, "index": 0}]
        return message

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {**super().chunk(delta, finish, **extra), "provider": "DeepInfra"}

    def stream(self, body: Mapping[str, Any], answer: str, thinking: str) -> FakeReply:
        lines = [b": OPENROUTER PROCESSING\n\n", b": OPENROUTER PROCESSING\n\n"]
        lines += [
            data_line(
                self.chunk(
                    {
                        "role": "assistant",
                        "content": "",
                        "reasoning": p,
                        "reasoning_details": [{"type": "reasoning.text", "text": p, "index": 0}],
                    }
                )
            )
            for p in split_words(thinking)
        ]
        words = split_words(answer)
        for index, piece in enumerate(words):
            if self.error_after is not None and index == self.error_after:
                error = self.chunk({"content": ""}, "error")
                error["error"] = {"code": "server_error", "message": self.STREAM_ERROR}
                lines.append(data_line(error))
                return sse_reply(lines)
            lines.append(data_line(self.chunk({"role": "assistant", "content": piece, "reasoning": None})))
        lines.append(data_line(self.chunk({"role": "assistant", "content": ""}, "stop")))
        lines += [data_line(self.usage_chunk()), DONE_LINE]
        return sse_reply(lines)


# -- Groq ---------------------------------------------------------------------------------------


class GroqChat(ProviderAgent):
    """Groq (api.groq.com/openai/v1): in a stream, usage only in the last chunk's ``x_groq.usage``
    (with Groq's timings), nowhere else: the chunk quoted in vercel/ai#1651. Replies carry
    ``x_groq.id``."""

    model = "llama-3.3-70b-versatile"

    def completion(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        reply = super().completion(choices)
        reply["usage"] = {**reply["usage"], "queue_time": 0.02, "prompt_time": 0.01, "completion_time": 0.05}
        return {**reply, "system_fingerprint": "fp_3f3b593e33", "x_groq": {"id": "req_01fakegroq"}}

    def stream(self, body: Mapping[str, Any], answer: str, thinking: str) -> FakeReply:
        lines = [data_line(self.chunk({"role": "assistant", "content": ""}, x_groq={"id": "req_01fakegroq"}))]
        lines += [data_line(self.chunk({"content": p})) for p in split_words(answer)]
        usage = {**self.usage(), "queue_time": 0.02, "prompt_time": 0.01, "completion_time": 0.05}
        lines.append(data_line(self.chunk({}, "stop", x_groq={"id": "req_01fakegroq", "usage": usage})))
        lines.append(DONE_LINE)
        return sse_reply(lines)


# -- llama.cpp ----------------------------------------------------------------------------------


class LlamaCppServer(ProviderAgent):
    """llama.cpp's ``llama-server``: an error while streaming is an ``error:`` line, not ``data:``
    (tools/server/server.cpp: ``server_sent_event(sink, "error", ...)`` writes
    ``"error: " + json``; the JSON is ``format_error_response``: ``code``, ``message``, ``type``).
    ``error_after``: the synthesis stream fails after that many words of the answer."""

    model = "qwen2.5-7b-instruct-q4_k_m.gguf"
    STREAM_ERROR = "Failed to parse input at pos 48: <tool_call>"

    def __init__(self, *, model: str | None = None, error_after: int | None = None) -> None:
        super().__init__(model=model)
        self.error_after = error_after

    def completion(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            **super().completion(choices),
            "system_fingerprint": "b6100-fake",
            "timings": {"prompt_n": 12, "prompt_ms": 10.5, "predicted_n": 7, "predicted_ms": 50.1},
        }

    def stream(self, body: Mapping[str, Any], answer: str, thinking: str) -> FakeReply:
        lines = [data_line(self.chunk({"role": "assistant", "content": None}))]
        for index, piece in enumerate(split_words(answer)):
            if self.error_after is not None and index == self.error_after:
                error = {"code": 500, "message": self.STREAM_ERROR, "type": "server_error"}
                lines.append(b"error: " + orjson.dumps(error) + b"\n\n")
                return sse_reply(lines)
            lines.append(data_line(self.chunk({"content": piece})))
        lines.append(data_line(self.chunk({}, "stop")))
        if wants_usage(body):
            lines.append(data_line(self.usage_chunk()))
        lines.append(DONE_LINE)
        return sse_reply(lines)


# -- Azure OpenAI, old API versions -------------------------------------------------------------


class AzureOldApiVersion(ProviderAgent):
    """Azure OpenAI at an API version before ``stream_options`` (2024-02-01 and older): a request
    that sends it is refused with 400 "Unrecognized request argument supplied: stream_options"
    (openai/openai-python#1469 on 2023-05-15, Azure/azure-sdk-for-java#40198; accepted from
    2024-10-21 on, griptape-ai/griptape#1640), and its streams report no usage.
    Replies carry Azure's content filter results; a stream opens with a chunk of empty
    ``choices`` and ``prompt_filter_results`` (learn.microsoft.com/azure/ai-services/openai,
    "content filtering", streaming)."""

    model = "gpt-4o-2024-05-13"
    REFUSAL: ClassVar[dict[str, Any]] = {
        "error": {
            "message": "Unrecognized request argument supplied: stream_options",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    _FILTERS: ClassVar[dict[str, Any]] = {
        name: {"filtered": False, "severity": "safe"} for name in ("hate", "self_harm", "sexual", "violence")
    }

    def refuse(self, body: Mapping[str, Any]) -> FakeReply | None:
        return json_reply(self.REFUSAL, status=400) if "stream_options" in body else None

    def completion(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        for choice in choices:
            choice["content_filter_results"] = self._FILTERS
        return {
            **super().completion(choices),
            "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": self._FILTERS}],
        }

    def stream(self, body: Mapping[str, Any], answer: str, thinking: str) -> FakeReply:
        opening = {
            "id": "",
            "object": "",
            "created": 0,
            "model": "",
            "choices": [],
            "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": self._FILTERS}],
        }
        lines = [data_line(opening), data_line(self.chunk({"role": "assistant", "content": ""}))]
        for piece in split_words(answer):
            chunk = self.chunk({"content": piece})
            chunk["choices"][0]["content_filter_results"] = self._FILTERS
            lines.append(data_line(chunk))
        lines += [data_line(self.chunk({}, "stop")), DONE_LINE]
        return sse_reply(lines)


# -- gateways -----------------------------------------------------------------------------------

Quirk = Literal["split_choices", "lone_index_1", "stop_beside_calls", "empty_ids"]


class QuirkyGateway(ProviderAgent):
    """Gateways and servers that bend the OpenAI shapes, each quirk on its own or together:

    * ``split_choices``: the text in one choice and the tool calls in another, the first saying
      ``finish_reason: "tool_calls"`` (GitHub Copilot's API: ericc-ch/copilot-api#81,
      HKUDS/nanobot#1555);
    * ``lone_index_1``: every reply's only choice has ``index: 1`` (one of the gateway shapes
      issue 15 lists);
    * ``stop_beside_calls``: ``finish_reason: "stop"`` beside tool calls (OpenAI itself with
      ``tool_choice: "required"``, vllm-project/vllm#25054; Ollama before ollama/ollama#5995;
      sgl-project/sglang#2877);
    * ``empty_ids``: every tool call with ``id: ""`` (servers that do not name calls, as
      ml-explore/mlx-lm#1375 and mistralai/client-js#69 describe).
    """

    def __init__(self, quirks: Iterable[Quirk], *, model: str | None = None) -> None:
        super().__init__(model=model)
        self.quirks = frozenset(quirks)

    def call_id(self) -> str:
        if "empty_ids" in self.quirks:
            self.served_ids.append("")
            return ""
        return super().call_id()

    def reply(
        self, body: Mapping[str, Any], content: str | None, call: dict[str, Any] | None, thinking: str
    ) -> FakeReply:
        finish = "tool_calls" if call is not None and "stop_beside_calls" not in self.quirks else "stop"
        if call is not None and "split_choices" in self.quirks:
            choices = [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Let me work that out."},
                    "finish_reason": finish,
                },
                {
                    "index": 1,
                    "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                    "finish_reason": finish,
                },
            ]
        else:
            index = 1 if "lone_index_1" in self.quirks else 0
            choices = [
                {"index": index, "message": self.message(content, call, thinking), "finish_reason": finish}
            ]
        return json_reply(self.completion(choices))

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        chunk = super().chunk(delta, finish, **extra)
        if "lone_index_1" in self.quirks:
            chunk["choices"][0]["index"] = 1
        return chunk
