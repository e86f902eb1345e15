"""``ChatSession`` against a scripted HTTP transport: streaming, reconnects, 204, Ctrl-C."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from app.cli.chat import EXIT_DETACHED, EXIT_OK, EXIT_RUN_NOT_COMPLETED, ChatSession, Prompt
from app.cli.client import ApiClient, ApiError, CliError, StreamLost
from app.cli.render import HumanRenderer, JsonRenderer
from app.cli.sse import ServerEvent

USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "llm_calls": 2}


def sse(cursor: str, event: str, run_id: str = "r1", **data: Any) -> bytes:
    return f"id: {cursor}\nevent: {event}\ndata: {json.dumps({'run_id': run_id, **data})}\n\n".encode()


def done_event(cursor: str, answer: str, status: str = "completed", run_id: str = "r1") -> bytes:
    return sse(
        cursor,
        "done",
        run_id,
        answer=answer,
        iterations=1,
        usage=USAGE,
        elapsed=0.5,
        status=status,
        error=None,
        pending_injections=[],
    )


RUN = [
    sse(
        "1-0",
        "step",
        type="iteration",
        status="start",
        iteration=1,
        tool_name="calculator",
        tool_args={"expression": "17*23"},
    ),
    sse(
        "1-1",
        "step",
        type="iteration",
        status="done",
        iteration=1,
        tool_name="calculator",
        observation="391",
        error=None,
        iter_elapsed=0.01,
    ),
    b": ping\n\n",
    sse("1-2", "answer", status="start"),
    sse("1-3", "answer", status="delta", content="It is "),
    sse("1-4", "answer", status="delta", content="391."),
    sse("1-5", "answer", status="done"),
    done_event("1-6", "It is 391."),
]


class Broken:
    """Ends a scripted stream response by raising instead of closing cleanly."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class ScriptedBody(httpx.SyncByteStream):
    def __init__(self, chunks: list[bytes | Broken]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            if isinstance(chunk, Broken):
                raise chunk.exc
            yield chunk


@dataclass
class FakeServer:
    """Answers like the service; each stream request takes the next scripted response."""

    streams: list[list[bytes | Broken] | int]
    run: dict[str, Any] = field(default_factory=dict)
    cancel_status: int = 202
    requests: list[httpx.Request] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if request.method == "POST" and path == "/api/conversations":
            return httpx.Response(201, json={"id": "c1", "title": None})
        if request.method == "POST" and path.endswith("/runs"):
            return httpx.Response(202, json={"run_id": "r1", "conversation_id": "c1", "status": "running"})
        if request.method == "POST" and "/approvals/" in path:
            decision = json.loads(request.content)["decision"]
            status = "approved" if decision == "approve" else "denied"
            return httpx.Response(
                200, json={"approval_id": path.rsplit("/", 1)[1], "status": status, "run_id": "r1"}
            )
        if request.method == "POST" and path.endswith("/cancel"):
            if self.cancel_status == 409:
                return httpx.Response(409, json={"error": {"code": "no_active_run", "message": "no run"}})
            return httpx.Response(202, json={})
        if request.method == "GET" and path.startswith("/api/runs/"):
            return httpx.Response(200, json=self.run)
        if request.method == "GET" and path.endswith("/stream"):
            script = self.streams.pop(0)
            if isinstance(script, int):
                return httpx.Response(script)
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, stream=ScriptedBody(script)
            )
        return httpx.Response(404, json={"error": {"code": "not_found", "message": f"no route {path}"}})

    def stream_cursors(self) -> list[str | None]:
        return [r.headers.get("last-event-id") for r in self.requests if r.url.path.endswith("/stream")]

    def paths(self, method: str) -> list[str]:
        return [r.url.path for r in self.requests if r.method == method]


@dataclass
class Session:
    session: ChatSession
    out: io.StringIO
    sleeps: list[float]


def make_session(
    server: FakeServer,
    *,
    interactive: bool = False,
    answers: list[str] | None = None,
    as_json: bool = False,
    key: str | None = None,
) -> Session:
    out = io.StringIO()
    replies = list(answers or [])
    sleeps: list[float] = []
    client = ApiClient("http://agentstream.test", key, transport=httpx.MockTransport(server.handle))
    renderer = JsonRenderer(out, out) if as_json else HumanRenderer(out)
    prompt = Prompt(interactive=interactive, ask=lambda question: out.write(question) and replies.pop(0))
    return Session(ChatSession(client, renderer, prompt, max_retries=3, sleep=sleeps.append), out, sleeps)


