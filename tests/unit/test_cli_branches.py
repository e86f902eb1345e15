"""``agentstream edit`` / ``regenerate`` / ``fork`` / ``switch`` and ``conversations ID`` through
``main()`` against a scripted service: which message a command means, what it sends, its output
and its errors."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.cli import commands, main
from app.cli.branches import edit_words, regenerate_target
from app.cli.client import ApiClient, CliError

Handler = Callable[[httpx.Request], httpx.Response]


def message(mid: str, role: str, content: str | None, parent: str | None, **extra: Any) -> dict[str, Any]:
    return {
        "id": mid,
        "parent_id": parent,
        "sibling_ids": extra.pop("sibling_ids", [mid]),
        "role": role,
        "content": content,
        "tool_calls": extra.pop("tool_calls", None),
        "run_id": extra.pop("run_id", "r1"),
        "created_at": "2025-01-01T00:00:00Z",
        **extra,
    }


CALL = {
    "id": "c0",
    "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "17*23"}'},
}
# The current branch: a question with a tool step and its answer, then a second question that was
# edited once (msg_5 is the old text, msg_9 the new one) and its answer.
BRANCH = [
    message("msg_1", "user", "What is 17*23?", None),
    message("msg_2", "assistant", "", "msg_1", tool_calls=[CALL]),
    message("msg_3", "tool", "391", "msg_2", tool_call_id="c0"),
    message("msg_4", "assistant", "17*23 = 391", "msg_3"),
    message("msg_9", "user", "And 2+2?", "msg_4", sibling_ids=["msg_5", "msg_9"]),
    message("msg_10", "assistant", "2+2 = 4", "msg_9", run_id="r2"),
]


def detail(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": "c1",
        "title": "Math",
        "agent": {},
        "created_at": "2025-01-01T00:00:00Z",
        "updated_at": "2025-01-01T00:00:01Z",
        "messages": messages,
        "active_run_id": None,
        "pending_approvals": [],
        "pending_tool_calls": [],
        **extra,
    }


def sse(cursor: str, event: str, **data: Any) -> str:
    return f"id: {cursor}\nevent: {event}\ndata: {json.dumps({'run_id': 'r3', **data})}\n\n"


NEW_RUN = (
    sse("9-0", "answer", status="start")
    + sse("9-1", "answer", status="delta", content="It is 4.")
    + sse("9-2", "answer", status="done")
    + sse("9-3", "done", answer="It is 4.", iterations=1, status="completed", error=None, elapsed=0.1)
)


def service(
    messages: list[dict[str, Any]] = BRANCH, *, runs: httpx.Response | None = None, **answers: httpx.Response
) -> Handler:
    """Answers like the service: the conversation ``c1`` with ``messages`` as its current branch,
    a run start (``runs``) whose stream is ``NEW_RUN``, and ``answers`` keyed by ``fork`` / ``head``."""

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path == "/api/conversations/c1":
            return httpx.Response(200, json=detail(messages))
        if request.method == "GET" and path.count("/") == 3:
            return httpx.Response(
                404, json={"error": {"code": "not_found", "message": "conversation not found"}}
            )
        if request.method == "POST" and path == "/api/conversations/c1/runs":
            return runs or httpx.Response(
                202, json={"run_id": "r3", "conversation_id": "c1", "status": "running", "stream_url": "/s"}
            )
        if request.method == "GET" and path == "/api/conversations/c1/stream":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, text=NEW_RUN)
        name = path.rsplit("/", 1)[1]
        if name in answers:
            return answers[name]
        return httpx.Response(404, json={"error": {"code": "not_found", "message": f"no route {path}"}})

    return handle


def refused(status: int, code: str, text: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": text}})


UNKNOWN_MESSAGE = refused(404, "not_found", "message not found in this conversation")
RUN_ACTIVE = refused(409, "run_active", "a run is already active in this conversation")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("AGENTSTREAM_URL", "AGENTSTREAM_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Callable[[Handler], list[httpx.Request]]:
    """Route the CLI's HTTP calls to ``handler``; returns the list of requests it received."""

    def install(handler: Handler) -> list[httpx.Request]:
        seen: list[httpx.Request] = []

        def recording(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return handler(request)

        monkeypatch.setattr(
            commands, "ApiClient", functools.partial(ApiClient, transport=httpx.MockTransport(recording))
        )
        return seen

    return install


def posted(seen: list[httpx.Request], suffix: str) -> list[Any]:
    return [
        json.loads(r.content) for r in seen if r.method in {"POST", "PUT"} and r.url.path.endswith(suffix)
    ]


def test_edit_words_take_a_leading_message_id_only_when_text_follows() -> None:
    assert edit_words(["msg_4", "What", "is", "2+3?"]) == ("msg_4", "What is 2+3?")
    assert edit_words(["What is 2+3?"]) == (None, "What is 2+3?")
    assert edit_words(["msg_4"]) == (None, "msg_4")
    assert edit_words(["msg_4 is", "odd"]) == (None, "msg_4 is odd")
    with pytest.raises(CliError, match="empty"):
        edit_words(["msg_4", " "])


def test_edit_without_a_message_id_asks_beside_the_last_question_and_follows_the_run(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = served(service())
    assert main(["edit", "c1", "And", "3+3?"]) == 0
    assert posted(seen, "/runs") == [{"message": "And 3+3?", "parent_id": "msg_4"}]
    out = capsys.readouterr().out
    assert out.startswith("conversation: c1\nediting msg_9\n")
    assert "It is 4.\n── completed · 1 iteration" in out


def test_edit_of_the_first_question_asks_as_a_first_message(served: Any) -> None:
    seen = served(service())
    assert main(["edit", "c1", "msg_1", "What is 17*24?"]) == 0
    assert posted(seen, "/runs") == [{"message": "What is 17*24?", "parent_id": None}]


def test_edit_of_a_question_beside_the_branch_asks_below_their_common_parent(served: Any) -> None:
    seen = served(service())
    assert main(["edit", "c1", "msg_5", "And 5+5?"]) == 0
    assert posted(seen, "/runs") == [{"message": "And 5+5?", "parent_id": "msg_4"}]


def test_edit_refuses_an_answer_and_an_unknown_message_before_asking_anything(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = served(service())
    assert main(["edit", "c1", "msg_4", "other", "words"]) == 1
    assert "msg_4 is an assistant message: edit changes a question; `agentstream regenerate c1 msg_4`" in (
        capsys.readouterr().err
    )
    assert main(["edit", "c1", "msg_77", "other", "words"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no message msg_77 on the current branch of conversation c1")
    assert "`agentstream conversations c1`" in err
    assert posted(seen, "/runs") == []


def test_edit_in_a_conversation_without_questions_says_so(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    served(service([]))
    assert main(["edit", "c1", "hello"]) == 1
    assert capsys.readouterr().err == "error: conversation c1 has no question to edit\n"


def test_edit_of_an_unknown_conversation_reports_the_servers_404(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    served(service())
    assert main(["edit", "c404", "hello"]) == 1
    assert capsys.readouterr().err == "error: conversation not found (not_found, HTTP 404)\n"


def test_regenerate_without_a_message_id_replaces_the_last_answer(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = served(service())
    assert main(["regenerate", "c1", "--json"]) == 0
    assert posted(seen, "/runs") == [{"regenerate": "msg_10"}]
    captured = capsys.readouterr()
    events = [json.loads(line) for line in captured.out.splitlines()]
    assert [e["event"] for e in events][-1] == "done"
    assert captured.err.startswith("conversation: c1\nregenerating msg_10\n")


def test_regenerate_target_is_the_last_answer_or_a_question_left_without_one() -> None:
    assert regenerate_target(BRANCH, "c1") == "msg_10"
    # The last run failed before answering: its question, not an older answer, is answered again.
    assert regenerate_target(BRANCH[:5], "c1") == "msg_9"
    assert regenerate_target(BRANCH[:3], "c1") == "msg_1"  # an answer that only called tools is none
    with pytest.raises(CliError, match="no answer to regenerate in conversation c1"):
        regenerate_target([], "c1")


def test_regenerate_sends_the_message_named(served: Any) -> None:
    seen = served(service())
    assert main(["regenerate", "c1", "msg_1"]) == 0
    assert posted(seen, "/runs") == [{"regenerate": "msg_1"}]


def test_regenerate_of_an_unknown_message_says_where_to_find_the_ids(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    served(service(runs=UNKNOWN_MESSAGE))
    assert main(["regenerate", "c1", "msg_77"]) == 1
    assert capsys.readouterr().err.endswith(
        "error: no message msg_77 in conversation c1; see its messages with `agentstream conversations c1`\n"
    )


def test_regenerate_while_a_run_is_active_says_how_to_follow_or_stop_it(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    served(service(runs=RUN_ACTIVE))
    assert main(["regenerate", "c1"]) == 1
    assert capsys.readouterr().err == (
        "error: a run is already active in this conversation; follow it with `agentstream watch c1` "
        "or stop it with `agentstream cancel c1`\n"
    )


def test_message_ids_are_checked_before_any_request(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    seen = served(service())
    for argv in (["regenerate", "c1", "4"], ["fork", "c1", "last"], ["switch", "c1", "msg_x"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        assert "is not a message id: they look like msg_12" in capsys.readouterr().err
    assert seen == []


FORKED = {"id": "c2", "title": "Math (fork)", "agent": {}, "created_at": "x", "updated_at": "x"}


def test_fork_without_a_message_id_forks_at_the_leaf_and_prints_the_new_id(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = served(service(fork=httpx.Response(201, json=FORKED)))
    assert main(["fork", "c1"]) == 0
    assert posted(seen, "/fork") == [{"message_id": "msg_10"}]
    assert capsys.readouterr().out == (
        'c2  Math (fork)\ncontinue with: agentstream chat "..." --conversation c2\n'
    )


def test_fork_at_a_message_with_a_title_as_json(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    seen = served(service(fork=httpx.Response(201, json={**FORKED, "title": "Only 17*23"})))
    assert main(["fork", "c1", "msg_4", "--title", "Only 17*23", "--json"]) == 0
    assert posted(seen, "/fork") == [{"message_id": "msg_4", "title": "Only 17*23"}]
    assert json.loads(capsys.readouterr().out)["id"] == "c2"


def test_fork_errors(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    served(service(fork=UNKNOWN_MESSAGE))
    assert main(["fork", "c1", "msg_77"]) == 1
    assert capsys.readouterr().err.startswith("error: no message msg_77 in conversation c1;")
    served(service(fork=refused(409, "run_active", "a run is active in this conversation")))
    assert main(["fork", "c1"]) == 1
    assert "follow it with `agentstream watch c1`" in capsys.readouterr().err
    served(service([]))
    assert main(["fork", "c1"]) == 1
    assert capsys.readouterr().err == "error: conversation c1 has no messages to fork\n"


def test_switch_puts_the_head_and_shows_the_branch_then(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    old_branch = [*BRANCH[:4], message("msg_5", "user", "And 3+3?", "msg_4", sibling_ids=["msg_5", "msg_9"])]
    seen = served(service(head=httpx.Response(200, json=detail(old_branch))))
    assert main(["switch", "c1", "msg_5"]) == 0
    assert posted(seen, "/head") == [{"message_id": "msg_5"}]
    assert capsys.readouterr().out.splitlines()[-1] == "msg_5  user       1/2 (also msg_9)  And 3+3?"
    served(service(head=UNKNOWN_MESSAGE))
    assert main(["switch", "c1", "msg_77"]) == 1
    assert capsys.readouterr().err.startswith("error: no message msg_77 in conversation c1;")


def test_conversations_with_an_id_shows_the_branch_with_ids_and_siblings(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = served(service())
    assert main(["conversations", "c1"]) == 0
    assert seen[0].url.path == "/api/conversations/c1"
    assert capsys.readouterr().out == (
        "c1  Math\n"
        "msg_1   user       What is 17*23?\n"
        'msg_2   assistant  → calculator {"expression": "17*23"}\n'
        "msg_3   tool       391\n"
        "msg_4   assistant  17*23 = 391\n"
        "msg_9   user       2/2 (also msg_5)  And 2+2?\n"
        "msg_10  assistant  2+2 = 4\n"
    )


def test_conversations_with_an_id_as_json_and_without_paging(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    served(service())
    assert main(["conversations", "c1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == detail(BRANCH)
    assert main(["conversations", "c1", "--limit", "2"]) == 1
    assert "--limit and --cursor page the list of conversations" in capsys.readouterr().err
