"""What an AG-UI client holds after a response's events (FACES.md G-03; design note D3).

``@ag-ui/client`` 1.0 builds its messages from the events (``defaultApplyEvents``): a
``TEXT_MESSAGE_START`` or ``REASONING_MESSAGE_START`` adds a message under its id, their
``CONTENT`` events append to it, ``TOOL_CALL_START`` adds the call to its parent assistant message
(made if missing), ``TOOL_CALL_ARGS`` append to the call's arguments, and ``TOOL_CALL_RESULT`` adds
a tool message after the assistant message holding the call and the tool messages right after it.
``ClientMessages`` follows those rules for the events the translator sends, beside the history the
client sent, so that a response knows whether the client already holds what a final
``MESSAGES_SNAPSHOT`` would tell it (then it needs none).

It follows them only while it can tell: an event naming a message or call the client's history
holds (the client's reducer would then change that message), an event it cannot place, or a
snapshot (which replaces what the client holds) make it ``exact`` no more, and the response sends
its snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson
from ag_ui.core import (
    BaseEvent,
    Message,
    MessagesSnapshotEvent,
    ReasoningMessageContentEvent,
    ReasoningMessageStartEvent,
    TextMessageContentEvent,
    TextMessageStartEvent,
    ToolCallArgsEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
)


def as_sent(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """Messages as a snapshot puts them on the wire (what a client holds of one)."""
    return [orjson.loads(m.model_dump_json(by_alias=True)) for m in messages]


class ClientMessages:
    """The messages a response's events add to the client's (``messages``, in its order)."""

    def __init__(self, history_ids: Iterable[str] = (), history_calls: Iterable[str] = ()) -> None:
        """``history_ids``: the ids of the messages the client sent; ``history_calls``: the ids of
        the tool calls among them."""
        self.messages: list[dict[str, Any]] = []
        self.exact = True
        self._history_ids = set(history_ids)
        self._history_calls = set(history_calls)
        self._by_id: dict[str, dict[str, Any]] = {}
        self._calls: dict[str, dict[str, Any]] = {}
        """Tool call id -> the call as the client holds it (``{id, type, function}``)."""

    def apply(self, events: Iterable[BaseEvent]) -> None:
        for event in events:
            if not self.exact:
                return
            self._apply(event)

    def holds(self, messages: Sequence[Message]) -> bool:
        """Whether the client holds exactly ``messages`` after the history it sent."""
        return self.exact and self.messages == as_sent(messages)

    def _apply(self, event: BaseEvent) -> None:
        if isinstance(event, TextMessageStartEvent):
            self._open(event.message_id, event.role or "assistant")
        elif isinstance(event, ReasoningMessageStartEvent):
            self._open(event.message_id, "reasoning")
        elif isinstance(event, TextMessageContentEvent | ReasoningMessageContentEvent):
            self._append(event.message_id, event.delta)
        elif isinstance(event, ToolCallStartEvent):
            self._start_call(event)
        elif isinstance(event, ToolCallArgsEvent):
            call = self._calls.get(event.tool_call_id)
            if call is None:
                self.exact = False
            else:
                call["function"]["arguments"] += event.delta
        elif isinstance(event, ToolCallResultEvent):
            self._result(event)
        elif isinstance(event, MessagesSnapshotEvent):
            self.exact = False

    def _open(self, message_id: str, role: str) -> None:
        if message_id in self._history_ids:
            self.exact = False
        elif message_id not in self._by_id:  # an id it holds already: the client keeps that message
            message = {"id": message_id, "role": role, "content": ""}
            self._by_id[message_id] = message
            self.messages.append(message)

    def _append(self, message_id: str, delta: str) -> None:
        message = self._by_id.get(message_id)
        if message is None or not isinstance(message.get("content"), str):
            self.exact = False
        else:
            message["content"] += delta

    def _start_call(self, event: ToolCallStartEvent) -> None:
        call_id = event.tool_call_id
        parent_id = event.parent_message_id
        if call_id in self._history_calls or call_id in self._calls or parent_id in self._history_ids:
            self.exact = False  # the client would change a call or message it holds already
            return
        if parent_id is None:
            self.exact = False
            return
        parent = self._by_id.get(parent_id)
        if parent is None:
            parent = {"id": parent_id, "role": "assistant", "toolCalls": []}
            self._by_id[parent_id] = parent
            self.messages.append(parent)
        elif parent.get("role") != "assistant":
            self.exact = False
            return
        function = {"name": event.tool_call_name, "arguments": ""}
        call = {"id": call_id, "type": "function", "function": function}
        parent.setdefault("toolCalls", []).append(call)
        self._calls[call_id] = call

    def _result(self, event: ToolCallResultEvent) -> None:
        if event.message_id in self._history_ids or event.tool_call_id in self._history_calls:
            self.exact = False
            return
        message: dict[str, Any] = {
            "id": event.message_id,
            "role": event.role or "tool",
            "content": event.content,
            "toolCallId": event.tool_call_id,
        }
        if event.metadata is not None:
            message["metadata"] = orjson.loads(orjson.dumps(event.metadata))
        self._by_id.setdefault(event.message_id, message)
        holder = next(
            (i for i, m in enumerate(self.messages) if m.get("role") == "assistant" and self._has(m, event)),
            None,
        )
        if holder is None:
            self.messages.append(message)
            return
        at = holder + 1
        while at < len(self.messages) and self.messages[at].get("role") == "tool":
            at += 1
        self.messages.insert(at, message)

    @staticmethod
    def _has(message: dict[str, Any], result: ToolCallResultEvent) -> bool:
        return any(c["id"] == result.tool_call_id for c in message.get("toolCalls") or ())