def test_chat_creates_a_conversation_starts_a_run_and_prints_the_streamed_run() -> None:
    server = FakeServer(streams=[RUN])
    s = make_session(server)
    assert s.session.chat("What is 17*23?") == EXIT_OK
    assert server.paths("POST") == ["/api/conversations", "/api/conversations/c1/runs"]
    assert json.loads(server.requests[1].content) == {"message": "What is 17*23?"}
    assert s.out.getvalue() == (
        "conversation: c1\n"
        '→ calculator {"expression": "17*23"}\n'
        "  ← 391 (0.01s)\n"
        "It is 391.\n"
        "── completed · 1 iteration · 15 tokens (10 in, 5 out) · 2 LLM calls · 0.50s\n"
        'continue with: agentstream chat "..." --conversation c1\n'
    )


def test_chat_with_a_conversation_id_does_not_create_one() -> None:
    server = FakeServer(streams=[RUN])
    assert make_session(server).session.chat("again", "c7") == EXIT_OK
    assert server.paths("POST") == ["/api/conversations/c7/runs"]


def test_the_key_is_sent_as_a_bearer_token_on_every_request_and_never_printed() -> None:
    server = FakeServer(streams=[RUN])
    s = make_session(server, key="sk-secret-123")
    s.session.chat("hi")
    assert {r.headers["authorization"] for r in server.requests} == {"Bearer sk-secret-123"}
    assert "sk-secret-123" not in s.out.getvalue()


def test_dropped_connection_reconnects_after_the_last_event_id_without_repeating_events() -> None:
    server = FakeServer(streams=[[*RUN[:4], Broken(httpx.ReadError("connection reset"))], RUN[4:]])
    s = make_session(server)
    assert s.session.chat("q") == EXIT_OK
    assert server.stream_cursors() == [None, "1-2"]
    output = s.out.getvalue()
    assert "reconnecting" not in output
    assert output.count("→ calculator") == 1
    assert "It is 391.\n── completed" in output
    assert s.sleeps == [0.5]


def test_stream_closed_before_done_is_resumed_too() -> None:
    server = FakeServer(streams=[RUN[:5], RUN[5:]])
    s = make_session(server)
    assert s.session.chat("q") == EXIT_OK
    assert server.stream_cursors() == [None, "1-3"]
    assert "It is 391.\n── completed" in s.out.getvalue()


def test_reconnects_back_off_and_give_up_after_the_retry_budget() -> None:
    refused = [Broken(httpx.ConnectError("[Errno 111] Connection refused"))]
    server = FakeServer(streams=[RUN[:2], refused, refused, refused, refused])
    s = make_session(server)
    with pytest.raises(StreamLost, match=r"connection refused\) and 3 reconnects failed"):
        s.session.chat("q")
    output = s.out.getvalue()
    assert "attempt 1/3" not in output
    assert "· connection refused; reconnecting (attempt 2/3)\n" in output
    assert "· connection refused; reconnecting (attempt 3/3)\n" in output
    assert s.sleeps == [0.5, 1.0, 2.0]
    assert server.stream_cursors() == [None, "1-1", "1-1", "1-1"]


def test_the_retry_budget_resets_once_events_flow_again() -> None:
    drop = Broken(httpx.ReadError("reset"))
    server = FakeServer(streams=[[RUN[0], drop], [drop], [RUN[1], drop], [drop], RUN[2:]])
    s = make_session(server)
    assert s.session.chat("q") == EXIT_OK
    assert s.sleeps == [0.5, 1.0, 0.5, 1.0]


def test_gateway_errors_on_reconnect_are_retried_but_not_found_is_not() -> None:
    server = FakeServer(streams=[RUN[:2], 503, RUN[2:]])
    assert make_session(server).session.chat("q") == EXIT_OK

    server = FakeServer(streams=[RUN[:2], 404])
    with pytest.raises(ApiError) as caught:
        make_session(server).session.chat("q")
    assert caught.value.status == 404


def test_204_before_done_finishes_with_the_stored_run_record() -> None:
    server = FakeServer(
        streams=[RUN[:2], 204],
        run={
            "run_id": "r1",
            "status": "failed",
            "answer": "",
            "iterations": 1,
            "usage": USAGE,
            "elapsed": 2.0,
            "error": "worker lost",
        },
    )
    s = make_session(server)
    assert s.session.chat("q") == EXIT_RUN_NOT_COMPLETED
    assert server.paths("GET")[-1] == "/api/runs/r1"
    assert "── failed · 1 iteration" in s.out.getvalue()
    assert "   error: worker lost\n" in s.out.getvalue()


