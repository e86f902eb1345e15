"""The CLI's HTTP side: a small client for the AgentStream API and a reconnecting stream reader.

Every failure surfaces as a ``CliError`` subclass with a message fit to print; the key travels
only in the ``Authorization`` header and never appears in a message.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from app.cli.sse import ServerEvent, SSEParser

REQUEST_TIMEOUT = httpx.Timeout(30.0)
# Reads on a stream wait through quiet runs; the server pings every 15 s by default, so a read
# this long without even a ping means the connection is dead.
STREAM_TIMEOUT = httpx.Timeout(30.0, read=60.0)
RETRYABLE_STATUSES = frozenset({502, 503, 504})


class CliError(Exception):
    """A failure the CLI reports as one line and exit code 1."""

    exit_code = 1


class ServerUnreachable(CliError):
    """No HTTP answer at all: connection refused, DNS, timeout."""


class StreamLost(CliError):
    """The event stream kept dropping and the retries ran out."""


class ApiError(CliError):
    """The server answered with an error status and (usually) its ``{"error": {...}}`` body."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{message} ({code}, HTTP {status})")
        self.status = status
        self.code = code
        self.message = message

    @classmethod
    def from_response(cls, response: httpx.Response) -> ApiError:
        code, message = f"http_{response.status_code}", response.reason_phrase or "request failed"
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            code = str(body["error"].get("code", code))
            message = str(body["error"].get("message", message))
        elif isinstance(body, dict) and "detail" in body:
            message = _detail_message(body["detail"])
        elif response.text.strip():
            message = response.text.strip()[:300]
        return cls(response.status_code, code, message)


