"""``ProviderAgent``: the small agent every fake provider of ``tests.support.fake_providers`` plays
(that module's docstring says how it answers), and the wire helpers the families share."""

from __future__ import annotations

import itertools
import re
import secrets
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tests.support.fake_agents import is_json_protocol_call
from tests.support.fake_replies import FakeReply, split_words

CREATED = 1_767_225_600
_EXPRESSION = r"[0-9+\-*/(). ]+"
QUESTION = re.compile(rf"What is (?P<expressions>{_EXPRESSION}(?:, then {_EXPRESSION})*)\?")
_RESULT_VALUE = re.compile(r"=\s*(?P<value>-?[0-9][0-9.eE+\-]*)\s*$")
ALNUM = string.ascii_letters + string.digits


class FakeProviderError(AssertionError):
    """The service sent something the agent the fake plays cannot make sense of (a test bug)."""


@dataclass(frozen=True, slots=True)
class Step:
    """What the agent does next: call the calculator with ``expression``, or say ``answer``."""

    expression: str | None = None
    answer: str | None = None
    first: bool = False
    """The turn's first call (JSON-mode thinking drafts an action there)."""


# -- reading requests ---------------------------------------------------------------------------


def messages_of(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body.get("messages") or () if isinstance(m, dict)]


def wants_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, Mapping) and bool(options.get("include_usage"))


def answer_from(result: object) -> str:
    """What the agent says once it has the calculator's ``"<expr> = <value>"``."""
    match = _RESULT_VALUE.search(result) if isinstance(result, str) else None
    if match is None:
        return "I could not read the calculator's result."
    return f"The answer is {match['value']}."


def _turn(messages: Sequence[Mapping[str, Any]]) -> tuple[int, list[str]]:
    """Index of the turn's question and the expressions it asks for."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, str):
            match = QUESTION.fullmatch(content.strip())
            if match:
                return index, [e.strip() for e in match["expressions"].split(", then")]
    raise FakeProviderError("the request carries no question the fake agent knows")


def native_step(body: Mapping[str, Any]) -> Step:
    messages = messages_of(body)
    start, expressions = _turn(messages)
    turn = messages[start + 1 :]
    calls = [m for m in turn if m.get("role") == "assistant" and m.get("tool_calls")]
    if len(calls) < len(expressions):
        return Step(expression=expressions[len(calls)], first=not calls)
    latest = calls[-1]["tool_calls"][0].get("id")
    # The first result that says it answers the latest call: with ids that repeat, that is the
    # result of an earlier call, and the answer is wrong.
    result = next(
        (m.get("content") for m in turn if m.get("role") == "tool" and m.get("tool_call_id") == latest),
        None,
    )
    return Step(answer=answer_from(result))


def json_step(body: Mapping[str, Any]) -> Step:
    messages = messages_of(body)
    start, expressions = _turn(messages)
    observations = [
        str(m.get("content"))
        for m in messages[start + 1 :]
        if m.get("role") == "user" and str(m.get("content") or "").startswith("Observation from `calculator`")
    ]
    if len(observations) < len(expressions):
        return Step(expression=expressions[len(observations)], first=not observations)
    return Step(answer=answer_from(observations[-1].rstrip()))


def synthesis_answer(body: Mapping[str, Any]) -> str:
    """The answer a synthesis call asks for: from the last ``Result:`` of the trace it carries."""
    text = "\n".join(str(m.get("content") or "") for m in messages_of(body) if m.get("role") == "user")
    results = re.findall(r"^Result:\n(.*)$", text, flags=re.MULTILINE)
    return answer_from(results[-1].strip() if results else None)


def action_text(step: Step) -> str:
    """A JSON-mode action. No ``reasoning`` key: a reasoning model's thinking is beside the text."""
    if step.expression is not None:
        action: dict[str, Any] = {
            "type": "tool_call",
            "tool_name": "calculator",
            "tool_args": {"expression": step.expression},
        }
    else:
        action = {"type": "final_answer", "answer": step.answer}
    return orjson.dumps(action).decode()


# -- writing replies ----------------------------------------------------------------------------


def json_reply(obj: object, status: int = 200) -> FakeReply:
    return FakeReply.malformed(orjson.dumps(obj), status=status, content_type="application/json")


def sse_reply(lines: Iterable[bytes]) -> FakeReply:
    return FakeReply.malformed(b"".join(lines), content_type="text/event-stream; charset=utf-8")