def test_events_of_another_run_are_skipped_and_its_done_does_not_end_the_chat() -> None:
    older = [
        sse("0-5", "answer", run_id="r0", status="delta", content="OLD"),
        done_event("0-6", "OLD", run_id="r0"),
    ]
    server = FakeServer(streams=[older, RUN])
    s = make_session(server)
    assert s.session.chat("q") == EXIT_OK
    assert "OLD" not in s.out.getvalue()
    assert server.stream_cursors() == [None, "0-6"]


def test_failed_or_cancelled_run_exits_with_1() -> None:
    server = FakeServer(streams=[[done_event("1-0", "", status="cancelled")]])
    assert make_session(server).session.chat("q") == EXIT_RUN_NOT_COMPLETED


def test_ctrl_c_without_a_terminal_detaches_and_says_how_to_resume() -> None:
    server = FakeServer(streams=[[*RUN[:3], Broken(KeyboardInterrupt())]])
    s = make_session(server, interactive=False)
    assert s.session.chat("q") == EXIT_DETACHED
    assert server.paths("POST")[-1].endswith("/runs")  # no cancel
    output = s.out.getvalue()
    assert "Cancel the run?" not in output
    assert "detached; the run keeps going on the server." in output
    assert "agentstream watch c1 --after 1-1" in output
    assert 'agentstream chat "..." --conversation c1' in output


def test_ctrl_c_on_a_terminal_answered_yes_cancels_and_keeps_streaming_to_done() -> None:
    server = FakeServer(
        streams=[[*RUN[:4], Broken(KeyboardInterrupt())], [done_event("1-3", "It is", status="cancelled")]]
    )
    s = make_session(server, interactive=True, answers=["y"])
    assert s.session.chat("q") == EXIT_RUN_NOT_COMPLETED
    assert server.paths("POST")[-1] == "/api/conversations/c1/cancel"
    assert server.stream_cursors() == [None, "1-2"]
    output = s.out.getvalue()
    assert "Cancel the run? [y/N] cancel requested; waiting for the run to stop…\n" in output
    assert "── cancelled" in output


def test_ctrl_c_on_a_terminal_answered_no_detaches_without_cancelling() -> None:
    server = FakeServer(streams=[[*RUN[:4], Broken(KeyboardInterrupt())]])
    s = make_session(server, interactive=True, answers=[""])
    assert s.session.chat("q") == EXIT_DETACHED
    assert not server.paths("POST")[-1].endswith("/cancel")
    assert "detached;" in s.out.getvalue()


def test_ctrl_c_in_the_middle_of_the_answer_breaks_the_line_before_asking() -> None:
    server = FakeServer(streams=[[*RUN[:5], Broken(KeyboardInterrupt())]])
    s = make_session(server, interactive=True, answers=["n"])
    s.session.chat("q")
    assert "It is \nCancel the run? [y/N] " in s.out.getvalue()


def test_cancel_that_finds_the_run_already_finished_still_streams_the_done() -> None:
    server = FakeServer(streams=[[*RUN[:6], Broken(KeyboardInterrupt())], RUN[6:]], cancel_status=409)
    s = make_session(server, interactive=True, answers=["yes"])
    assert s.session.chat("q") == EXIT_OK
    assert "the run had already finished\n" in s.out.getvalue()


def test_second_ctrl_c_after_asking_to_cancel_detaches() -> None:
    server = FakeServer(
        streams=[[RUN[0], Broken(KeyboardInterrupt())], [RUN[1], Broken(KeyboardInterrupt())]]
    )
    s = make_session(server, interactive=True, answers=["y"])
    assert s.session.chat("q") == EXIT_DETACHED
    assert s.out.getvalue().count("Cancel the run?") == 1


class InterruptedOnce(HumanRenderer):
    """Raises KeyboardInterrupt the first time it is handed the event with id ``at``."""

    def __init__(self, out: io.StringIO, at: str) -> None:
        super().__init__(out)
        self.at: str | None = at

    def handle(self, event: ServerEvent) -> None:
        if event.id == self.at:
            self.at = None
            raise KeyboardInterrupt
        super().handle(event)