class ApiClient:
    """Calls the AgentStream HTTP API; use as a context manager so the connection pool closes."""

    def __init__(
        self, base_url: str, key: str | None = None, *, transport: httpx.BaseTransport | None = None
    ):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=REQUEST_TIMEOUT, transport=transport
        )

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def create_conversation(self, *, model: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"agent": {"model": model}} if model else {}
        return self._object(self.request("POST", "/api/conversations", json=body))

    def list_models(self) -> list[dict[str, Any]]:
        models = self.request("GET", "/api/models")
        return models if isinstance(models, list) else []

    def list_conversations(self, *, limit: int | None = None, cursor: str | None = None) -> dict[str, Any]:
        params: dict[str, str | int] = {}
        if limit is not None:
            params["limit"] = limit
        if cursor:
            params["cursor"] = cursor
        return self._object(self.request("GET", "/api/conversations", params=params))

    def start_run(self, conversation_id: str, message: str) -> dict[str, Any]:
        path = f"/api/conversations/{_seg(conversation_id)}/runs"
        return self._object(self.request("POST", path, json={"message": message}))

    def get_conversation(self, conversation_id: str) -> dict[str, Any]:
        """The conversation with its current branch as ``messages`` (FACES.md B-01)."""
        return self._object(self.request("GET", f"/api/conversations/{_seg(conversation_id)}"))

    def edit(self, conversation_id: str, message: str, parent_id: str | None) -> dict[str, Any]:
        """Ask ``message`` below ``parent_id`` (None: as the first message), beside the question
        being edited (B-02)."""
        path = f"/api/conversations/{_seg(conversation_id)}/runs"
        return self._object(self.request("POST", path, json={"message": message, "parent_id": parent_id}))

    def regenerate(self, conversation_id: str, message_id: str) -> dict[str, Any]:
        """Answer a user message again, or an assistant message's question with a sibling (B-03)."""
        path = f"/api/conversations/{_seg(conversation_id)}/runs"
        return self._object(self.request("POST", path, json={"regenerate": message_id}))

    def fork(self, conversation_id: str, message_id: str, title: str | None = None) -> dict[str, Any]:
        """A new conversation whose messages are the path to ``message_id`` (B-05)."""
        body = {"message_id": message_id, **({"title": title} if title else {})}
        path = f"/api/conversations/{_seg(conversation_id)}/fork"
        return self._object(self.request("POST", path, json=body))

    def switch(self, conversation_id: str, message_id: str) -> dict[str, Any]:
        """Make the newest leaf below ``message_id`` the current leaf (B-04); the conversation."""
        path = f"/api/conversations/{_seg(conversation_id)}/head"
        return self._object(self.request("PUT", path, json={"message_id": message_id}))

    def interrupt(self, conversation_id: str, content: str) -> dict[str, Any]:
        path = f"/api/conversations/{_seg(conversation_id)}/interrupt"
        return self._object(self.request("POST", path, json={"content": content}))

    def cancel(self, conversation_id: str) -> None:
        self.request("POST", f"/api/conversations/{_seg(conversation_id)}/cancel")

    def decide(
        self,
        conversation_id: str,
        approval_id: str,
        decision: str,
        *,
        reason: str | None = None,
        tool_args: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A person's decision on an approval (RUNS.md A-03)."""
        body: dict[str, Any] = {"decision": decision}
        if reason:
            body["reason"] = reason
        if tool_args is not None:
            body["tool_args"] = tool_args
        path = f"/api/conversations/{_seg(conversation_id)}/approvals/{_seg(approval_id)}"
        return self._object(self.request("POST", path, json=body))

    def pending_approvals(self) -> list[dict[str, Any]]:
        body = self._object(self.request("GET", "/api/approvals", params={"status": "pending"}))
        items = body.get("items")
        return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []

    def get_run(self, run_id: str) -> dict[str, Any]:
        return self._object(self.request("GET", f"/api/runs/{_seg(run_id)}"))

    def run_events(self, run_id: str) -> list[ServerEvent]:
        body = self.request("GET", f"/api/runs/{_seg(run_id)}/events")
        if not isinstance(body, list):
            raise CliError("the server sent an unexpected answer for the run's events")
        return [ServerEvent.from_record(item) for item in body if isinstance(item, dict)]

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request; the decoded JSON body, or ``None`` for an empty answer."""
        with _mapped_transport_errors(self.base_url):
            response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise ApiError.from_response(response)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise CliError(f"the server at {self.base_url} did not answer with JSON") from exc

    def open_stream(self, conversation_id: str, last_event_id: str | None) -> EventStream | None:
        """Events of the conversation's stream after ``last_event_id``; ``None`` on 204 (finished).

        Transport errors (on connect or while reading) propagate as ``httpx.TransportError`` so
        that the caller can reconnect.
        """
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        path = f"/api/conversations/{_seg(conversation_id)}/stream"
        request = self._http.build_request("GET", path, headers=headers, timeout=STREAM_TIMEOUT)
        response = self._http.send(request, stream=True)
        if response.status_code == 204:
            response.close()
            return None
        if response.status_code >= 400:
            try:
                response.read()
            finally:
                response.close()
            raise ApiError.from_response(response)
        return EventStream(response)

    def _object(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise CliError(f"the server at {self.base_url} sent an unexpected answer")
        return body


class StreamFollower:
    """Reads a conversation's stream to the end of a run, reconnecting with ``Last-Event-ID``.

    ``cursor`` is the id of the last event the caller has finished with, so a new follower (or
    ``events()`` called again after the caller broke off) resumes right after it. With ``run_id``
    set, events of other runs are skipped and only that run's ``done`` ends the stream.
    """

    def __init__(
        self,
        client: ApiClient,
        conversation_id: str,
        *,
        after: str | None = None,
        run_id: str | None = None,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
        on_retry: Callable[[int, str], None] | None = None,
    ) -> None:
        self.client = client
        self.conversation_id = conversation_id
        self.cursor = after
        self.run_id = run_id
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.done: ServerEvent | None = None
        self.finished = False
        self._sleep = sleep
        self._on_retry = on_retry

    def events(self) -> Generator[ServerEvent, None, None]:
        failures = 0
        while not self.finished:
            try:
                stream = self.client.open_stream(self.conversation_id, self.cursor)
                if stream is None:
                    self.finished = True
                    return
                for event in stream:
                    failures = 0
                    if self.run_id is None or event.run_id in (None, self.run_id):
                        if event.event == "done":
                            self.done, self.finished = event, True
                        yield event
                    # Moved only once the caller is done with the event: a Ctrl-C while it is
                    # being shown replays it after a reconnect instead of losing it.
                    if event.id is not None:
                        self.cursor = event.id
                    if self.finished:
                        stream.close()
                        return
                reason = "the server closed the stream before the run ended"
            except ApiError as exc:
                if exc.status not in RETRYABLE_STATUSES:
                    raise
                reason = str(exc)
            except (httpx.UnsupportedProtocol, httpx.InvalidURL):
                raise CliError(f"invalid server URL {self.client.base_url!r}") from None
            except httpx.TransportError as exc:
                reason = _describe_transport_error(exc)
            failures += 1
            if failures > self.max_retries:
                raise StreamLost(f"lost the event stream ({reason}) and {self.max_retries} reconnects failed")
            if self._on_retry is not None:
                self._on_retry(failures, reason)
            self._sleep(min(self.backoff_s * 2 ** (failures - 1), 8.0))


@contextmanager
def _mapped_transport_errors(base_url: str) -> Iterator[None]:
    """Turns httpx failures of a plain request into ``ServerUnreachable``/``CliError``."""
    try:
        yield
    except (httpx.UnsupportedProtocol, httpx.InvalidURL):
        raise CliError(f"invalid server URL {base_url!r}: it must look like http://host:port") from None
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise ServerUnreachable(
            f"cannot connect to the AgentStream server at {base_url} "
            f"({_describe_transport_error(exc)}); is it running? Start one with `agentstream serve`."
        ) from None
    except httpx.TimeoutException:
        raise ServerUnreachable(f"the server at {base_url} did not answer in time") from None
    except httpx.TransportError as exc:
        raise ServerUnreachable(f"talking to {base_url} failed: {_describe_transport_error(exc)}") from None


class EventStream:
    """The events of one open stream response; closes the response when exhausted or closed."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    def __iter__(self) -> Iterator[ServerEvent]:
        parser = SSEParser()
        try:
            for line in self._response.iter_lines():
                raw = parser.feed(line)
                if raw is not None:
                    yield ServerEvent.from_sse(raw)
        finally:
            self._response.close()

    def close(self) -> None:
        self._response.close()


def _describe_transport_error(exc: httpx.TransportError) -> str:
    text = str(exc).strip()
    if "refused" in text.lower():
        return "connection refused"
    return text or type(exc).__name__


def _detail_message(detail: Any) -> str:
    # FastAPI's own validation errors use {"detail": [...]} rather than the service's error shape.
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid"))
    return str(detail)


def _seg(value: str) -> str:
    """An opaque id as one URL path segment."""
    return quote(value, safe="")
