"""A run's trace survives its worker (issue 16 with RUNS.md R-03): the single process on the
embedded default, tracing to an OTLP receiver, killed with SIGKILL inside a tool and started
again, carries the run on in the same trace, under the request that started it; its JSON log
lines and the MCP server's requests carry that trace."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.durable.support import (
    PlanAgent,
    journal_entries,
    mcp_servers,
    read_until_reached,
    send_hold,
)
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    clients_fixture,
    fake_llm_serving,
    worker_env,
)
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.timeout(60, func_only=True), pytest.mark.slow]


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with fake_llm_serving() as fake:
        yield fake


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as started:
        yield started


def request_span(trace_id: str) -> Callable[[list[ReceivedSpan]], bool]:
    return lambda spans: any(s.trace_id == trace_id and s.kind == "SERVER" for s in spans)


def attempt_span(run_id: str, attempt: int) -> Callable[[list[ReceivedSpan]], bool]:
    return lambda spans: any(
        s.attributes.get("agentstream.run.id") == run_id
        and s.attributes.get("agentstream.run.attempt") == attempt
        for s in spans
    )


def test_a_killed_process_started_again_carries_its_run_on_in_the_same_trace(
    llm: FakeLLM,
    sqlite_migrated_template: Path,
    tmp_path: Path,
    clients: Callable[..., Api],
    receiver: OtlpReceiver,
) -> None:
    database = tmp_path / "agentstream.db"
    database.write_bytes(sqlite_migrated_template.read_bytes())
    journal = tmp_path / "mcp.journal"
    env = worker_env(
        f"sqlite+aiosqlite:///{database}",
        llm.base_url,
        MCP_SERVERS=mcp_servers(journal),
        RUN_LEASE_S="30",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="50",  # the SDK's own variable: spans leave within 50 ms
        LOG_FORMAT="json",
        LOG_LEVEL="INFO",
    )
    agent = llm.play(PlanAgent(hold="tool"))  # type: ignore[arg-type]
    hold = send_hold(journal)
    hold.touch()
    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    first = ServerProcess(env).start(tmp_path / "first.log")
    successor: ServerProcess | None = None
    try:
        api = clients(first.base_url)
        conv = api.create_conversation(completion_check=False)
        response = api.http.post(
            f"/api/conversations/{conv}/runs",
            json={"message": "work through the plan"},
            headers={"traceparent": f"00-{trace_id}-{caller}-01"},
        )
        assert response.status_code == 202, response.text
        run_id = response.json()["run_id"]
        with api.stream(conv) as stream:
            read_until_reached(stream, agent, journal, run_id, "tool")
            # The request ended long ago: its span has left before the crash.
            receiver.wait_for_spans(request_span(trace_id), what="the request's span")
            first.kill()
        agent.release.set()
        hold.unlink(missing_ok=True)

        successor = ServerProcess(env).start(tmp_path / "successor.log")
        again = clients(successor.base_url)
        run = again.wait_finished(run_id, timeout=30)
        spans = receiver.wait_for_spans(attempt_span(run_id, 2), what="the second attempt's span")
    finally:
        agent.release.set()
        hold.unlink(missing_ok=True)
        first.kill()
        if successor is not None:
            successor.stop()

    assert (run["status"], run["attempt"], run["trace_id"]) == ("completed", 2, trace_id)
    (request,) = [s for s in spans if s.trace_id == trace_id and s.kind == "SERVER"]
    assert request.parent_span_id == caller
    (second,) = [s for s in spans if s.attributes.get("agentstream.run.attempt") == 2]
    # The attempt of the new process hangs under the request the dead one served.
    assert (second.trace_id, second.parent_span_id) == (trace_id, request.span_id)
    assert second.attributes["agentstream.run.outcome"] == "completed"
    tools = [s for s in spans if s.parent_span_id == second.span_id and s.name.startswith("execute_tool")]
    assert "execute_tool calculator" in {s.name for s in tools}

    # Every MCP request of the run carried the trace, from a span of its own (its tool call's).
    entries = [e for e in journal_entries(journal, run_id) if e["at"] == "start"]
    assert {e["tool"] for e in entries} == {"lookup", "send"}, entries
    parents = [e["traceparent"].split("-") for e in entries]
    assert all(p[1] == trace_id and p[2] not in {caller, request.span_id} for p in parents), entries

    # The successor's log lines of the run name its trace and the attempt's span.
    lines = [json.loads(line) for line in successor.logs().splitlines() if line.startswith("{")]
    resumed = [line for line in lines if line.get("msg") == "run resumed"]
    assert resumed and resumed[0]["trace_id"] == trace_id and resumed[0]["span_id"] == second.span_id, resumed
