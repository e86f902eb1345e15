"""An OTLP/HTTP trace receiver on loopback, for tests and benchmarks: it decodes what an exporter
sends (``ExportTraceServiceRequest`` protobuf, gzip or not) into plain ``ReceivedSpan`` records.

In a test: ``with OtlpReceiver() as receiver: ...`` then ``receiver.wait_for_spans(...)``. As a
process (benchmarks): ``python -m tests.support.otlp_receiver --port N`` counts what it receives.
"""

from __future__ import annotations

import argparse
import gzip
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which is not None else None


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: Mapping[str, Any]
    status: str
    status_message: str
    events: tuple[tuple[str, Mapping[str, Any]], ...]
    resource: Mapping[str, Any] = field(default_factory=dict)
    start_ns: int = 0
    end_ns: int = 0


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        name=span.name,
                        kind=KINDS.get(span.kind, str(span.kind)),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        attributes={kv.key: _value(kv.value) for kv in span.attributes},
                        status=STATUS.get(span.status.code, str(span.status.code)),
                        status_message=span.status.message,
                        events=tuple(
                            (e.name, {kv.key: _value(kv.value) for kv in e.attributes}) for e in span.events
                        ),
                        resource=resource,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                    )
                )
    return out


class OtlpReceiver:
    """Receives OTLP/HTTP trace exports on ``endpoint`` (``/v1/traces`` under it)."""

    def __init__(self, port: int = 0, *, keep: bool = True) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.span_count = 0
        self.headers: list[dict[str, str]] = []
        self._keep = keep
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(decode(body), dict(self.headers.items()))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _add(self, spans: list[ReceivedSpan], headers: dict[str, str]) -> None:
        with self._changed:
            self.requests += 1
            self.span_count += len(spans)
            if self._keep:
                self.spans.extend(spans)
                self.headers.append(headers)
            self._changed.notify_all()

    def wait_for_spans(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 15.0, what: str = "the spans"
    ) -> list[ReceivedSpan]:
        """The spans received, once ``done(spans)`` holds; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done(list(self.spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self.spans})
                    raise AssertionError(f"timed out waiting for {what}; received {names}")
                self._changed.wait(left)
            return list(self.spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=1800.0, help="stop after this long at most")
    args = parser.parse_args()
    receiver = OtlpReceiver(args.port, keep=False).start()
    try:
        time.sleep(args.seconds)
    except KeyboardInterrupt:
        pass
    finally:
        receiver.stop()


if __name__ == "__main__":
    main()
