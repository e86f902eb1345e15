"""Reading an OpenAI-style SSE stream straight off the wire, in every shape providers send.

``chunks(response, reader)`` yields the JSON chunks of the body (``data:`` lines), turns the
error forms into ``ProviderReportedError`` (an error chunk ``data: {"error": ...}`` as OpenRouter
and vLLM send it, llama.cpp server's ``error: {...}`` lines, an ``event: error`` block) and notes
the ``[DONE]`` line. ``StreamReader.feed`` takes one chunk and returns the answer text it carries:
content as a string or as blocks, from any choice, with ``<think>`` thinking held back where the
profile says so and the reasoning fields (``reasoning_content``, ``reasoning``) never taken for
text; it keeps the last usage reported (cumulative on every chunk, on the finish chunk, on a
chunk of its own, or in ``x_groq.usage``: the last one is the call's) and the finish reason.

This is the per-token path of a worker (bench/RESULTS.md): chunks are parsed with orjson and read
as plain dicts, the SDK's per-chunk objects are never built.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
from httpx_aiohttp.transport import map_aiohttp_exceptions

from app.llm.base import LLMResponseError, TokenUsage
from app.llm.providers import ProviderProfile
from app.llm.replies import ThinkTags, reported_error, text_and_thinking, token_usage

# Where an event-stream line ends: CR, LF or CRLF, and nothing else (split in bytes: a UTF-8 character
# never holds either byte, so one cut across two network reads is whole again in ``pending``). A
# splitter of decoded text such as httpx's ``aiter_lines`` also ends lines at U+2028, U+0085 and the
# like (``str.splitlines``), which a JSON chunk may carry raw in a string; that would cut a token's
# chunk in two. A trailing CR waits for a possible LF.
_LINE_END = re.compile(rb"\r\n|\r(?!$)|\n")
_CUT_REASONS = frozenset({"length", "content_filter", "error"})
RAW_BODY = "agentstream.aiohttp_response"
"""The ``extensions`` key under which the default HTTP client's transport leaves a response's
aiohttp response (``app.llm.openai_client``), whose body ``chunks`` then reads directly."""


def _body(response: Any) -> AsyncIterator[bytes]:
    """The body's bytes. From aiohttp's own buffer when the transport left it (``RAW_BODY``) and
    the body is not compressed: the per-token path of a worker (bench/RESULTS.md), where httpx's
    five layers of iterators and its text decoder cost more than the rest of the read; else from
    httpx, which undoes any content coding."""
    raw = getattr(response, "extensions", {}).get(RAW_BODY)
    if raw is not None and response.headers.get("content-encoding", "identity").lower() == "identity":
        return cast(AsyncIterator[bytes], raw.content.iter_any())
    return cast(AsyncIterator[bytes], response.aiter_bytes())


def _split(data: bytes) -> list[bytes]:
    """``data`` cut at its line ends, the last piece unfinished (``b""`` if it ended with one).
    Without a CR, ``bytes.split`` (a scan in C), several times cheaper than the expression."""
    return _LINE_END.split(data) if b"\r" in data else data.split(b"\n")


@dataclass(slots=True)
class StreamReader:
    """One streamed reply being read; see the module docstring."""

    profile: ProviderProfile
    attempts: int = 1
    usage: TokenUsage | None = None
    finish_reason: str | None = None
    saw_done: bool = False
    response_model: str | None = None
    """The ``model`` and ``id`` the chunks carry (the first ones seen), for traces."""
    response_id: str | None = None
    tags: ThinkTags | None = field(default=None)

    def __post_init__(self) -> None:
        if self.profile.think_tags and self.tags is None:
            self.tags = ThinkTags(opened=self.profile.opens_thinking)

    @property
    def complete(self) -> bool:
        """The provider said the answer ended (a finish reason, or ``[DONE]``)."""
        return self.saw_done or self.finish_reason is not None

    def feed(self, chunk: object) -> str:
        # Plain dicts (orjson makes nothing else) checked with ``type() is``: an ABC isinstance
        # per chunk, choice and delta costs more than reading them.
        if type(chunk) is not dict:
            raise LLMResponseError("an LLM stream chunk is not a JSON object", attempts=self.attempts)
        if chunk.get("error"):
            raise reported_error(chunk["error"])
        if chunk.get("object") == "error":  # vLLM's ErrorResponse sent as a chunk
            raise reported_error(chunk)
        if self.response_id is None:
            model, id_ = chunk.get("model"), chunk.get("id")
            if type(model) is str and model:
                self.response_model = model
            if type(id_) is str and id_:
                self.response_id = id_
        if chunk.get("usage") or "x_groq" in chunk:  # OpenAI sends "usage": null on every chunk
            usage = token_usage(chunk)
            if usage is not None:
                self.usage = usage
        choices = chunk.get("choices")
        if not choices:
            return ""  # a usage chunk, a keep-alive, an empty list
        if type(choices) is not list:
            raise LLMResponseError("an LLM stream chunk has malformed choices", attempts=self.attempts)
        out = ""
        for choice in choices:
            if type(choice) is not dict:
                continue
            reason = choice.get("finish_reason")
            if reason and type(reason) is str:
                self.finish_reason = reason
            delta = choice.get("delta")
            if type(delta) is not dict:
                continue
            content = delta.get("content")
            text = content if type(content) is str else text_and_thinking(content)[0]
            if self.tags is not None:
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    out += self.tags.separated()
                if text:
                    out += self.tags.feed(text)
            elif text:
                out += text
        return out

    def finish(self) -> str:
        """Answer text still held back when the stream ended."""
        if self.tags is None:
            return ""
        return self.tags.finish(ended=self.finish_reason not in _CUT_REASONS)


async def chunks(response: Any, reader: StreamReader) -> AsyncIterator[object]:
    """The JSON chunks of an SSE body; see the module docstring. The body is read to its end (past
    ``[DONE]``) so that the connection goes back to the pool. Event streams are UTF-8 whatever the
    headers say (the HTML standard's "Server-sent events"); a byte that is not gives U+FFFD.

    One generator from the body's reads to the chunks (the lines are not a generator of their
    own: a token's chunk is two lines, and each step through a generator costs about as much as
    reading the line)."""
    event = b""
    pending: bytes | None = b""
    body = _body(response)
    # The errors httpx's own read would raise (ReadError, ReadTimeout); others pass unchanged.
    with map_aiohttp_exceptions():
        while pending is not None:
            data = await anext(body, None)
            if data is not None:
                *lines, pending = _split(pending + data if pending else data)
            else:  # the body's end: what is left is its last line
                lines, pending = ([pending] if pending else []), None
            for line in lines:
                if line.startswith(b"data:"):
                    value = _stripped(line[5:])
                    if not value:
                        continue
                    if value == b"[DONE]":
                        reader.saw_done = True
                        continue
                    if reader.saw_done:
                        continue  # read to the end for the connection's sake; nothing counts after [DONE]
                    if event == b"error":
                        raise reported_error(_json_or_text(_text(value)))
                    yield _loads(value)
                elif not line:
                    event = b""  # a blank line ends an SSE event
                elif line.startswith(b"event:"):
                    event = _stripped(line[6:])
                elif line.startswith(b"error:"):  # llama.cpp's server: "error: {json}"
                    raise reported_error(_json_or_text(_text(line[6:])))


_UNICODE_SPACE_ENDS = frozenset(range(0x1C, 0x20)) | frozenset(range(0x80, 0x100))


def _stripped(field: bytes) -> bytes:
    """``field`` without the whitespace at its ends, as ``str.strip`` has it (which strips more
    than ``bytes.strip``: U+00A0, U+0085, ...). Decoded only when an end byte could be such."""
    data = field.strip()
    if data and (data[0] in _UNICODE_SPACE_ENDS or data[-1] in _UNICODE_SPACE_ENDS):
        data = _text(data).encode()
    return data


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace").strip()


def _loads(data: bytes) -> object:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        # Not UTF-8: as the text a decoder would give (U+FFFD for what is not).
        return orjson.loads(_text(data))


def _json_or_text(data: str) -> object:
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if isinstance(parsed, Mapping) and isinstance(parsed.get("error"), Mapping | str):
        return parsed["error"]
    return parsed