def data_line(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE_LINE = b"data: [DONE]\n\n"


def pieces(text: str, size: int) -> list[str]:
    """``text`` in chunks of ``size`` characters: tags end up split across chunks."""
    return [text[i : i + size] for i in range(0, len(text), size)]


class ProviderAgent:
    """The agent every fake plays, in plain OpenAI shapes; each family overrides what differs.

    ``thinks``: the family's model thinks, and the fake says so where the family puts it.
    """

    model = "gpt-4o-mini"
    thinks = False

    def __init__(self, *, model: str | None = None) -> None:
        self.model = model or type(self).model
        self.thoughts: list[str] = []
        self.reported: list[dict[str, int]] = []
        self.refusals: list[dict[str, Any]] = []
        self.served_ids: list[str] = []
        self._serial = itertools.count(1)

    # -- the handler ------------------------------------------------------------------------

    def __call__(self, body: dict[str, Any]) -> FakeReply:
        refusal = self.refuse(body)
        if refusal is not None:
            self.refusals.append(body)
            return refusal
        if body.get("stream"):
            answer = synthesis_answer(body)
            return self.stream(body, answer, self.think(Step(answer=answer), synthesis=True))
        if body.get("tool_choice") is not None or body.get("response_format") is not None:
            raise FakeProviderError("the fake agent answers loop and synthesis calls only")
        if is_json_protocol_call(body):
            step = json_step(body)
            return self.reply(body, action_text(step), None, self.think(step, json_mode=True))
        step = native_step(body)
        thinking = self.think(step)
        if step.expression is not None:
            return self.reply(body, None, self.tool_call(step.expression), thinking)
        return self.reply(body, step.answer, None, thinking)

    def refuse(self, body: Mapping[str, Any]) -> FakeReply | None:
        """The error the real provider answers this request with, if it refuses it."""
        return None

    # -- what the model says ----------------------------------------------------------------

    def think(self, step: Step, *, json_mode: bool = False, synthesis: bool = False) -> str:
        if not self.thinks:
            return ""
        if synthesis:
            thought = "Hmm, the reader only needs the number, stated plainly."
        elif step.expression is not None:
            thought = f"Hmm, {step.expression} is arithmetic: the calculator is the tool for it."
            if json_mode and step.first:
                # A reasoning model drafts in its thinking; the draft is not its action.
                thought += (
                    ' A guess would be {"type": "final_answer", "answer": "About 40."}'
                    " but guessing is wrong here."
                )
        else:
            thought = "Hmm, the calculator's result settles it."
        self.thoughts.append(thought)
        return thought

    def call_id(self) -> str:
        call_id = "call_" + "".join(secrets.choice(ALNUM) for _ in range(24))
        self.served_ids.append(call_id)
        return call_id

    def tool_call(self, expression: str) -> dict[str, Any]:
        return {
            "id": self.call_id(),
            "type": "function",
            "function": {
                "name": "calculator",
                "arguments": orjson.dumps({"expression": expression}).decode(),
            },
        }

    def usage(self, *, record: bool = True) -> dict[str, int]:
        n = next(self._serial)
        prompt, completion = 100 + 10 * n, 5 + n
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if record:
            self.reported.append(usage)
        return usage

    # -- shapes -----------------------------------------------------------------------------

    def message(self, content: str | None, call: dict[str, Any] | None, thinking: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if call is not None:
            message["tool_calls"] = [call]
        return message

    def reply(
        self, body: Mapping[str, Any], content: str | None, call: dict[str, Any] | None, thinking: str
    ) -> FakeReply:
        """A non-streamed reply (platform.openai.com/docs/api-reference/chat/object)."""
        choice = {
            "index": 0,
            "message": self.message(content, call, thinking),
            "finish_reason": "tool_calls" if call is not None else "stop",
            "logprobs": None,
        }
        return json_reply(self.completion([choice]))

    def completion(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{secrets.token_hex(8)}",
            "object": "chat.completion",
            "created": CREATED,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        """One stream chunk (platform.openai.com/docs/api-reference/chat-streaming)."""
        return {
            "id": "chatcmpl-stream",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            **extra,
        }

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage`` is set: empty choices, the usage."""
        return {
            "id": "chatcmpl-stream",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": self.model,
            "choices": [],
            "usage": self.usage(),
        }

    def stream(self, body: Mapping[str, Any], answer: str, thinking: str) -> FakeReply:
        lines = [data_line(self.chunk({"role": "assistant", "content": ""}))]
        lines += [data_line(self.chunk({"content": piece})) for piece in split_words(answer)]
        lines.append(data_line(self.chunk({}, "stop")))
        if wants_usage(body):
            lines.append(data_line(self.usage_chunk()))
        lines.append(DONE_LINE)
        return sse_reply(lines)


# -- DeepSeek -----------------------------------------------------------------------------------
