"""``build_tracing(settings)``: the service's ``Tracing``, on when an OTLP endpoint is configured."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from opentelemetry import trace

from app import __version__
from app.llm.models import ModelRegistry, ModelSpec
from app.llm.providers import profile_for
from app.settings import Settings
from app.tools.registry import ToolRegistry
from app.tracing.genai import (
    AGENT,
    AGENT_NAME,
    CONVERSATION_ID,
    NO_RUN_SPAN,
    OPERATION,
    PROVIDER,
    REQUEST_MODEL,
    ChatSpans,
    NoRunSpan,
    RunSpan,
    provider_name,
    server_attributes,
    tool_observer,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

log = logging.getLogger("app.tracing")

SUPPORTED_PROTOCOL = "http/protobuf"
SHUTDOWN_TIMEOUT_S = 3.0
DEFAULT_SERVICE_NAME = "agentstream"


class TracingConfigError(ValueError):
    """The ``OTEL_*`` settings ask for something this service cannot do; the start stops."""


class Tracing:
    """Whether the service traces, and its tracer when it does. ``NO_TRACING`` when off."""

    def __init__(self, provider: TracerProvider | None = None, *, capture_content: bool = False) -> None:
        self._provider = provider
        self.enabled = provider is not None
        self.capture_content = capture_content
        self.tracer: Tracer | None = (
            provider.get_tracer("agentstream", __version__) if provider is not None else None
        )
        self._observe = tool_observer(self.tracer, capture_content) if self.tracer is not None else None

    def chat_spans(self, spec: ModelSpec) -> ChatSpans | None:
        """The ``chat`` spans of the model of ``spec`` (None when off): ``InstrumentedLLM`` opens
        one around each of its calls."""
        if self.tracer is None:
            return None
        return ChatSpans(
            self.tracer,
            request_model=spec.model,
            provider=_provider(spec),
            server=server_attributes(spec.base_url),
            capture_content=self.capture_content,
        )

    def tools(self, registry: ToolRegistry) -> ToolRegistry:
        """``registry`` with an ``execute_tool`` span around each call."""
        return registry if self._observe is None else registry.observed(self._observe)

    def run_span(
        self,
        *,
        run_id: str,
        conversation_id: str,
        attempt: int,
        model: str,
        models: ModelRegistry,
        traceparent: str | None,
    ) -> RunSpan | NoRunSpan:
        """The ``invoke_agent`` span of an attempt of a run on ``model`` (one of ``models``, or a
        model no longer configured), a child of the request that started the run."""
        if self.tracer is None:
            return NO_RUN_SPAN
        spec = models.spec(model) if model in models else None
        attributes: dict[str, Any] = {
            OPERATION: "invoke_agent",
            PROVIDER: _provider(spec) if spec is not None else "unknown",
            AGENT_NAME: AGENT,
            CONVERSATION_ID: conversation_id,
            "agentstream.run.id": run_id,
            "agentstream.run.attempt": attempt,
            "agentstream.model": model,
        }
        if spec is not None:
            attributes[REQUEST_MODEL] = spec.model
        return RunSpan(self.tracer, attributes, traceparent)

    def traceparent(self) -> str | None:
        """The current span's context (the HTTP request's, at a run's start) as a W3C
        ``traceparent``: a run's attempts are its children, whichever worker runs them."""
        if not self.enabled:
            return None
        ctx = trace.get_current_span().get_span_context()
        if not ctx.is_valid:
            return None
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    async def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Export what is still buffered, for ``timeout_s`` at most: a collector that is down or
        hangs must not hold a deploy's stop (the SDK's own bound is 30 s and more). In a thread of
        its own (daemon: one still exporting does not keep the process), not the loop's executor,
        which the loop's close waits for."""
        provider = self._provider
        if provider is None:
            return
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()

        def done() -> None:
            if not finished.done():
                finished.set_result(None)

        def stop() -> None:
            try:
                provider.shutdown()
            except Exception:
                log.warning("tracing: the tracer provider did not shut down cleanly", exc_info=True)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(done)

        threading.Thread(target=stop, name="tracing-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(finished), timeout_s)
        except TimeoutError:
            log.warning("tracing: spans not exported within %.1f s of the stop were dropped", timeout_s)


NO_TRACING = Tracing()


def _provider(spec: ModelSpec) -> str:
    """``gen_ai.provider.name`` of a configured model (its provider profile's)."""
    if spec.base_url is None:
        return provider_name(None)
    return provider_name(profile_for(spec.base_url, spec.model, spec.provider).name)


def _endpoint(settings: Settings) -> str | None:
    """The traces URL: ``..._TRACES_ENDPOINT`` as it is, else ``/v1/traces`` on the base endpoint
    (the OTLP exporter specification's rule)."""
    if settings.otel_exporter_otlp_traces_endpoint:
        return settings.otel_exporter_otlp_traces_endpoint
    if settings.otel_exporter_otlp_endpoint:
        return settings.otel_exporter_otlp_endpoint.rstrip("/") + "/v1/traces"
    return None


def _headers(settings: Settings) -> Mapping[str, str] | None:
    """The export requests' headers (``key=value,...``, percent-encoded, as the OTLP exporter
    specification writes them). Checked here rather than by the SDK, whose warning about an entry
    it cannot read quotes the entry: a key in the log. Errors name the header, never its value."""
    secret = settings.otel_exporter_otlp_traces_headers or settings.otel_exporter_otlp_headers
    if secret is None:
        return None
    headers: dict[str, str] = {}
    for number, item in enumerate(_HEADER_DELIMITER.split(secret.get_secret_value()), start=1):
        if not item.strip():
            continue
        entry = _HEADER_ENTRY.fullmatch(item)
        name = unquote(entry[1]).strip().lower() if entry else ""
        value = unquote(entry[2]).strip() if entry else ""
        if entry is None or not _HEADER_NAME.fullmatch(name) or _CONTROL.search(value):
            # Only where: what is not key=value may be a piece of a value (a key with a comma).
            raise TracingConfigError(
                f"OTEL_EXPORTER_OTLP_HEADERS: entry {number} (of the comma-separated list) is not "
                "name=value with a header name (the entry is not shown: it may hold a secret)"
            )
        headers[name] = value
    return headers


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")
"""An HTTP header name (RFC 9110 token), lower case."""
# What the SDK's own (liberal) parser of the same variable takes: the exporter parses the
# environment's value again whatever it is given, and logs an entry it cannot read, value included.
_HEADER_DELIMITER = re.compile(r"[ \t]*,[ \t]*")
_HEADER_ENTRY = re.compile(
    r"[ \t]*([\x21\x23-\x27\x2a\x2b\x2d\x2e\x30-\x39\x41-\x5a\x5e-\x7a\x7c\x7e]+)[ \t]*=[ \t]*"
    r"([\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*)[ \t]*"
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
"""Not in a header value, once decoded (a CR/LF would make the HTTP library quote the value)."""


def _checked_endpoint(url: str, variable: str) -> str:
    """``url`` if it can be logged as it is: an http(s) URL with no user, password or query (a
    backend's key goes in OTEL_EXPORTER_OTLP_HEADERS, which is never logged)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TracingConfigError(f"{variable} must be an http:// or https:// URL")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise TracingConfigError(
            f"{variable} must not carry credentials or a query: put a key in OTEL_EXPORTER_OTLP_HEADERS"
        )
    return url


def tracing_on(settings: Settings) -> bool:
    """Whether the settings ask for traces (an endpoint, and neither the SDK nor the exporter off)."""
    exporter_name = settings.otel_traces_exporter.strip().lower()
    return not settings.otel_sdk_disabled and exporter_name != "none" and _endpoint(settings) is not None


def build_tracing(settings: Settings) -> Tracing:
    """Raises ``TracingConfigError`` for an exporter or protocol this service does not speak."""
    endpoint = _endpoint(settings)
    if not tracing_on(settings) or endpoint is None:
        return NO_TRACING
    exporter_name = settings.otel_traces_exporter.strip().lower()
    if exporter_name != "otlp":
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER={settings.otel_traces_exporter!r} is not supported: use otlp (or none)"
        )
    protocol = (settings.otel_exporter_otlp_traces_protocol or settings.otel_exporter_otlp_protocol).strip()
    if protocol != SUPPORTED_PROTOCOL:
        raise TracingConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: this service exports "
            f"{SUPPORTED_PROTOCOL} (a collector's port 4318)"
        )
    endpoint = _checked_endpoint(
        endpoint,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        if settings.otel_exporter_otlp_traces_endpoint
        else "OTEL_EXPORTER_OTLP_ENDPOINT",
    )
    headers = _headers(settings)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Sampler, span limits, batch sizes, the export's timeout, compression and certificates: the
    # SDK takes them from their standard OTEL_* variables itself.
    resource = Resource.create(
        {SERVICE_VERSION: __version__}
        | ({SERVICE_NAME: settings.otel_service_name} if settings.otel_service_name else {})
    )
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        # Named neither by OTEL_SERVICE_NAME nor in OTEL_RESOURCE_ATTRIBUTES.
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    # No exit hook per provider: the app's lifespan shuts it down (tests build many apps).
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    exporter: Any = OTLPSpanExporter(endpoint=endpoint, headers=headers)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info(
        "tracing: OTLP/HTTP export on",
        extra={
            "endpoint": endpoint,
            "capture_content": settings.otel_instrumentation_genai_capture_message_content,
        },
    )
    return Tracing(
        provider,
        capture_content=settings.otel_instrumentation_genai_capture_message_content,
    )
