"""OpenTelemetry traces of the real service (issue 16, API.md ``OTEL_*``): spans through the real
OTLP/HTTP exporter into a receiver on loopback that decodes the protobuf (``OtlpReceiver``).

A run is one trace: the HTTP request that started it (a server span, continuing the caller's
``traceparent``), under it the run's ``invoke_agent`` span, under that a ``chat`` span per LLM call
and an ``execute_tool`` span per tool call, with the GenAI semantic conventions' attributes.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from app.main import build_services
from app.runs.instrumented import InstrumentedLLM
from app.settings import Settings
from app.tools.registry import Tool
from app.tracing import TracingConfigError
from app.tracing.http import ServerSpans
from tests.integration.service.conftest import Api, RunOutcome, Service, ServiceFactory
from tests.integration.service.test_models_resume import entries, hand_over_a_run_on_b
from tests.support.fake_agents import ToolAgentBehaviour
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.fake_replies import FakeReply
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.server import wait_until

USAGE = (13, 4)
QUESTION = "What is 6*7?"
CONTENT_KEYS = {
    "gen_ai.input.messages",
    "gen_ai.output.messages",
    "gen_ai.system_instructions",
    "gen_ai.tool.definitions",
    "gen_ai.tool.call.arguments",
    "gen_ai.tool.call.result",
}


@pytest.fixture
def database_backend() -> str:
    return "sqlite"


@pytest.fixture(autouse=True)
def prompt_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch processor's standard variable (read by the SDK): spans leave within 50 ms, so a
    test waits for them rather than for the 5 s default."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as started:
        yield started


@pytest.fixture
def tool_llm(fake_llm: FakeOpenAIServer) -> FakeOpenAIServer:
    """The fake provider plays an agent that calls ``calculator`` once, then answers."""
    fake_llm.set_handler(ToolAgentBehaviour(usage=USAGE))
    return fake_llm


@pytest.fixture
def traced(receiver: OtlpReceiver, service: ServiceFactory) -> Callable[..., Service]:
    """``traced(llm, **settings)``: the service exporting to the receiver (no ``llm``: the
    models of ``llm_models`` only). The receiver first: it then stops after the services, which
    send it their last spans as they stop."""

    def make(llm: FakeOpenAIServer | None = None, **settings: Any) -> Service:
        return service(llm=llm, otel_exporter_otlp_endpoint=receiver.endpoint, **settings)

    return make


def new_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def run_with_traceparent(api: Api, traceparent: str, agent: dict[str, Any] | None = None) -> RunOutcome:
    conversation = api.create_conversation({"agent": agent} if agent else None)["id"]
    response = api.http.post(
        f"/api/conversations/{conversation}/runs",
        json={"message": QUESTION},
        headers={"traceparent": traceparent},
    )
    assert response.status_code == 202, response.text
    return RunOutcome(response.json(), api.stream(conversation))


def run_spans_ended(run_id: str, count: int = 1) -> Callable[[list[ReceivedSpan]], bool]:
    """The ``invoke_agent`` span(s) of ``run_id`` have arrived (exported once ended; its children
    end before it)."""

    def done(spans: list[ReceivedSpan]) -> bool:
        return len(of_run(spans, run_id)) >= count

    return done


def of_run(spans: list[ReceivedSpan], run_id: str) -> list[ReceivedSpan]:
    return [
        s
        for s in spans
        if s.name.startswith("invoke_agent") and s.attributes.get("agentstream.run.id") == run_id
    ]


def children(spans: list[ReceivedSpan], parent: ReceivedSpan, prefix: str = "") -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_span_id == parent.span_id and s.name.startswith(prefix)]


def content_attributes(spans: list[ReceivedSpan]) -> set[str]:
    return {key for span in spans for key in span.attributes if key in CONTENT_KEYS}


# -- one run, one trace -------------------------------------------------------------------------


def test_a_run_is_one_trace_under_the_request_that_started_it(
    traced: Callable[..., Service], tool_llm: FakeOpenAIServer, receiver: OtlpReceiver
) -> None:
    api = traced(tool_llm).api()
    traceparent, trace_id, caller_span = new_traceparent()

    outcome = run_with_traceparent(api, traceparent)

    assert outcome.done["status"] == "completed", outcome.done
    spans = receiver.wait_for_spans(run_spans_ended(outcome.run_id), what="the run's span")
    spans = [s for s in spans if s.trace_id == trace_id]
    (request,) = [s for s in spans if s.kind == "SERVER" and s.name.endswith("/runs")]
    assert request.name == "POST /api/conversations/{conversation_id}/runs"
    assert request.parent_span_id == caller_span, "the request continues the caller's trace"
    assert request.attributes["http.route"] == "/api/conversations/{conversation_id}/runs"
    assert request.attributes["http.response.status_code"] == 202

    (run,) = of_run(spans, outcome.run_id)
    assert run.parent_span_id == request.span_id
    assert (run.name, run.kind, run.status) == ("invoke_agent agentstream", "INTERNAL", "UNSET")
    conversation_id = outcome.started["conversation_id"]
    assert {
        key: run.attributes[key]
        for key in (
            "gen_ai.operation.name",
            "gen_ai.provider.name",
            "gen_ai.agent.name",
            "gen_ai.conversation.id",
            "gen_ai.request.model",
            "agentstream.run.attempt",
            "agentstream.run.outcome",
            "agentstream.model",
        )
    } == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "openai_compatible",
        "gen_ai.agent.name": "agentstream",
        "gen_ai.conversation.id": conversation_id,
        "gen_ai.request.model": "api-test-model",
        "agentstream.run.attempt": 1,
        "agentstream.run.outcome": "completed",
        "agentstream.model": "default",
    }

    chats = children(spans, run, "chat ")
    usage = outcome.done["usage"]
    assert len(chats) == usage["llm_calls"] == len(tool_llm.requests)
    for chat in chats:
        assert (chat.name, chat.kind, chat.status) == ("chat api-test-model", "CLIENT", "UNSET")
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.provider.name"] == "openai_compatible"
        assert chat.attributes["gen_ai.request.model"] == "api-test-model"
        assert chat.attributes["gen_ai.response.model"] == "api-test-model"
        assert chat.attributes["gen_ai.conversation.id"] == conversation_id
        assert (
            chat.attributes["gen_ai.usage.input_tokens"],
            chat.attributes["gen_ai.usage.output_tokens"],
        ) == USAGE
        assert chat.attributes["server.address"] == "127.0.0.1"
        assert chat.attributes["gen_ai.response.finish_reasons"]
    # One call streams: the answer's synthesis, with its time to the first token.
    (streamed,) = [c for c in chats if c.attributes.get("gen_ai.request.stream")]
    assert streamed.attributes["gen_ai.response.time_to_first_chunk"] >= 0
    # The run's tokens are its calls' tokens, which are the provider's.
    assert run.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] == USAGE[0] * len(chats)
    assert run.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == USAGE[1] * len(chats)

    (tool,) = children(spans, run, "execute_tool")
    assert (tool.name, tool.kind, tool.status) == ("execute_tool calculator", "INTERNAL", "UNSET")
    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
    assert tool.attributes["gen_ai.tool.name"] == "calculator"
    assert tool.attributes["gen_ai.tool.type"] == "function"
    assert tool.attributes["gen_ai.tool.call.id"]
    assert "error.type" not in tool.attributes
    # Only the run's own spans hang under it, and nothing of the contents without the opt-in.
    assert len(children(spans, run)) == len(chats) + 1
    assert content_attributes(spans) == set()
    assert run.resource["service.name"] == "agentstream"

    assert api.get_run(outcome.run_id)["trace_id"] == trace_id


def test_contents_are_recorded_with_the_opt_in(
    traced: Callable[..., Service], tool_llm: FakeOpenAIServer, receiver: OtlpReceiver
) -> None:
    api = traced(tool_llm, otel_instrumentation_genai_capture_message_content=True).api()

    outcome = run_with_traceparent(api, new_traceparent()[0])

    spans = receiver.wait_for_spans(run_spans_ended(outcome.run_id))
    (run,) = of_run(spans, outcome.run_id)
    (tool,) = children(spans, run, "execute_tool")
    assert json.loads(tool.attributes["gen_ai.tool.call.arguments"]) == {"expression": "6*7"}
    assert tool.attributes["gen_ai.tool.call.result"] == "6*7 = 42"
    first = min(children(spans, run, "chat "), key=lambda s: s.start_ns)
    inputs = json.loads(first.attributes["gen_ai.input.messages"])
    assert {"type": "text", "content": QUESTION} in inputs[-1]["parts"]
    assert json.loads(first.attributes["gen_ai.system_instructions"])[0]["type"] == "text"
    assert "calculator" in {t["name"] for t in json.loads(first.attributes["gen_ai.tool.definitions"])}
    (asked,) = json.loads(first.attributes["gen_ai.output.messages"])
    (call,) = [p for p in asked["parts"] if p["type"] == "tool_call"]
    # The tool's span is the call the model asked for.
    assert (call["name"], call["id"]) == ("calculator", tool.attributes["gen_ai.tool.call.id"])
    last = max(children(spans, run, "chat "), key=lambda s: s.start_ns)
    (answer,) = json.loads(last.attributes["gen_ai.output.messages"])
    assert answer["parts"][0]["content"] == outcome.done["answer"]


# -- errors -------------------------------------------------------------------------------------


def test_a_failing_tool_has_an_error_span_and_the_run_goes_on(
    traced: Callable[..., Service], fake_llm: FakeOpenAIServer, receiver: OtlpReceiver
) -> None:
    async def explode(**_: Any) -> str:
        raise RuntimeError("the disk is full")

    fake_llm.set_handler(ToolAgentBehaviour("explode", {}, usage=USAGE))
    svc = traced(fake_llm)
    svc.add_tool(Tool("explode", "Always fails.", {"type": "object", "properties": {}}, explode))

    outcome = run_with_traceparent(svc.api(), new_traceparent()[0])

    spans = receiver.wait_for_spans(run_spans_ended(outcome.run_id))
    (run,) = of_run(spans, outcome.run_id)
    (tool,) = children(spans, run, "execute_tool")
    assert (tool.name, tool.status) == ("execute_tool explode", "ERROR")
    assert tool.attributes["error.type"] == "RuntimeError"
    assert "the disk is full" in tool.status_message
    assert (outcome.done["status"], run.status) == ("completed", "UNSET")


def test_a_refused_call_has_the_providers_status_as_error_type_and_the_run_fails(
    traced: Callable[..., Service], fake_llm: FakeOpenAIServer, receiver: OtlpReceiver
) -> None:
    fake_llm.set_handler(lambda body: FakeReply.error(401))

    outcome = run_with_traceparent(traced(fake_llm).api(), new_traceparent()[0])

    assert outcome.done["status"] == "failed"
    spans = receiver.wait_for_spans(run_spans_ended(outcome.run_id))
    (run,) = of_run(spans, outcome.run_id)
    (chat,) = children(spans, run, "chat ")
    assert (chat.status, chat.attributes["error.type"]) == ("ERROR", "401")
    assert (run.status, run.attributes["error.type"]) == ("ERROR", "run_failed")
    assert run.attributes["agentstream.run.outcome"] == "failed"


def test_a_call_that_falls_back_is_a_span_per_model_and_an_event_on_the_run(
    traced: Callable[..., Service], fake_llm: FakeOpenAIServer, receiver: OtlpReceiver
) -> None:
    fake_llm.set_handler(lambda body: FakeReply.error(503))
    with FakeOpenAIServer(model="backup-model") as backup:
        backup.set_handler(ToolAgentBehaviour(usage=USAGE))
        models = [
            {
                "name": "main",
                "base_url": fake_llm.base_url,
                "model": "main-model",
                "max_retries": 0,
                "fallback": "spare",
            },
            {"name": "spare", "base_url": backup.base_url, "model": "backup-model", "max_retries": 0},
        ]
        outcome = run_with_traceparent(
            traced(fake_llm, llm_models=json.dumps(models)).api(), new_traceparent()[0]
        )

    assert outcome.done["status"] == "completed", outcome.done
    spans = receiver.wait_for_spans(run_spans_ended(outcome.run_id))
    (run,) = of_run(spans, outcome.run_id)
    chats = children(spans, run, "chat ")
    failed = [c for c in chats if c.status == "ERROR"]
    assert {c.name for c in failed} == {"chat main-model"}
    assert {c.attributes["error.type"] for c in failed} == {"LLMUnavailableError"}
    assert len([c for c in chats if c.name == "chat backup-model"]) == len(backup.requests)
    fallbacks = [attrs for name, attrs in run.events if name == "agentstream.fallback"]
    assert fallbacks and fallbacks[0] == {"from_model": "main", "to_model": "spare"}


# -- off ----------------------------------------------------------------------------------------


def test_without_an_endpoint_nothing_traces_and_runs_have_no_trace_id(
    service: ServiceFactory, tool_llm: FakeOpenAIServer
) -> None:
    svc = service(llm=tool_llm)
    api = svc.api()

    outcome = run_with_traceparent(api, new_traceparent()[0])

    assert outcome.done["status"] == "completed"
    assert api.get_run(outcome.run_id)["trace_id"] is None
    # Nothing in the way of a request or a run: no middleware, no wrapped model or tools.
    assert svc.services.tracing.enabled is False
    assert ServerSpans not in {m.cls for m in svc.server.app.user_middleware}
    assert type(svc.services.models.llm("default")) is InstrumentedLLM


def test_otel_sdk_disabled_turns_tracing_off_with_an_endpoint_set(
    traced: Callable[..., Service], tool_llm: FakeOpenAIServer, receiver: OtlpReceiver
) -> None:
    svc = traced(tool_llm, otel_sdk_disabled=True)

    outcome = run_with_traceparent(svc.api(), new_traceparent()[0])

    assert outcome.done["status"] == "completed"
    svc.stop()
    assert receiver.requests == 0


async def test_an_exporter_protocol_the_service_does_not_speak_stops_the_start(
    migrated_database_url: str,
) -> None:
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        database_url=migrated_database_url,
        otel_exporter_otlp_endpoint="http://127.0.0.1:4317",
        otel_exporter_otlp_protocol="grpc",
    )
    with pytest.raises(TracingConfigError, match="grpc"):
        await build_services(settings)


# -- a run carried on, /v1 --------------------------------------------------------------------


def test_a_run_handed_over_to_another_worker_continues_its_trace(
    traced: Callable[..., Service], receiver: OtlpReceiver
) -> None:

    with FakeOpenAIServer(model="a-model") as a, FakeOpenAIServer(model="b-model") as b:
        conversation, run_id = hand_over_a_run_on_b(traced, a, b)
        api = traced(llm_models=json.dumps(entries(a, b)), run_lease_s=1.0).api()
        events = api.stream(conversation)

    assert events[-1].data["status"] == "completed"
    spans = receiver.wait_for_spans(run_spans_ended(run_id, 2), what="both attempts' spans")
    first, second = sorted(of_run(spans, run_id), key=lambda s: s.attributes["agentstream.run.attempt"])
    (request,) = [s for s in spans if s.kind == "SERVER" and s.name.endswith("/runs")]
    assert [s.attributes["agentstream.run.attempt"] for s in (first, second)] == [1, 2]
    assert [s.attributes["agentstream.run.outcome"] for s in (first, second)] == ["handed_over", "completed"]
    for attempt in (first, second):
        assert (attempt.trace_id, attempt.parent_span_id) == (request.trace_id, request.span_id)
        assert attempt.attributes["agentstream.model"] == "b"
        assert attempt.attributes["gen_ai.request.model"] == "b-model"
    assert api.get_run(run_id)["trace_id"] == request.trace_id
    # Each attempt's tokens are its own calls': together the run's.
    usage = events[-1].data["usage"]
    assert sum(s.attributes["gen_ai.usage.input_tokens"] for s in (first, second)) == usage["prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_v1_chat_completion_is_traced_under_its_request(
    traced: Callable[..., Service], tool_llm: FakeOpenAIServer, receiver: OtlpReceiver, stream: bool
) -> None:
    api = traced(tool_llm).api()
    traceparent, trace_id, _ = new_traceparent()

    response = api.http.post(
        "/v1/chat/completions",
        json={"model": "agentstream", "messages": [{"role": "user", "content": QUESTION}], "stream": stream},
        headers={"traceparent": traceparent},
    )

    assert response.status_code == 200, response.text
    spans = receiver.wait_for_spans(
        # The request's span ends after its response: it may come in a later batch than the run's.
        lambda got: (
            {s.kind for s in got if s.trace_id == trace_id} >= {"SERVER", "INTERNAL"}
            and any(s.name.startswith("invoke_agent") and s.trace_id == trace_id for s in got)
        )
    )
    (request,) = [s for s in spans if s.trace_id == trace_id and s.kind == "SERVER"]
    (run,) = [s for s in spans if s.trace_id == trace_id and s.name.startswith("invoke_agent")]
    assert request.name == "POST /v1/chat/completions"
    assert run.parent_span_id == request.span_id
    assert children(spans, run, "execute_tool calculator")


def test_a_run_closed_without_an_attempt_ends_its_trace_saying_why(
    traced: Callable[..., Service], receiver: OtlpReceiver
) -> None:

    with FakeOpenAIServer(model="a-model") as a, FakeOpenAIServer(model="b-model") as b:
        conversation, run_id = hand_over_a_run_on_b(traced, a, b)
        # The next deploy no longer has "b": the run is closed, not carried on.
        only_a = json.dumps(entries(a, b)[:1])
        events = traced(llm_models=only_a, run_lease_s=1.0).api().stream(conversation)

    assert events[-1].data["status"] == "failed"
    spans = receiver.wait_for_spans(run_spans_ended(run_id, 2), what="both attempts' spans")
    closed = max(of_run(spans, run_id), key=lambda s: s.attributes["agentstream.run.attempt"])
    (request,) = [s for s in spans if s.kind == "SERVER" and s.name.endswith("/runs")]
    assert (closed.trace_id, closed.parent_span_id) == (request.trace_id, request.span_id)
    assert (closed.status, closed.attributes["agentstream.run.outcome"]) == ("ERROR", "failed")
    assert "'b' is no longer configured" in closed.status_message
    assert (closed.attributes["agentstream.model"], closed.attributes["gen_ai.provider.name"]) == (
        "b",
        "unknown",
    )


def test_a_run_that_waited_for_a_person_goes_on_in_the_same_trace(
    traced: Callable[..., Service], tool_llm: FakeOpenAIServer, receiver: OtlpReceiver
) -> None:
    api = traced(tool_llm).api()
    conversation = api.create_conversation({"agent": {"require_approval": ["calculator"]}})["id"]
    traceparent, trace_id, _ = new_traceparent()
    response = api.http.post(
        f"/api/conversations/{conversation}/runs",
        json={"message": QUESTION},
        headers={"traceparent": traceparent},
    )
    assert response.status_code == 202, response.text
    run_id = response.json()["run_id"]
    pending = wait_until(lambda: api.get_run(run_id)["pending_approvals"], what="the approval request")

    decided = api.http.post(
        f"/api/conversations/{conversation}/approvals/{pending[0]['approval_id']}",
        json={"decision": "approve"},
    )

    assert decided.status_code == 200, decided.text
    assert api.wait_finished(run_id)["status"] == "completed"
    spans = receiver.wait_for_spans(run_spans_ended(run_id, 2), what="the spans before and after the wait")
    waited, went_on = sorted(of_run(spans, run_id), key=lambda s: s.start_ns)
    (request,) = [
        s for s in spans if s.trace_id == trace_id and s.kind == "SERVER" and s.name.endswith("/runs")
    ]
    assert [s.attributes["agentstream.run.outcome"] for s in (waited, went_on)] == ["waiting", "completed"]
    for attempt in (waited, went_on):
        assert (attempt.trace_id, attempt.parent_span_id) == (trace_id, request.span_id)
    assert [name for name, _ in waited.events] == ["agentstream.approval_requested"]
    assert children(spans, went_on, "execute_tool calculator"), "the approved call ran in the run's trace"
