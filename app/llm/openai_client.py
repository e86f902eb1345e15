"""``OpenAICompatibleLLM``: the LLM protocol over any OpenAI-compatible ``/v1`` endpoint.

Built on ``openai.AsyncOpenAI`` with the SDK's own retries switched off, because retrying is ours:
full-jitter exponential backoff on 429, 408, 409, 5xx, timeouts and connection errors, honouring
``Retry-After`` / ``retry-after-ms`` (capped), then ``LLMUnavailableError``. Replies that cannot be used
(a body that is not JSON, no choices, a wrong shape, any other 4xx) raise ``LLMResponseError`` at once.
A stream is retried only until its first token was yielded, so no token ever reaches a client twice.
Error messages name the status or kind of failure and never carry the API key. What each provider
needs of the request, and how its replies are read, is its profile's (``app.llm.providers``,
``app.llm.replies``, ``app.llm.stream_read``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import aiohttp
import httpx
import openai
import orjson
from aiohttp.helpers import get_env_proxy_for_url
from httpx_aiohttp import AiohttpTransport
from yarl import URL

from app.llm.base import (
    ChatMessage,
    ChatResult,
    LLMRequestRejectedError,
    LLMResponseError,
    LLMUnavailableError,
    StreamEnd,
    StreamItem,
    TextDelta,
    TokenUsage,
)
from app.llm.providers import ProviderProfile, profile_for
from app.llm.replies import ProviderReportedError, parse_completion, template_opens_thinking
from app.llm.stream_read import RAW_BODY, StreamReader, chunks
from app.tls import client_tls

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.openai.com/v1"
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 8.0
RETRY_AFTER_MAX_S = 30.0
"""A provider asking for a longer pause is still retried after this long: a run should not stall."""
RETRYABLE_4XX = frozenset({408, 409, 429})
_SERVER_MESSAGE_MAX = 200
_KEY_LIKE_RE = re.compile(r"(sk-[A-Za-z0-9_\-]{4,}|Bearer\s+\S+)")
# A key is masked only where it stands as a whole token (not inside a longer word or key): a short
# key must never rewrite ordinary words.
_TOKEN_CHARS = r"A-Za-z0-9_\-"
# Without a key the SDK would read OPENAI_API_KEY from the environment; settings are the only source.
_NO_KEY = "not-needed"


@dataclass(frozen=True, slots=True)
class _Failure:
    """One failed attempt, classified."""

    description: str
    retryable: bool
    retry_after_s: float | None = None
    rejected_status: int | None = None
    """Set when the provider refused the request with a non-retryable HTTP status."""


def parse_retry_after(headers: Mapping[str, str], *, now: datetime | None = None) -> float | None:
    """Seconds the provider asks to wait: ``retry-after-ms``, else ``Retry-After`` (seconds or HTTP date)."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def default_http_client(timeout_s: float, base_url: str) -> httpx.AsyncClient:
    """The HTTP client under the SDK: httpx's interface on aiohttp's transport.

    A streamed answer arrives one small chunk per token. httpx's own transport (httpcore and h11,
    pure Python, with an anyio timeout scope around every read) spends about 100 µs of CPU on each,
    aiohttp (a C parser) about a third of that: at a few thousand tokens a second into one worker
    that is most of a core (bench/RESULTS.md). The SDK offers the same transport
    (``openai.DefaultAioHttpClient``). No cap on connections: each active run holds at most one
    upstream request, and a cap would queue whole runs behind others' answers.

    The proxy comes from the environment (``HTTPS_PROXY``, ``HTTP_PROXY``, ``NO_PROXY``), as with
    httpx, found once for ``base_url`` (every request goes there): aiohttp's ``trust_env`` would
    look it up, and ``~/.netrc``, in a thread for every request (two executor hops a call, about
    15 % of the engine's CPU per run, bench/RESULTS.md). Nothing of ``.netrc`` is used: the SDK
    sends the key itself.
    """
    ssl_context = client_tls()

    def session() -> aiohttp.ClientSession:  # made on first use, inside the running loop
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, ssl=ssl_context)
        with warnings.catch_warnings():
            # aiohttp 3.14 deprecates BasicAuth and the session's proxy_auth (for proxy_headers,
            # which it does not use for plain-http targets yet): a proxy URL's credentials need them.
            warnings.filterwarnings("ignore", category=DeprecationWarning, message="(BasicAuth|.*proxy_auth)")
            proxy, proxy_auth = environment_proxy(base_url)
            return aiohttp.ClientSession(
                connector=connector, trust_env=False, proxy=proxy, proxy_auth=proxy_auth
            )

    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s),
        transport=_Transport(client=session, verify=ssl_context),
        trust_env=False,
    )


