"""OpenTelemetry traces of runs, LLM calls and tool calls, after the GenAI semantic conventions.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set: then
``Tracing`` owns a tracer provider of its own (one per app, never the process-global one) that sends
spans in batches over OTLP/HTTP. The engine knows nothing of it: the service wraps each model's LLM
(``chat`` spans), the run's tool registry (``execute_tool`` spans), runs each attempt of a run in an
``invoke_agent`` span, and puts a server span around each HTTP request (``http``). Off, none of the
wrappers exists: tracing costs nothing.
"""

from app.tracing.setup import NO_TRACING, Tracing, TracingConfigError, build_tracing, tracing_on

__all__ = ["NO_TRACING", "Tracing", "TracingConfigError", "build_tracing", "tracing_on"]
