"""LLM faults through the service (ENGINE.md E-04, E-26, E-27): the run recovers or fails cleanly.

The service talks to the fake OpenAI server over HTTP (``LLM_BASE_URL``), exactly as it would to
a provider. Each fault is played once (or until the retries run out); for each the run ends with
a ``done`` event saying how it went, the events a client received are the stored ones, no
request of the test gets a 500, nothing in the service's log shows an unhandled exception, and
the service then answers ``/readyz`` and completes a new run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.integration.reliability.conftest import FaultyModel, ServiceLog
from tests.integration.service.workers_support import Api, answer_of, as_stored
from tests.support.fake_openai import FakeOpenAIServer, FakeReply
from tests.support.server import ServerThread

pytestmark = [pytest.mark.timeout(30), pytest.mark.parametrize("database_backend", ["sqlite"])]

TIMEOUT_S = 1.0
"""``LLM_TIMEOUT_S`` of the service under test; a hang outlasts it."""
RETRIES = 2
"""``LLM_MAX_RETRIES``: a call is tried at most three times."""


@dataclass(frozen=True)
class Fault:
    """What the model does wrong, and how the run must end."""

    loop: tuple[FakeReply, ...] = ()
    stream: tuple[FakeReply, ...] = ()
    status: str = "completed"
    error: str | None = None
    """A fragment of ``done.error``; None: the run reports no error."""
    iterations: int = 1
    llm_calls: int | None = None
    tool_error: str | None = None
    """A fragment of the error of the run's one tool step, when the fault is in a tool call."""
    extra: dict[str, Any] = field(default_factory=dict)


def _errors(status: int, count: int, **headers: str) -> tuple[FakeReply, ...]:
    return tuple(FakeReply.error(status, headers=headers) for _ in range(count))


FAULTS = {
    "429-with-retry-after": Fault(
        loop=_errors(429, 1, **{"retry-after": "1"}), llm_calls=3, extra={"retry_after_s": 1.0}
    ),
    "429-until-retries-run-out": Fault(
        loop=_errors(429, RETRIES + 1, **{"retry-after-ms": "50"}),
        status="failed",
        error="HTTP 429",
        llm_calls=RETRIES + 1,
    ),
    "500-then-ok": Fault(loop=_errors(500, 2), llm_calls=4),
    "500-until-retries-run-out": Fault(
        loop=_errors(500, RETRIES + 1), status="failed", error="HTTP 500", llm_calls=RETRIES + 1
    ),
    "hang-past-timeout-then-ok": Fault(loop=(FakeReply.hang(3 * TIMEOUT_S),), llm_calls=3),
    "hang-past-timeout-every-time": Fault(
        loop=tuple(FakeReply.hang(3 * TIMEOUT_S) for _ in range(RETRIES + 1)),
        status="failed",
        error="timed out",
        llm_calls=RETRIES + 1,
    ),
    "synthesis-stream-hangs-before-its-first-token": Fault(
        stream=(FakeReply.stream(["late"], delay_s=3 * TIMEOUT_S),), llm_calls=3
    ),
    "malformed-json-body": Fault(
        loop=(FakeReply.malformed(b'{"id": "chatcmpl-1", "choices": [{"mess'),), iterations=2, llm_calls=3
    ),
    "malformed-json-body-every-time": Fault(
        loop=tuple(FakeReply.malformed(b"<html>bad gateway</html>") for _ in range(3)),
        status="failed",
        error="unusable replies",
        iterations=3,
        llm_calls=3,
    ),
    "empty-choice-list": Fault(loop=(FakeReply.no_choices(),), iterations=2, llm_calls=3),
    "stream-cut-after-a-few-chunks": Fault(
        stream=(FakeReply.stream(["Partial ", "answer ", "that ", "never ", "ends"], cut_after=2),),
        error="synthesis failed",
        llm_calls=2,
        extra={"sent": "Partial answer "},
    ),
    "tool-call-arguments-not-json": Fault(
        loop=(FakeReply.tool_calls([("calculator", '{"expression": "6*7"')]),),
        iterations=2,
        llm_calls=3,
        tool_error="Invalid arguments for tool 'calculator'",
    ),
    "call-to-a-tool-that-does-not-exist": Fault(
        loop=(FakeReply.tool_calls([("no_such_tool", {"x": 1})]),),
        iterations=2,
        llm_calls=3,
        tool_error="Tool 'no_such_tool' not found",
    ),
}


