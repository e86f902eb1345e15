"""The agent as an OpenAI-compatible model: ``POST /v1/chat/completions`` and ``GET /v1/models``.

Any OpenAI client gets the synthesized answer. Each request starts a run, through the run manager
like any other, in a new conversation owned by the caller: the last user message is the run's
question, the earlier user and assistant messages its history, and system (or developer) messages
the agent's instructions. The answer is read from the run's events through the same path the SSE
route uses (``app.streaming.resume.stream_events``), so runs, events and storage are the usual ones:
the run can also be followed, read or cancelled through ``/api``.

Wire format (what plain clients see is plain OpenAI; what they ignore is the ``agentstream`` field):

- non-streaming: one ``chat.completion`` once the run is done, ``usage`` from ``done``, and
  ``agentstream: {run_id, conversation_id, status, iterations, elapsed, error, llm_calls, steps}``
  where ``steps`` are the payloads of the run's ``step`` events.
- streaming: ``data: <chat.completion.chunk>`` lines, then ``data: [DONE]``. The first chunk has
  the assistant role; answer deltas are ``delta.content``; each ``step`` event is a chunk with an
  empty delta (``delta: {}``, like the final chunk OpenAI sends) and
  ``agentstream: {run_id, conversation_id, step}``; the last chunk has ``finish_reason: "stop"``
  and ``agentstream`` with the run's outcome; with ``stream_options.include_usage`` a usage chunk
  (``choices: []``) follows. Should the answer streamed differ from ``done.answer`` (synthesis
  failed mid-stream, ENGINE E-04), the last chunk's ``agentstream`` carries ``answer`` and
  ``answer_replaced: true``.
- errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 401 for a missing
  or wrong key, 400 for a request this route cannot take, 502 ``run_failed`` when the run failed
  (the model is down, for one), 409 ``run_cancelled`` (with ``x-should-retry: false``) when someone
  cancelled it through ``/api``. A streamed request only starts its 200 response once the run has
  gone past its first thought (a tool call or the answer), so a model that is down is a 502 there
  too; a run that fails later
  ends the stream with ``data: {"error": {...}}`` (which OpenAI clients raise) and ``data: [DONE]``.

Sampling parameters (``temperature``, ``max_tokens``, ``tools``, ...) are accepted and ignored: the
agent uses the configured model and its own tools. ``model`` may be anything; it is echoed back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.deps import OwnerDep, ServicesDep
from app.api.openai_input import ChatCompletionRequest, chat_input
from app.api.routes.stream import SEAM_WAIT_S, SEND_TIMEOUT_S, SSE_HEADERS, ping_event, title_from
from app.api.schemas import error_responses
from app.api.sse_response import EventStream
from app.container import Services
from app.errors import InvalidInputError, NotFoundError, ServiceError, UnauthorizedError
from app.streaming.bus import StoredEvent
from app.streaming.resume import stream_events
from app.streaming.sse import single_line_json

MODEL_ID = "agentstream"
_DONE_LINE = b"data: [DONE]\n\n"


# ---- errors ------------------------------------------------------------------------------------


class RunFailedError(ServiceError):
    code = "run_failed"
    status = 502


class RunCancelledError(ServiceError):
    code = "run_cancelled"
    status = 409


class RunInterruptedError(ServiceError):
    """The worker stopped streaming before the run ended (it is shutting down)."""

    code = "stream_interrupted"
    status = 503


def error_body(exc: ServiceError, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": exc.message,
            "type": "invalid_request_error" if exc.status < 500 else "server_error",
            "param": param,
            "code": "invalid_api_key" if isinstance(exc, UnauthorizedError) else exc.code,
        }
    }


def error_response(exc: ServiceError, param: str | None = None) -> JSONResponse:
    # The error's own headers: WWW-Authenticate, with why a token was refused (J-03); the
    # Retry-After of a 503 (sign-in unavailable, shutting down) or a 429.
    headers = dict(exc.headers)
    status = exc.status
    if isinstance(exc, InvalidInputError):
        status = 400  # OpenAI answers every request it cannot take with 400
    elif isinstance(exc, RunCancelledError):
        headers["x-should-retry"] = "false"  # OpenAI clients retry 409 unless told not to
    return JSONResponse(error_body(exc, param), status_code=status, headers=headers)


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if any(err.get("type") == "json_invalid" for err in errors):
        return error_response(InvalidInputError("the request body is not valid JSON"))
    parts: list[str] = []
    param: str | None = None
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        param = param or loc or None
        parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg", "invalid")))
    return error_response(InvalidInputError("; ".join(parts) or "invalid request"), param)


class OpenAIErrorRoute(APIRoute):
    """Answers this router's errors in OpenAI's shape (the app's handlers use the API.md shape)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return _validation_response(exc)
            except ServiceError as exc:
                return error_response(exc)
            except StarletteHTTPException as exc:
                body = {
                    "error": {
                        "message": str(exc.detail),
                        "type": "invalid_request_error" if exc.status_code < 500 else "server_error",
                        "param": None,
                        "code": None,
                    }
                }
                return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

        return handle


router = APIRouter(tags=["openai"], route_class=OpenAIErrorRoute)


class OpenAIErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIErrorBody


def _openai_errors(
    *client_errors: str, server_errors: dict[int, str] | None = None, takes_body: bool = False
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` of this router: its 4xx are in OpenAI's shape (``4XX`` also stands in
    for FastAPI's 422, which these routes never answer), except the 413 of the body-size limit,
    which the app answers before any route, in its own shape."""
    out: dict[int | str, dict[str, Any]] = {
        "4XX": {"model": OpenAIErrorResponse, "description": "; ".join(client_errors)}
    }
    if takes_body:
        out.update(error_responses(413))
    for status, description in (server_errors or {}).items():
        out[status] = {"model": OpenAIErrorResponse, "description": description}
    return out


class ModelOut(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelOut]


class ChatCompletionOut(BaseModel):
    """``chat.completion`` as OpenAI sends it, plus the ``agentstream`` extension."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[dict[str, Any]]
    usage: dict[str, int]
    agentstream: dict[str, Any]


_UNAUTHORIZED = "401 `invalid_api_key`: no API key or access token, or one that is refused"
# One event of a streamed completion: a chunk, an error, or ``[DONE]``, as ``data`` alone.
_CHUNK_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


# ---- response ----------------------------------------------------------------------------------


def _payload(event: StoredEvent) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(event.data)
    data.pop("run_id", None)
    return data


def _usage(done: dict[str, Any]) -> dict[str, int]:
    usage = done.get("usage") or {}
    return {k: int(usage.get(k, 0)) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _outcome_error(done: dict[str, Any] | None) -> ServiceError | None:
    """The error a run's ``done`` stands for, or None when it has an answer to give."""
    if done is None:
        return RunInterruptedError("the service stopped before the run finished; retry the request")
    status = done.get("status")
    if status == "completed":
        return None
    reason = done.get("error") or "the run did not finish"
    if status == "cancelled":
        return RunCancelledError(f"the run was cancelled: {reason}")
    return RunFailedError(f"the run failed: {reason}")


def _commits(event: StoredEvent) -> bool:
    """Whether the run got this far only because the model answered (see the module docstring).

    A ``thinking`` step proves nothing: when the model cannot be reached the engine still closes
    the thought (its reasoning then says why) before it ends the run.
    """
    if event.event == "phase":
        return False
    if event.event == "step":
        return bool(orjson.loads(event.data).get("type") != "thinking")
    return True


@dataclass
class Completion:
    """One chat completion being answered: the ids and the run's events turned into OpenAI objects."""

    run_id: str
    conversation_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return f"chatcmpl-{self.run_id}"

    def extension(self, **extra: Any) -> dict[str, Any]:
        return {"run_id": self.run_id, "conversation_id": self.conversation_id, **extra}

    def outcome(self, done: dict[str, Any]) -> dict[str, Any]:
        usage = done.get("usage") or {}
        return self.extension(
            status=done.get("status"),
            iterations=done.get("iterations"),
            elapsed=done.get("elapsed"),
            error=done.get("error"),
            llm_calls=usage.get("llm_calls", 0),
        )

    def completion(self, done: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": str(done.get("answer") or ""),
                        "refusal": None,
                    },
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": _usage(done),
            "agentstream": {**self.outcome(done), "steps": steps},
        }

    def chunk(
        self,
        delta: dict[str, Any] | None,
        *,
        finish_reason: str | None = None,
        agentstream: dict[str, Any] | None = None,
        usage: dict[str, int] | None = None,
    ) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": []
            if delta is None
            else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if usage is not None:
            obj["usage"] = usage
        if agentstream is not None:
            obj["agentstream"] = agentstream
        return b"data: " + single_line_json(orjson.dumps(obj)) + b"\n\n"


class ChunkEncoder:
    """Turns the run's events into the stream's chunks, remembering what answer text went out."""

    def __init__(self, completion: Completion, include_usage: bool) -> None:
        self.completion = completion
        self.include_usage = include_usage
        self.sent = ""
        self.held = False
        """The run was carried on by a new attempt after answer text went out (RUNS.md R-04): its
        answer streams again from the start, which a chat completion cannot take back, so the rest
        waits for ``done`` (sent as the remainder, or as ``answer_replaced``)."""

    def first(self) -> bytes:
        return self.completion.chunk(
            {"role": "assistant", "content": ""}, agentstream=self.completion.extension()
        )

    def encode(self, event: StoredEvent) -> list[bytes]:
        c = self.completion
        if event.event == "step":
            return [c.chunk({}, agentstream=c.extension(step=_payload(event)))]
        if event.event == "answer":
            data = orjson.loads(event.data)
            content = data.get("content")
            if data.get("status") == "delta" and content and not self.held:
                self.sent += content
                return [c.chunk({"content": content})]
            return []
        if event.event == "phase" and self.sent and orjson.loads(event.data).get("phase") == "resumed":
            self.held = True
            return []
        if event.event == "done":
            return self._closing(orjson.loads(event.data))
        return []

    def _closing(self, done: dict[str, Any]) -> list[bytes]:
        c = self.completion
        error = _outcome_error(done)
        if error is not None:
            return [b"data: " + single_line_json(orjson.dumps(error_body(error))) + b"\n\n", _DONE_LINE]
        out: list[bytes] = []
        answer = str(done.get("answer") or "")
        outcome = c.outcome(done)
        if answer != self.sent:
            if answer.startswith(self.sent):
                out.append(c.chunk({"content": answer[len(self.sent) :]}))
            else:
                outcome.update(answer=answer, answer_replaced=True)
        out.append(c.chunk({}, finish_reason="stop", agentstream=outcome))
        if self.include_usage:
            out.append(c.chunk(None, usage=_usage(done)))
        out.append(_DONE_LINE)
        return out

    def interrupted(self) -> list[bytes]:
        error = _outcome_error(None)
        assert error is not None
        return [b"data: " + single_line_json(orjson.dumps(error_body(error))) + b"\n\n", _DONE_LINE]


# ---- routes ------------------------------------------------------------------------------------


def _model_object(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "agentstream"}


def _model_ids(services: Services) -> list[str]:
    # MODEL_ID first: the agent on the default model, the name clients used before there were many.
    return [MODEL_ID, *services.models.names]


@router.get("/v1/models", response_model=ModelList, responses=_openai_errors(_UNAUTHORIZED))
async def list_models(services: ServicesDep, _owner: OwnerDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model_object(model_id) for model_id in _model_ids(services)]}


@router.get(
    "/v1/models/{model_id:path}",  # a name may hold a "/" (openai/gpt-4o)
    response_model=ModelOut,
    responses=_openai_errors(_UNAUTHORIZED, "404 `not_found`: no model of that name here"),
)
async def get_model(model_id: str, services: ServicesDep, _owner: OwnerDep) -> dict[str, Any]:
    known = _model_ids(services)
    if model_id not in known:
        raise NotFoundError(f"the model {model_id!r} does not exist; this service serves {', '.join(known)}")
    return _model_object(model_id)


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={
        200: {
            "model": ChatCompletionOut,
            "description": "`chat.completion`, or with `stream: true` `chat.completion.chunk`s as SSE",
            "content": {
                "text/event-stream": {
                    "schema": {"type": "array", "items": _CHUNK_EVENT},
                    "itemSchema": _CHUNK_EVENT,
                }
            },
        },
        **_openai_errors(
            "400 `invalid_request`: a request this route cannot take; `param` says where",
            _UNAUTHORIZED,
            "409 `run_cancelled`: the run was cancelled through /api",
            server_errors={
                502: "`run_failed`: the run failed (the model is down, for one)",
                503: "`stream_interrupted` or `shutting_down`: the worker is stopping; retry",
            },
            takes_body=True,
        ),
    },
)
async def chat_completions(body: ChatCompletionRequest, services: ServicesDep, owner: OwnerDep) -> Response:
    chat = chat_input(body)
    title = title_from(chat.question)
    # Nobody can approve a call here: one that needs approval does not run, and the model is told.
    agent: dict[str, Any] = {"ask_approvals": False}
    if body.model in services.models:  # a configured model by name; anything else: the default
        agent["model"] = body.model
    if chat.instructions:
        agent["system_prompt"] = chat.instructions
    conversation, run = await services.manager.start_in_new_conversation(
        owner, title, agent, chat.question, prior=chat.prior
    )
    completion = Completion(run.id, conversation.id, body.model)
    events = stream_events(
        services.bus, services.events, conversation.id, run.start_cursor, seam_wait_s=SEAM_WAIT_S
    )
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return await _streaming(services, completion, events, include_usage)
    return await _complete(completion, events)


async def _complete(completion: Completion, events: AsyncIterator[StoredEvent]) -> Response:
    steps: list[dict[str, Any]] = []
    done: dict[str, Any] | None = None
    try:
        async for event in events:
            if event.event == "step":
                steps.append(_payload(event))
            elif event.is_done:
                done = orjson.loads(event.data)
    finally:
        await _close(events)
    error = _outcome_error(done)
    if error is not None:
        return error_response(error)
    assert done is not None
    return JSONResponse(completion.completion(done, steps))


async def _streaming(
    services: Services,
    completion: Completion,
    events: AsyncIterator[StoredEvent],
    include_usage: bool,
) -> Response:
    # Hold the 200 until the model has answered once: a model that is down is then a 502 the
    # client can act on, not an error in the middle of a stream it already took as a success.
    held: list[StoredEvent] = []
    try:
        async for event in events:
            held.append(event)
            if event.is_done or _commits(event):
                break
    except BaseException:
        await _close(events)
        raise
    last = held[-1] if held else None
    if last is None or last.is_done:
        error = _outcome_error(orjson.loads(last.data) if last is not None else None)
        if error is not None:
            await _close(events)
            return error_response(error)
    encoder = ChunkEncoder(completion, include_usage)
    return EventStream(
        _chunks(services, encoder, held, events),
        headers=SSE_HEADERS,
        ping=services.settings.sse_ping_seconds,
        sep="\n",
        ping_message_factory=ping_event,
        send_timeout=SEND_TIMEOUT_S,
    )


async def _close(events: AsyncIterator[StoredEvent]) -> None:
    # Leaving the bus's follow early must unsubscribe now, not when the generator is collected.
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


async def _chunks(
    services: Services,
    encoder: ChunkEncoder,
    held: list[StoredEvent],
    events: AsyncIterator[StoredEvent],
) -> AsyncIterator[bytes]:
    services.metrics.active_streams.inc()
    try:
        yield encoder.first()
        for event in held:
            for chunk in encoder.encode(event):
                yield chunk
        if held and held[-1].is_done:
            return
        async for event in events:
            for chunk in encoder.encode(event):
                yield chunk
            if event.is_done:
                return
        for chunk in encoder.interrupted():
            yield chunk
    finally:
        services.metrics.active_streams.dec()
        await _close(events)
