"""``/healthz``, ``/readyz`` and ``/metrics`` over a real socket."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.service.conftest import Api, Service, ServiceFactory
from tests.support.server import wait_until


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_healthz_and_readyz_answer_ok_when_database_and_bus_are_up(stack_api: Api) -> None:
    api = stack_api

    health = api.http.get("/healthz")
    ready = api.http.get("/readyz")

    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert ready.status_code == 200
    assert ready.json()["status"] == "ok"


@pytest.mark.redis
def test_readyz_is_503_naming_the_event_bus_when_redis_is_unreachable(
    service: ServiceFactory, closed_port_url: str
) -> None:
    api = service(redis_url=closed_port_url).api()

    ready = api.http.get("/readyz")
    health = api.http.get("/healthz")

    assert ready.status_code == 503
    body = ready.json()
    assert "event_bus" in body["down"]
    assert "database" not in body["down"]
    assert health.status_code == 200  # the process itself is fine


def test_metrics_count_runs_streams_events_llm_and_tool_calls_after_a_run(service: ServiceFactory) -> None:
    api = service().api()
    conv = api.create_conversation()
    outcome = api.run(conv["id"], "What is 6*7?")
    assert outcome.done["status"] == "completed"

    # The run leaves the active gauge a moment after its done event went out.
    def settled() -> httpx.Response | None:
        response = api.http.get("/metrics")
        return response if samples(response.text)[("agentstream_active_runs", ())] == 0 else None

    response = wait_until(settled, what="the active runs gauge to drop to 0")

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    values = samples(response.text)
    assert values[("agentstream_runs_total", (("status", "completed"),))] == 1
    assert values[("agentstream_runs_started_total", ())] == 1
    assert values[("agentstream_active_streams", ())] == 0
    assert values[("agentstream_events_published_total", ())] == len(outcome.events)
    llm_calls = sum(v for (name, _), v in values.items() if name == "agentstream_llm_calls_total")
    assert llm_calls == outcome.done["usage"]["llm_calls"]
    assert values[("agentstream_tool_calls_total", (("outcome", "ok"), ("tool", "calculator")))] == 1
    assert values[("agentstream_llm_latency_seconds_count", (("kind", "stream"), ("model", "default")))] >= 1


def test_probes_need_no_key_while_api_routes_do(shared_service: Service) -> None:
    svc = shared_service

    assert httpx.get(f"{svc.base_url}/healthz").status_code == 200
    assert httpx.get(f"{svc.base_url}/readyz").status_code == 200
    assert httpx.get(f"{svc.base_url}/api/tools").status_code == 401
