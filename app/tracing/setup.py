"""``build_tracing(settings)``: the service's ``Tracing``, on when an OTLP endpoint is configured."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from app import __version__
from app.llm.base import LLM
from app.llm.models import ModelSpec
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
    NoRunSpan,
    RunSpan,
    TracedLLM,
    provider_name,
    server_attributes,
    tool_observer,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

log = logging.getLogger("app.tracing")

SUPPORTED_PROTOCOL = "http/protobuf"
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

    def llm(self, spec: ModelSpec, llm: LLM) -> LLM:
        """``llm`` (the model of ``spec``) with a ``chat`` span around each call."""
        if self.tracer is None:
            return llm
        return TracedLLM(
            llm,
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
        self, *, run_id: str, conversation_id: str, attempt: int, spec: ModelSpec, traceparent: str | None
    ) -> RunSpan | NoRunSpan:
        """The ``invoke_agent`` span of an attempt, a child of the request that started the run."""
        if self.tracer is None:
            return NO_RUN_SPAN
        attributes = {
            OPERATION: "invoke_agent",
            PROVIDER: _provider(spec),
            AGENT_NAME: AGENT,
            CONVERSATION_ID: conversation_id,
            REQUEST_MODEL: spec.model,
            "agentstream.run.id": run_id,
            "agentstream.run.attempt": attempt,
            "agentstream.model": spec.name,
        }
        return RunSpan(self.tracer, attributes, traceparent)

    def traceparent(self) -> str | None:
        """The current span's context (the HTTP request's, at a run's start) as a W3C
        ``traceparent``: a run's attempts are its children, whichever worker runs them."""
        if not self.enabled:
            return None
        from opentelemetry import trace

        ctx = trace.get_current_span().get_span_context()
        if not ctx.is_valid:
            return None
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    async def shutdown(self) -> None:
        """Export what is still buffered (bounded by the exporter's timeout), then stop."""
        if self._provider is not None:
            await asyncio.to_thread(self._provider.shutdown)


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
    from opentelemetry.util.re import parse_env_headers

    raw = settings.otel_exporter_otlp_traces_headers or settings.otel_exporter_otlp_headers
    return parse_env_headers(raw.get_secret_value(), liberal=True) if raw is not None else None


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
    provider = TracerProvider(resource=resource)
    exporter: Any = OTLPSpanExporter(endpoint=endpoint, headers=_headers(settings))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info(
        "tracing: OTLP/HTTP export on",
        extra={
            "endpoint": _shown(endpoint),
            "capture_content": settings.otel_instrumentation_genai_capture_message_content,
        },
    )
    return Tracing(
        provider,
        capture_content=settings.otel_instrumentation_genai_capture_message_content,
    )


def _shown(url: str) -> str:
    """The endpoint without credentials a URL might carry, for the log."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"