def test_an_event_interrupted_while_being_shown_is_replayed_after_the_cancel() -> None:
    server = FakeServer(streams=[RUN, RUN[1:]])
    out = io.StringIO()
    client = ApiClient("http://agentstream.test", transport=httpx.MockTransport(server.handle))
    prompt = Prompt(interactive=True, ask=lambda question: "y")
    session = ChatSession(client, InterruptedOnce(out, at="1-1"), prompt, sleep=lambda s: None)
    assert session.chat("q") == EXIT_OK
    assert server.stream_cursors() == [None, "1-0"]
    assert "  ← 391 (0.01s)\n" in out.getvalue()


def test_prompt_treats_end_of_input_as_no() -> None:
    def no_input(question: str) -> str:
        raise EOFError

    assert Prompt(interactive=True, ask=no_input).confirm("?") is False


def test_run_already_active_explains_how_to_follow_or_cancel_it() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            409, json={"error": {"code": "run_active", "message": "a run is already active"}}
        )

    client = ApiClient("http://agentstream.test", transport=httpx.MockTransport(handler))
    session = ChatSession(client, HumanRenderer(io.StringIO()), Prompt(interactive=False))
    with pytest.raises(CliError, match=r"a run is already active; follow it with `agentstream watch c1`"):
        session.chat("q", "c1")


def test_watch_without_a_run_filter_stops_at_the_first_done() -> None:
    server = FakeServer(streams=[RUN])
    s = make_session(server)
    assert s.session.follow("c1", after="0-9") == EXIT_OK
    assert server.stream_cursors() == ["0-9"]
    assert "It is 391.\n── completed" in s.out.getvalue()


def test_watch_of_a_finished_conversation_says_there_is_nothing_to_follow() -> None:
    server = FakeServer(streams=[204])
    s = make_session(server)
    assert s.session.follow("c1") == EXIT_OK
    assert s.out.getvalue().startswith("no run to follow in this conversation\n")


def test_json_mode_prints_every_event_as_a_json_line() -> None:
    server = FakeServer(streams=[RUN])
    s = make_session(server, as_json=True)
    assert s.session.chat("q") == EXIT_OK
    events = [json.loads(line) for line in s.out.getvalue().splitlines() if line.startswith("{")]
    assert [e["id"] for e in events] == ["1-0", "1-1", "1-2", "1-3", "1-4", "1-5", "1-6"]
    assert events[-1]["event"] == "done"
    assert events[-1]["data"]["answer"] == "It is 391."


APPROVAL_RUN = [
    sse(
        "1-0",
        "approval",
        status="requested",
        approval_id="apr_1",
        call_id="call_1_0",
        tool_name="calculator",
        tool_args={"expression": "17*23"},
        iteration=1,
        expires_at="2026-12-04T00:00:00+00:00",
    ),
    sse(
        "1-1", "approval", status="approved", approval_id="apr_1", reason=None, tool_args={"expression": "1"}
    ),
    done_event("1-2", "It is 1."),
]


@pytest.mark.parametrize(
    ("answers", "body"),
    [
        (["y"], {"decision": "approve"}),
        (["maybe", "no", "not now"], {"decision": "deny", "reason": "not now"}),
        (["n", ""], {"decision": "deny"}),
        (["e", "[1]", "e", '{"expression": "1"}'], {"decision": "approve", "tool_args": {"expression": "1"}}),
    ],
    ids=["approve", "deny-with-reason", "deny", "edit"],
)
def test_chat_asks_at_the_prompt_when_a_call_waits_for_approval(
    answers: list[str], body: dict[str, Any]
) -> None:
    server = FakeServer(streams=[list(APPROVAL_RUN)])
    s = make_session(server, interactive=True, answers=answers)

    code = s.session.chat("what is 17*23?")

    assert code == EXIT_OK
    (decision,) = [r for r in server.requests if "/approvals/" in r.url.path]
    assert decision.url.path == "/api/conversations/c1/approvals/apr_1"
    assert json.loads(decision.content) == body
    out = s.out.getvalue()
    assert "waiting for approval: calculator" in out and "approve? [y]es" in out


def test_chat_without_a_terminal_says_how_to_answer_and_keeps_following() -> None:
    server = FakeServer(streams=[list(APPROVAL_RUN)])
    s = make_session(server, interactive=False)

    assert s.session.chat("what is 17*23?") == EXIT_OK

    assert not [r for r in server.requests if "/approvals/" in r.url.path]
    out = s.out.getvalue()
    assert "agentstream approve apr_1" in out and "✓ approved" in out