class _Transport(AiohttpTransport):
    """httpx_aiohttp's transport, leaving each response's aiohttp response in its ``extensions``
    (``RAW_BODY``) for ``stream_read.chunks`` to read the body from directly."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        raw = getattr(response.stream, "_aiohttp_response", None)
        if isinstance(raw, aiohttp.ClientResponse):
            response.extensions[RAW_BODY] = raw
        return response


def environment_proxy(base_url: str) -> tuple[URL | None, aiohttp.BasicAuth | None]:
    """The proxy the environment names for ``base_url`` (with its credentials), or none."""
    try:
        return get_env_proxy_for_url(URL(base_url))
    except LookupError:  # none for this URL's scheme, or NO_PROXY covers its host
        return None, None


class OpenAICompatibleLLM:
    """The LLM protocol (``app.llm.base.LLM``) for an OpenAI-compatible chat completions endpoint."""

    def __init__(
        self,
        base_url: str | None,
        api_key: str | None,
        model: str,
        abilities: Mapping[str, bool],
        timeout_s: float = 60,
        max_retries: int = 3,
        *,
        profile: ProviderProfile | None = None,
        http_client: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if max_retries < 0:
            raise ValueError("max_retries must not be negative")
        self._model = model
        self._profile = profile or profile_for(base_url, model)
        self._stream_usage = True  # until a server refuses stream_options (old Azure versions)
        self._abilities = dict(abilities)
        self._timeout_s = float(timeout_s)
        self._max_retries = max_retries
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._secret_re = (
            re.compile(f"(?<![{_TOKEN_CHARS}]){re.escape(api_key)}(?![{_TOKEN_CHARS}])") if api_key else None
        )
        self._owns_http = http_client is None
        self._http = http_client or default_http_client(self._timeout_s, base_url or DEFAULT_BASE_URL)
        # A query in the base URL (Azure's ``?api-version=``) goes on every request: the SDK would
        # put the path after it.
        url = urlsplit(base_url or DEFAULT_BASE_URL)
        headers = {"api-key": api_key} if api_key and self._profile.api_key_header else None
        self._client = openai.AsyncOpenAI(
            base_url=urlunsplit(url._replace(query="", fragment="")),
            api_key=api_key or _NO_KEY,
            default_query=dict(parse_qsl(url.query)) or None,
            default_headers=headers,
            timeout=self._timeout_s,
            max_retries=0,
            # The SDK's annotations name httpx2, but it accepts (and maps the errors of) an httpx client.
            http_client=cast(Any, self._http),
        )

    @property
    def abilities(self) -> Mapping[str, bool]:
        return self._abilities

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def profile(self) -> ProviderProfile:
        return self._profile

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it (a client passed in belongs to the caller)."""
        if self._owns_http:
            await self._client.close()

    # -- non-streaming ------------------------------------------------------------------------

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        response_format: Mapping[str, Any] | None = None,
    ) -> ChatResult:
        """One completion, retried on transport failures; see the module docstring."""
        # The body goes to the SDK as ``extra_body`` (merged into the request as it is), not as
        # ``messages=``/``tools=``: the SDK walks those against its TypedDicts on every call, which
        # cost more CPU than the rest of the call and grew with the conversation (about 30 ms a call
        # at 100 messages). Ours are plain JSON dicts already (``ProviderProfile.wire_messages``).
        body: dict[str, Any] = {"messages": self._profile.wire_messages(messages)}
        if tools:
            body["tools"] = [dict(t) for t in tools]
        if tool_choice is not None:
            body["tool_choice"] = tool_choice if isinstance(tool_choice, str) else dict(tool_choice)
        if response_format is not None:
            body["response_format"] = dict(response_format)

        attempts = 0
        while True:
            attempts += 1
            try:
                async with asyncio.timeout(self._timeout_s):
                    # The raw reply, parsed with orjson: the SDK's pydantic objects for it cost
                    # more CPU than the rest of the call (as for streams: app.llm.stream_read).
                    raw = await self._client.chat.completions.with_raw_response.create(
                        model=self._model, messages=(), extra_body=body
                    )
                    response = raw.http_response
                    content = await response.aread()
                body_json = _json_body(response, content, attempts)
                self._learn_thinking(body_json)
                return parse_completion(body_json, self._profile, attempts)
            except LLMResponseError:
                raise
            except Exception as exc:
                failure = self._classify(exc)
                await self._after_failure(failure, attempts, exc)

    # -- streaming ----------------------------------------------------------------------------

    async def stream_chat(self, messages: Sequence[ChatMessage]) -> AsyncIterator[StreamItem]:
        """Content deltas, then one ``StreamEnd``; retried only before the first delta went out.

        A stream that ends with neither a finish reason nor ``[DONE]`` was cut: retried if nothing
        was sent yet, an error otherwise (the answer is not complete)."""
        body: dict[str, Any] = {"messages": self._profile.wire_messages(messages)}  # see chat()
        attempts = 0
        sent_any = False
        while True:
            attempts += 1
            reader = StreamReader(self._profile, attempts)
            options: dict[str, Any] = (
                {"stream_options": {"include_usage": True}} if self._stream_usage else {}
            )
            try:
                async with asyncio.timeout(self._timeout_s):
                    stream = await self._client.chat.completions.create(
                        model=self._model, messages=(), stream=True, extra_body=body, **options
                    )
                async with stream:
                    async for chunk in chunks(stream.response, reader):
                        text = reader.feed(chunk)
                        if text:
                            sent_any = True
                            yield TextDelta(text)
                if not reader.complete:
                    raise _StreamCutError
                tail = reader.finish()
                if tail:
                    sent_any = True
                    yield TextDelta(tail)
            except LLMResponseError:
                raise
            except Exception as exc:
                failure = self._classify(exc)
                if sent_any:
                    # Retrying would send the user tokens they already have.
                    error = LLMUnavailableError if failure.retryable else LLMResponseError
                    raise error(
                        f"the LLM stream broke after tokens were sent: {failure.description}",
                        attempts=attempts,
                    ) from exc
                if self._refused_stream_options(failure):
                    continue  # old Azure API versions: ask again without it, usage as they give it
                await self._after_failure(failure, attempts, exc)
                continue
            yield StreamEnd(
                usage=reader.usage or TokenUsage(),
                attempts=attempts,
                finish_reason=reader.finish_reason,
                response_model=reader.response_model,
                response_id=reader.response_id,
            )
            return

    def _learn_thinking(self, body: object) -> None:
        """A reply that closes a ``</think>`` it never opened shows that the model's template opens
        the tag: this model's streams are then held back until it closes, like those of the models
        known by name (a stream cannot take back what it sent)."""
        if self._profile.think_tags and not self._profile.opens_thinking and template_opens_thinking(body):
            logger.info("llm_thinking_opened_by_template model=%s", self._model)
            self._profile = replace(self._profile, opens_thinking=True)

    def _refused_stream_options(self, failure: _Failure) -> bool:
        if self._stream_usage and failure.rejected_status == 400 and "stream_options" in failure.description:
            logger.warning(
                "llm_stream_options_refused model=%s: streams go on without usage options", self._model
            )
            self._stream_usage = False
            return True
        return False

    # -- failures -----------------------------------------------------------------------------

    async def _after_failure(self, failure: _Failure, attempts: int, exc: Exception) -> None:
        """Raise if this failure ends the call; otherwise wait before the next attempt."""
        if failure.rejected_status is not None:
            raise LLMRequestRejectedError(
                f"the LLM provider refused the request: {failure.description}",
                status=failure.rejected_status,
                attempts=attempts,
            ) from exc
        if not failure.retryable:
            raise LLMResponseError(
                f"the LLM reply is unusable: {failure.description}", attempts=attempts
            ) from exc
        if attempts > self._max_retries:
            raise LLMUnavailableError(
                f"the LLM is unavailable after {attempts} attempt(s): {failure.description}",
                attempts=attempts,
            ) from exc
        delay = self._retry_delay(attempts - 1, failure.retry_after_s)
        logger.warning(
            "llm_retry model=%s attempt=%d failure=%r delay_s=%.3f",
            self._model,
            attempts,
            failure.description,
            delay,
        )
        await self._sleep(delay)

    def _retry_delay(self, retry_index: int, retry_after_s: float | None) -> float:
        if retry_after_s is not None:
            return min(retry_after_s, RETRY_AFTER_MAX_S)
        ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * (2**retry_index))
        return self._rng.uniform(0.0, ceiling)

    def _classify(self, exc: Exception) -> _Failure:
        if isinstance(exc, ProviderReportedError):
            detail = self._scrub(exc.message)[:_SERVER_MESSAGE_MAX]
            code = f"{exc.status}: " if exc.status is not None else ""
            return _Failure(f"provider error ({code}{detail})", exc.retryable, None, exc.status)
        if isinstance(exc, _StreamCutError):
            return _Failure("the stream ended before the answer was complete", retryable=True)
        if isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            retryable = status in RETRYABLE_4XX or status >= 500
            detail = self._server_message(exc)
            description = f"HTTP {status}" + (f" ({detail})" if detail else "")
            retry_after = parse_retry_after(exc.response.headers) if retryable else None
            return _Failure(description, retryable, retry_after, None if retryable else status)
        broken = _connection_failure(exc)
        if broken is not None:
            return _Failure(f"connection error ({type(broken).__name__})", retryable=True)
        if isinstance(exc, (openai.APITimeoutError, TimeoutError, httpx.TimeoutException)):
            return _Failure(f"timed out after {self._timeout_s:g}s", retryable=True)
        if isinstance(exc, (openai.APIConnectionError, httpx.TransportError)):
            cause = exc.__cause__ or exc.__context__
            kind = type(cause).__name__ if cause is not None else type(exc).__name__
            return _Failure(f"connection error ({kind})", retryable=True)
        if isinstance(exc, ValueError):
            # json.JSONDecodeError from the SDK, or a chunk that is not JSON.
            return _Failure("the reply body is not valid JSON", retryable=False)
        if isinstance(exc, openai.APIError):
            return _Failure(f"provider error ({self._scrub(exc.message)[:_SERVER_MESSAGE_MAX]})", False)
        return _Failure(f"unexpected {type(exc).__name__}", retryable=False)

    def _server_message(self, exc: openai.APIStatusError) -> str:
        body = exc.body
        if isinstance(body, list) and len(body) == 1:
            body = body[0]  # Gemini's OpenAI-compatible endpoint: [{"error": {...}}]
        message: object = None
        if isinstance(body, Mapping):
            error = body.get("error", body)
            message = error.get("message") if isinstance(error, Mapping) else error
        if not isinstance(message, str):
            return ""
        return self._scrub(message)[:_SERVER_MESSAGE_MAX]

    def _scrub(self, text: str) -> str:
        """Remove the API key and anything that looks like a key from text bound for an error message."""
        if self._secret_re is not None:
            text = self._secret_re.sub("***", text)
        return _KEY_LIKE_RE.sub("***", text)


def _connection_failure(exc: BaseException) -> aiohttp.ClientConnectionError | None:
    """The aiohttp connection error under ``exc`` (the SDK's and httpx's wrappers), if not a timeout.

    The transport reports every aiohttp connection error as an httpx timeout (a refused connection,
    a server that hung up mid-answer): the cause tells them apart.
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, aiohttp.ClientConnectionError) and not isinstance(cause, TimeoutError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def _json_body(response: Any, content: bytes, attempts: int) -> object:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        said_json = "json" in response.headers.get("content-type", "")
        problem = "body is not valid JSON" if said_json else "is not JSON"
        raise LLMResponseError(f"the LLM reply {problem}", attempts=attempts) from None


class _StreamCutError(Exception):
    """The stream closed with neither a finish reason nor ``[DONE]``."""
