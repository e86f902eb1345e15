"""A webhook receiver on loopback for tests (FACES.md N-06, N-07): records every POST it gets, and
answers as the test scripts it.

``with WebhookReceiver() as receiver: ...``; ``receiver.url`` is where to post. ``fail_first=n``
answers 500 to the first ``n`` attempts at each delivery (told apart by ``webhook-id``); ``gate``,
when cleared, holds every request until it is set (a slow receiver, a worker killed mid-request).
It counts the requests under way per delivery id, so a test can see whether two were ever made at
once (``overlaps``), and the connections made to it (``connections``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    """Header names in lower case."""
    body: bytes
    status: int
    """What the receiver answered."""
    at: float
    """When it answered (``time.monotonic()``)."""
    arrived: float
    """When the request came."""

    @property
    def delivery_id(self) -> str:
        return self.headers.get("webhook-id", "")

    def json(self) -> Any:
        return orjson.loads(self.body)


class WebhookReceiver:
    def __init__(
        self,
        *,
        fail_first: int = 0,
        answer: Callable[[Received], int] | None = None,
        hold_timeout_s: float = 30.0,
    ) -> None:
        self.fail_first = fail_first
        self.answer = answer
        self.gate = threading.Event()
        self.gate.set()
        self.hold_timeout_s = hold_timeout_s
        self.requests: list[Received] = []
        self._attempts: dict[str, int] = {}
        self._under_way: dict[str, int] = {}
        self.overlaps: dict[str, int] = {}
        """Per delivery id, the most requests for it that were under way at once."""
        self.held = 0
        """Requests being held at the gate now."""
        self.connections = 0
        """Connections accepted so far (a client that keeps one open sends requests on it)."""
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:  # once a connection
                super().setup()
                with receiver._changed:
                    receiver.connections += 1
                    receiver._changed.notify_all()

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                status = receiver._handle(self.path, headers, body)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="webhook-receiver", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _handle(self, path: str, headers: dict[str, str], body: bytes) -> int:
        arrived = time.monotonic()
        delivery = headers.get("webhook-id", "")
        with self._changed:
            self._under_way[delivery] = self._under_way.get(delivery, 0) + 1
            self.overlaps[delivery] = max(self.overlaps.get(delivery, 0), self._under_way[delivery])
            attempt = self._attempts[delivery] = self._attempts.get(delivery, 0) + 1
            held = not self.gate.is_set()
            if held:
                self.held += 1
            self._changed.notify_all()
        try:
            if held:
                self.gate.wait(self.hold_timeout_s)
            status = 500 if attempt <= self.fail_first else 200
            if self.answer is not None:
                status = self.answer(Received(path, headers, body, status, time.monotonic(), arrived))
        finally:
            with self._changed:
                self._under_way[delivery] -= 1
                if held:
                    self.held -= 1
                self.requests.append(Received(path, headers, body, status, time.monotonic(), arrived))
                self._changed.notify_all()
        return status

    def accepted(self) -> list[Received]:
        with self._changed:
            return [r for r in self.requests if 200 <= r.status < 300]

    def wait_for(
        self, predicate: Callable[[WebhookReceiver], Any], timeout: float = 15.0, what: str = ""
    ) -> Any:
        """Wait until ``predicate(self)`` is truthy (checked at each request); its value."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                value = predicate(self)
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"timed out after {timeout}s waiting for {what or predicate}; "
                        f"received {[(r.delivery_id, r.status) for r in self.requests]}"
                    )
                self._changed.wait(left)

    def wait_accepted(self, count: int, timeout: float = 15.0) -> list[Received]:
        found: list[Received] = self.wait_for(
            lambda r: len(a := [x for x in r.requests if 200 <= x.status < 300]) >= count and a,
            timeout,
            f"{count} accepted deliveries",
        )
        return found
