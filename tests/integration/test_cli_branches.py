"""``agentstream edit`` / ``regenerate`` / ``fork`` / ``switch`` (FACES.md B-09) end to end: the CLI as
a subprocess against a real uvicorn process running the demo model, whose calculator calls wait for
approval, so that a run stays active for as long as a test needs it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.test_cli import KEY, Server, api, cli, conversation_of, serve
from tests.support.server import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serve(tmp_path_factory.mktemp("cli-branches"), REQUIRE_APPROVAL="calculator")


def ask(server: Server, question: str, conversation: str | None = None) -> str:
    """A finished ``agentstream chat``; the conversation's id."""
    more = ["--conversation", conversation] if conversation else []
    result = cli(server, "chat", question, *more)
    assert result.returncode == 0, result.stdout + result.stderr
    return conversation_of(result.stdout)


def branch(server: Server, conversation: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = api(server, f"/api/conversations/{conversation}")["messages"]
    return messages


def listed(output: str, message_id: str) -> str:
    """What ``agentstream conversations ID`` (or ``switch``) shows of a message after its id."""
    line = next(line for line in output.splitlines() if line.split(" ", 1)[0] == message_id)
    return " ".join(line.split()[1:])


def questions(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


def test_edit_asks_the_changed_question_beside_the_old_one_and_streams_its_answer(server: Server) -> None:
    conversation = ask(server, "Convert 5 km to miles")
    old = branch(server, conversation)

    edited = cli(server, "edit", conversation, "Convert", "10", "km", "to", "miles")

    assert edited.returncode == 0, edited.stderr
    assert f"editing {old[0]['id']}\n" in edited.stdout
    assert "  ← 10 km = 6.21371 miles" in edited.stdout
    assert "── completed · " in edited.stdout
    new = branch(server, conversation)
    assert questions(new) == ["Convert 10 km to miles"]
    assert new[0]["sibling_ids"] == [old[0]["id"], new[0]["id"]]
    assert new[-1]["role"] == "assistant" and "6.21371" in new[-1]["content"]
    assert new[-1]["content"].strip() in edited.stdout  # the answer was streamed
    shown = cli(server, "conversations", conversation)
    assert listed(shown.stdout, new[0]["id"]) == f"user 2/2 (also {old[0]['id']}) Convert 10 km to miles"


def test_edit_of_an_earlier_question_by_id_leaves_the_later_ones_on_the_old_branch(server: Server) -> None:
    conversation = ask(server, "Convert 5 km to miles")
    ask(server, "Count the words in 'to be or not to be'", conversation)
    first = branch(server, conversation)[0]

    edited = cli(server, "edit", conversation, first["id"], "Count the words in 'a b c'")

    assert edited.returncode == 0, edited.stderr
    new = branch(server, conversation)
    assert questions(new) == ["Count the words in 'a b c'"]
    assert new[0]["parent_id"] is None and "words: 3" in new[-1]["content"]
    switched = cli(server, "switch", conversation, first["id"])
    assert switched.returncode == 0, switched.stderr
    assert listed(switched.stdout, first["id"]) == f"user 1/2 (also {new[0]['id']}) Convert 5 km to miles"
    assert questions(branch(server, conversation)) == [
        "Convert 5 km to miles",
        "Count the words in 'to be or not to be'",
    ]


def test_regenerate_adds_a_second_answer_to_the_same_question(server: Server) -> None:
    conversation = ask(server, "Count the words in 'to be or not to be'")
    old = branch(server, conversation)

    regenerated = cli(server, "regenerate", conversation)

    assert regenerated.returncode == 0, regenerated.stderr
    assert f"regenerating {old[-1]['id']}\n" in regenerated.stdout
    assert "── completed · " in regenerated.stdout
    new = branch(server, conversation)
    assert new[0]["id"] == old[0]["id"] and new[0]["sibling_ids"] == [old[0]["id"]]  # asked once
    # The answer starts with the tool step below the question: that is the sibling of the old one.
    assert new[1]["sibling_ids"] == [old[1]["id"], new[1]["id"]]
    assert new[-1]["id"] != old[-1]["id"] and new[-1]["content"] == old[-1]["content"]
    shown = cli(server, "conversations", conversation)
    assert listed(shown.stdout, new[1]["id"]).startswith(f"assistant 2/2 (also {old[1]['id']}) ")


def test_fork_prints_a_new_conversation_whose_messages_are_the_path(server: Server) -> None:
    conversation = ask(server, "Convert 5 km to miles")
    ask(server, "Count the words in 'to be or not to be'", conversation)
    original = branch(server, conversation)
    first_answer = next(i for i, m in enumerate(original) if m["role"] == "assistant" and not m["tool_calls"])

    forked = cli(server, "fork", conversation, original[first_answer]["id"], "--title", "Only km")

    assert forked.returncode == 0, forked.stderr
    new_id, title = forked.stdout.splitlines()[0].split("  ")
    assert title == "Only km" and new_id != conversation
    copied = branch(server, new_id)
    path = original[: first_answer + 1]
    assert [(m["role"], m["content"]) for m in copied] == [(m["role"], m["content"]) for m in path]
    assert branch(server, conversation) == original

    at_leaf = cli(server, "fork", conversation, "--json")
    assert at_leaf.returncode == 0, at_leaf.stderr
    whole = branch(server, json.loads(at_leaf.stdout)["id"])
    assert [m["content"] for m in whole] == [m["content"] for m in original]


def test_an_unknown_message_id_is_a_clear_error(server: Server) -> None:
    conversation = ask(server, "Convert 5 km to miles")
    before = branch(server, conversation)
    unknown = "msg_999999"
    said = f"error: no message {unknown} in conversation {conversation}; see its messages with "
    for command in ("regenerate", "fork", "switch"):
        result = cli(server, command, conversation, unknown)
        assert result.returncode == 1, (command, result.stdout)
        assert said in result.stderr, (command, result.stderr)
        assert "Traceback" not in result.stderr
    edited = cli(server, "edit", conversation, unknown, "Convert 1 km to miles")
    assert edited.returncode == 1
    assert (
        f"error: no message {unknown} on the current branch of conversation {conversation}" in edited.stderr
    )
    assert branch(server, conversation) == before


def test_edit_regenerate_fork_and_switch_refuse_while_a_run_is_active(server: Server) -> None:
    conversation = ask(server, "Convert 5 km to miles")
    first = branch(server, conversation)[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    started = httpx.post(
        f"{server.base_url}/api/conversations/{conversation}/runs",
        json={"message": "What is 17*23?"},
        headers=headers,
        timeout=10,
    )
    assert started.status_code == 202, started.text
    try:
        # The calculator call waits for approval: the run stays active until it is cancelled.
        wait_until(
            lambda: api(server, f"/api/conversations/{conversation}")["pending_approvals"],
            timeout=30,
            what="the run to wait for approval",
        )
        hint = (
            f"follow it with `agentstream watch {conversation}` "
            f"or stop it with `agentstream cancel {conversation}`"
        )
        for args in (
            ["edit", conversation, first["id"], "Convert 6 km to miles"],
            ["edit", conversation, "What is 17*24?"],
            ["regenerate", conversation],
            ["fork", conversation],
            ["switch", conversation, first["id"]],
        ):
            result = cli(server, *args)
            assert result.returncode == 1, (args, result.stdout)
            assert result.stderr.startswith("error: a run is") and hint in result.stderr, (
                args,
                result.stderr,
            )
        assert questions(branch(server, conversation)) == ["Convert 5 km to miles", "What is 17*23?"]
    finally:
        httpx.post(f"{server.base_url}/api/conversations/{conversation}/cancel", headers=headers, timeout=10)
        run_id = started.json()["run_id"]
        wait_until(
            lambda: api(server, f"/api/runs/{run_id}")["status"] == "cancelled",
            timeout=30,
            what="the run to end",
        )
