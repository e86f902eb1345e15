"""``agentstream edit``, ``regenerate``, ``fork`` and ``switch`` (FACES.md B-09), and one
conversation's current branch as lines (``agentstream conversations CONVERSATION_ID``).

A command that names no message means one of the current branch (``GET /api/conversations/{id}``,
the path from the first message to the current leaf): ``edit`` the last question, ``regenerate``
the last answer (or the last question, when no answer follows it: its run failed or was
cancelled), ``fork`` the leaf. The server decides everything else; this module only picks the
message, turns its errors into what to do next, and shows ids and "n/m" so that people can name
the message they mean.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from app.cli.chat import ChatSession, run_active_error
from app.cli.client import ApiClient, ApiError, CliError

MESSAGE_ID = re.compile(r"msg_[0-9]{1,20}")
PREVIEW_CHARS = 100

Message = dict[str, Any]


def is_message_id(text: str) -> bool:
    return MESSAGE_ID.fullmatch(text) is not None


def edit_words(words: Sequence[str]) -> tuple[str | None, str]:
    """``[MESSAGE_ID] TEXT...`` as (the message id or None, the text): a first word that is a
    message id names the message when more words follow; the words are joined with spaces."""
    message_id = None
    if len(words) > 1 and is_message_id(words[0]):
        message_id, words = words[0], words[1:]
    text = " ".join(words)
    if not text.strip():
        raise CliError("the new text of the question is empty")
    return message_id, text


def edit(
    client: ApiClient, session: ChatSession, conversation_id: str, message_id: str | None, text: str
) -> int:
    """Ask ``text`` in place of a question (beside it, below its parent) and follow the new run."""
    branch = current_branch(client, conversation_id)
    if message_id is None:
        message_id = _last(
            branch,
            lambda m: m.get("role") == "user",
            f"conversation {conversation_id} has no question to edit",
        )
    parent_id = edit_parent(branch, message_id, conversation_id)
    return session.start(
        conversation_id, lambda: client.edit(conversation_id, text, parent_id), note=f"editing {message_id}"
    )


def regenerate(client: ApiClient, session: ChatSession, conversation_id: str, message_id: str | None) -> int:
    """Answer a question again (a new sibling of its answer) and follow the new run."""
    # Read even when the message is named: a 404 afterwards is then about the message.
    branch = current_branch(client, conversation_id)
    chosen = message_id or regenerate_target(branch, conversation_id)

    def start_run() -> dict[str, Any]:
        try:
            return client.regenerate(conversation_id, chosen)
        except ApiError as exc:
            raise _refused(exc, conversation_id, chosen) from None

    return session.start(conversation_id, start_run, note=f"regenerating {chosen}")


def fork(client: ApiClient, conversation_id: str, message_id: str | None, title: str | None) -> Message:
    """The new conversation whose messages are the path to the message (default: the leaf)."""
    branch = current_branch(client, conversation_id)
    if message_id is None:
        message_id = _last(branch, lambda m: True, f"conversation {conversation_id} has no messages to fork")
    try:
        return client.fork(conversation_id, message_id, title)
    except ApiError as exc:
        raise _refused(exc, conversation_id, message_id) from None


def switch(client: ApiClient, conversation_id: str, message_id: str) -> Message:
    """Make the newest leaf below the message the current one; the conversation afterwards."""
    current_branch(client, conversation_id)
    try:
        return client.switch(conversation_id, message_id)
    except ApiError as exc:
        raise _refused(exc, conversation_id, message_id) from None


def current_branch(client: ApiClient, conversation_id: str) -> list[Message]:
    messages = client.get_conversation(conversation_id).get("messages")
    return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []


def edit_parent(branch: Sequence[Message], message_id: str, conversation_id: str) -> str | None:
    """The parent of the question ``message_id``, which is on the current branch or beside one of
    its messages (siblings share their parent and role)."""
    found = next((m for m in branch if message_id == m.get("id") or message_id in _siblings(m)), None)
    if found is None:
        raise CliError(
            f"no message {message_id} on the current branch of conversation {conversation_id} or beside "
            f"one of its messages; see the ids with `agentstream conversations {conversation_id}`, "
            f"and `agentstream switch {conversation_id} MESSAGE_ID` to reach another branch"
        )
    if found.get("role") != "user":
        raise CliError(
            f"{message_id} is {_article(found.get('role'))} message: edit changes a question; "
            f"`agentstream regenerate {conversation_id} {message_id}` answers again"
        )
    parent = found.get("parent_id")
    return parent if isinstance(parent, str) else None


def regenerate_target(branch: Sequence[Message], conversation_id: str) -> str:
    """The last answer of the branch, or its last question when no answer follows that."""

    def answer_or_question(m: Message) -> bool:
        return m.get("role") == "user" or (m.get("role") == "assistant" and not m.get("tool_calls"))

    return _last(branch, answer_or_question, f"no answer to regenerate in conversation {conversation_id}")


def format_conversation(detail: Message) -> str:
    """A conversation's header line and its current branch, one message a line: id, role, "n/m"
    among its siblings (and their ids), and the start of its text."""
    active = f"  [running {detail['active_run_id']}]" if detail.get("active_run_id") else ""
    lines = [f"{detail.get('id', '?')}  {detail.get('title') or '(untitled)'}{active}"]
    branch = [m for m in detail.get("messages") or () if isinstance(m, dict)]
    if not branch:
        return "\n".join([*lines, "no messages yet"])
    width = max(len(str(m.get("id", "?"))) for m in branch)
    for m in branch:
        siblings = _siblings(m)
        place = ""
        if len(siblings) > 1 and m.get("id") in siblings:
            others = " ".join(s for s in siblings if s != m.get("id"))
            place = f"{siblings.index(m['id']) + 1}/{len(siblings)} (also {others})  "
        lines.append(f"{m.get('id', '?')!s:<{width}}  {m.get('role', '?')!s:<9}  {place}{_preview(m)}")
    return "\n".join(lines)


def _preview(message: Message) -> str:
    calls = [_call(c) for c in message.get("tool_calls") or () if isinstance(c, dict)]
    text = " ".join([*str(message.get("content") or "").split(), *calls])
    if len(text) > PREVIEW_CHARS:
        return text[: PREVIEW_CHARS - 1] + "…"
    return text


def _call(call: dict[str, Any]) -> str:
    function = call.get("function")
    if not isinstance(function, dict):
        function = {}
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f"→ {function.get('name', '?')} {arguments}"


def _siblings(message: Message) -> list[str]:
    ids = message.get("sibling_ids")
    return [str(i) for i in ids] if isinstance(ids, list) else []


def _last(branch: Sequence[Message], wanted: Callable[[Message], bool], nothing: str) -> str:
    for message in reversed(branch):
        if wanted(message) and isinstance(message.get("id"), str):
            return str(message["id"])
    raise CliError(nothing)


def _refused(exc: ApiError, conversation_id: str, message_id: str) -> CliError:
    """A 404 as an unknown message (the conversation was read just before), a 409 ``run_active``
    as what to do about the run; any other error unchanged."""
    if exc.status != 404:
        return run_active_error(exc, conversation_id)
    return CliError(
        f"no message {message_id} in conversation {conversation_id}; "
        f"see its messages with `agentstream conversations {conversation_id}`"
    )


def _article(role: object) -> str:
    return f"an {role}" if str(role)[:1] in "aeiou" else f"a {role}"
