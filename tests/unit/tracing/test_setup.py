"""When the service traces (``build_tracing``), and the context a run's spans hang under."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from app.llm.models import ModelRegistry, ModelSpec
from app.settings import Settings
from app.tools.registry import ToolRegistry
from app.tracing import NO_TRACING, Tracing, TracingConfigError, build_tracing, tracing_on
from app.tracing.genai import NO_RUN_SPAN, ChatSpans, parent_context
from app.tracing.setup import _endpoint, _headers


def settings(**values: Any) -> Settings:
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


SPEC = ModelSpec(name="default", model="m", base_url="http://127.0.0.1:9/v1")
MODELS = ModelRegistry([SPEC], {})


def test_without_an_endpoint_tracing_is_off_and_wraps_nothing() -> None:
    tracing = build_tracing(settings())
    registry = ToolRegistry()

    assert tracing is NO_TRACING and not tracing_on(settings())
    assert tracing.chat_spans(SPEC) is None
    assert tracing.tools(registry) is registry
    assert (
        tracing.run_span(
            run_id="r", conversation_id="c", attempt=1, model="default", models=MODELS, traceparent=None
        )
        is NO_RUN_SPAN
    )
    assert tracing.traceparent() is None


@pytest.mark.parametrize(
    "values",
    [{"otel_sdk_disabled": True}, {"otel_traces_exporter": "none"}, {"otel_traces_exporter": " NONE "}],
)
def test_the_standard_switches_turn_tracing_off_even_with_an_endpoint(values: dict[str, Any]) -> None:
    assert (
        build_tracing(settings(otel_exporter_otlp_endpoint="http://127.0.0.1:4318", **values)) is NO_TRACING
    )


def test_an_empty_endpoint_is_unset() -> None:
    assert settings(otel_exporter_otlp_endpoint="  ").otel_exporter_otlp_endpoint is None
    assert build_tracing(settings(otel_exporter_otlp_endpoint="")) is NO_TRACING


def test_the_traces_url_follows_the_otlp_exporter_rules() -> None:
    # The base endpoint gets the signal's path; the signal's own endpoint is taken as it is.
    assert _endpoint(settings(otel_exporter_otlp_endpoint="http://c:4318/")) == "http://c:4318/v1/traces"
    assert (
        _endpoint(settings(otel_exporter_otlp_endpoint="http://c:4318/otel"))
        == "http://c:4318/otel/v1/traces"
    )
    both = settings(
        otel_exporter_otlp_endpoint="http://c:4318", otel_exporter_otlp_traces_endpoint="http://t/x"
    )
    assert _endpoint(both) == "http://t/x"


def test_headers_are_parsed_from_the_standard_format_and_the_signals_own_win() -> None:
    assert _headers(settings(otel_exporter_otlp_headers="Authorization=Basic%20abc,x-team=a")) == {
        "authorization": "Basic abc",
        "x-team": "a",
    }
    both = settings(otel_exporter_otlp_headers="a=1", otel_exporter_otlp_traces_headers="b=2")
    assert _headers(both) == {"b": "2"}
    assert _headers(settings()) is None


def test_headers_are_a_secret_in_the_settings() -> None:
    shown = repr(settings(otel_exporter_otlp_headers="Authorization=Bearer sk-top-secret"))
    assert "sk-top-secret" not in shown


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"otel_exporter_otlp_protocol": "grpc"}, "grpc"),
        ({"otel_exporter_otlp_traces_protocol": "http/json"}, "http/json"),
        ({"otel_traces_exporter": "zipkin"}, "zipkin"),
    ],
)
def test_what_the_service_cannot_export_stops_the_start_naming_it(values: dict[str, Any], named: str) -> None:
    with pytest.raises(TracingConfigError, match=named):
        build_tracing(settings(otel_exporter_otlp_endpoint="http://127.0.0.1:4318", **values))


async def test_an_endpoint_turns_tracing_on_with_a_provider_of_its_own() -> None:
    tracing = build_tracing(
        settings(otel_exporter_otlp_endpoint="http://127.0.0.1:9", otel_service_name="svc-under-test")
    )
    try:
        assert tracing.enabled and tracing.tracer is not None
        assert isinstance(tracing.chat_spans(SPEC), ChatSpans)
        # Not the process-global provider: many apps can live in one process.
        assert trace.get_tracer_provider() is not tracing._provider
        assert tracing._provider is not None
        assert tracing._provider.resource.attributes["service.name"] == "svc-under-test"
    finally:
        await tracing.shutdown()


def test_traceparent_is_the_current_spans_context_and_parent_context_reads_it_back() -> None:
    tracing = Tracing(TracerProvider())
    assert tracing.tracer is not None
    with tracing.tracer.start_as_current_span("request") as span:
        traceparent = tracing.traceparent()
    ctx = span.get_span_context()
    assert traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    assert int(ctx.trace_flags) & 1, "sampled"

    parent = trace.get_current_span(parent_context(traceparent)).get_span_context()
    assert (parent.trace_id, parent.span_id, parent.is_remote) == (ctx.trace_id, ctx.span_id, True)


@pytest.mark.parametrize("stored", [None, "", "garbage", "00-xyz-abc-01", f"00-{'0' * 32}-{'0' * 16}-01"])
def test_a_missing_or_broken_traceparent_gives_a_root_span_whatever_the_current_span(
    stored: str | None,
) -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("the claim loop's request, say"):
        parent = trace.get_current_span(parent_context(stored))
    assert not parent.get_span_context().is_valid


@pytest.mark.parametrize(
    ("service_name", "resource_attributes", "expected"),
    [
        (None, None, "agentstream"),
        (None, "service.name=from-resource,team=a", "from-resource"),
        ("from-setting", "service.name=from-resource", "from-setting"),
    ],
)
async def test_the_service_name_is_otel_service_name_then_the_resources_then_agentstream(
    monkeypatch: pytest.MonkeyPatch, service_name: str | None, resource_attributes: str | None, expected: str
) -> None:
    if resource_attributes is not None:
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", resource_attributes)  # read by the SDK itself
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    tracing = build_tracing(
        settings(otel_exporter_otlp_endpoint="http://127.0.0.1:9", otel_service_name=service_name)
    )
    try:
        assert tracing._provider is not None
        assert tracing._provider.resource.attributes["service.name"] == expected
    finally:
        await tracing.shutdown()


@pytest.mark.parametrize(
    "raw",
    ["Authorization: Bearer sk-top-secret", "Authorization=Bearer sk-ok,sk-top-secret", "=sk-top-secret"],
)
def test_headers_that_are_not_key_value_stop_the_start_without_showing_a_value(raw: str) -> None:
    with pytest.raises(TracingConfigError) as caught:
        build_tracing(
            settings(otel_exporter_otlp_endpoint="http://127.0.0.1:9", otel_exporter_otlp_headers=raw)
        )
    assert "sk-top-secret" not in str(caught.value) and "sk-ok" not in str(caught.value)
    assert "OTEL_EXPORTER_OTLP_HEADERS" in str(caught.value)


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://user:sk-top-secret@collector:4318",
        "http://collector:4318?api_key=sk-top-secret",
        "ftp://collector",
    ],
)
def test_an_endpoint_with_credentials_a_query_or_another_scheme_stops_the_start(endpoint: str) -> None:
    with pytest.raises(TracingConfigError) as caught:
        build_tracing(settings(otel_exporter_otlp_endpoint=endpoint))
    assert "sk-top-secret" not in str(caught.value)


async def test_shutdown_gives_up_on_a_collector_that_never_answers() -> None:
    # A socket that takes connections (the kernel's backlog) and never answers: the exporter
    # would wait for its 10 s timeout, and the SDK's shutdown for 30 s.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        tracing = build_tracing(settings(otel_exporter_otlp_endpoint=f"http://127.0.0.1:{port}"))
        assert tracing.tracer is not None
        tracing.tracer.start_span("unsent").end()

        await asyncio.wait_for(tracing.shutdown(timeout_s=0.2), timeout=5)


@pytest.mark.parametrize(
    "raw",
    [
        "x-api-key=abc;SECRETPART",  # the SDK's parser of the same variable would log it
        'x-api-key="SECRETPART"',
        "x-api-key=ab%0D%0ASECRETPART",  # a CR/LF, once decoded: the HTTP library would quote it
        "x-api-key=SECRETPART\u00e9",
    ],
)
def test_header_values_the_sdk_or_http_would_quote_stop_the_start_from_the_environment_too(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", raw)

    with pytest.raises(TracingConfigError) as caught:
        build_tracing(Settings(_env_file=None))  # type: ignore[call-arg]

    assert "SECRETPART" not in str(caught.value)
    assert "SECRETPART" not in caplog.text


async def test_headers_from_the_environment_in_the_standard_form_reach_the_exporter_unlogged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "Authorization=Basic%20SECRETPART, x-team = a")

    tracing = build_tracing(Settings(_env_file=None))  # type: ignore[call-arg]
    try:
        assert tracing.enabled
        assert "SECRETPART" not in caplog.text
    finally:
        await tracing.shutdown()