def run_to_done(api: Api, conv: str, message: str) -> tuple[str, list[Any]]:
    """Start a run, follow its stream to ``done``; the run id and the events received."""
    run_id = api.start_run(conv, message)
    with api.stream(conv) as stream:
        assert stream.status_code == 200
        received = stream.read()
    assert received, "the stream carried no events"
    assert received[-1].event == "done", f"the stream ended on {received[-1].event}, not done"
    return run_id, received


def assert_healthy(api: Api, model: FaultyModel) -> None:
    """``/readyz`` is 200 and a new run completes with the model's answer."""
    ready = api.http.get("/readyz")
    assert ready.status_code == 200, ready.text
    conv = api.create_conversation()
    run_id, received = run_to_done(api, conv, "are you still there?")
    assert received[-1].data["status"] == "completed", received[-1].data
    assert received[-1].data["answer"] == model.answer
    assert as_stored(received) == api.wait_stored(run_id)


@pytest.mark.parametrize("name", list(FAULTS))
def test_an_llm_fault_ends_in_recovery_or_a_done_that_says_why(
    name: str,
    start_faulty_service: Callable[..., ServerThread],
    faulty_llm: tuple[FakeOpenAIServer, FaultyModel],
    service_log: ServiceLog,
) -> None:
    fault = FAULTS[name]
    _, model = faulty_llm
    server = start_faulty_service(llm_timeout_s=TIMEOUT_S, llm_max_retries=RETRIES)
    api = Api(server.base_url)
    try:
        model.fail(fault.loop, fault.stream)
        conv = api.create_conversation()
        run_id, received = run_to_done(api, conv, f"question under fault {name}")
        done = received[-1].data

        assert model.pending_faults == 0, "the service stopped before playing every fault"
        assert done["status"] == fault.status, done
        if fault.error is None:
            assert done["error"] is None, done
        else:
            assert fault.error in (done["error"] or ""), done
        assert done["iterations"] == fault.iterations, done
        if fault.llm_calls is not None:
            assert done["usage"]["llm_calls"] == fault.llm_calls, done["usage"]

        # What the client saw is what is stored, and the run record agrees with done.
        assert as_stored(received) == api.wait_stored(run_id)
        run = api.run(run_id)
        assert (run["status"], run["error"], run["answer"]) == (done["status"], done["error"], done["answer"])

        sent = answer_of(as_stored(received))
        if "sent" in fault.extra:
            # E-04: the tokens sent before the cut stay sent, once; done carries the fallback answer.
            assert sent == fault.extra["sent"]
            assert done["answer"] == f"Echo: question under fault {name}"
        elif fault.status == "completed":
            assert sent == done["answer"]
            assert done["answer"] in (model.answer, f"Echo: question under fault {name}")

        if fault.tool_error is not None:
            (step,) = [
                e
                for e in received
                if e.event == "step" and e.data.get("status") == "done" and e.data.get("type") == "iteration"
            ]
            assert fault.tool_error in (step.data["error"] or ""), step.data
        if "retry_after_s" in fault.extra:
            first, second = [at for at, streaming in model.calls if not streaming][:2]
            assert second - first >= fault.extra["retry_after_s"] * 0.95, "Retry-After was not honoured"

        assert service_log.problems() == [], service_log.text
        assert_healthy(api, model)
        assert service_log.problems() == [], service_log.text
    finally:
        api.close()
