"""A run's events as the AI SDK's UI message chunks (FACES.md V-04): one run is one assistant message.

``MessageChunks`` is a deterministic state machine over one run's events, the same live and
replayed: the POST's response, the resume (``GET .../stream``, the whole message from its
``start``) and ``GET .../messages`` (the chunks folded by ``app.api.faces.aisdk.fold``) all come
from it, so the message a client ends with is the message the service shows. What the design note
``docs/faces-protocols.md`` (D1, D2) found in the client's own code decides the shapes:

- a step per loop iteration and one for the answer (``start-step``), never two for one iteration;
- a server tool call is ``dynamic`` and ``providerExecuted`` (the client neither runs it nor sends
  anything for it); a call that waits for an approval is not ``providerExecuted`` (with it, a step
  that also holds a client call makes ``useChat`` send again and again); a client tool call is
  static (a docs-style ``onToolCall`` returns on dynamic calls);
- a client call's output is the one the client sent (stored with the call), so the live message
  equals the replayed one;
- a worker's death (``phase resumed``) retracts the redone work of the open step with
  ``reset-step``, the only retraction the protocol has.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from app.api.faces.follow import payload
from app.streaming.bus import StoredEvent, parse_cursor

Chunk = dict[str, Any]
ClientOutput = Callable[[str], Awaitable[dict[str, Any] | None]]
"""A client call's stored result (``{"output": any}`` or ``{"error": str}``) by its call id."""

_PHASE_PARTS = ("selecting_tools", "queued", "fallback", "replay", "resumed")


async def _no_output(call_id: str) -> dict[str, Any] | None:
    del call_id
    return None


@dataclass
class _State:
    """What the client holds of the message, as far as the next chunk depends on it."""

    steps: int = 0
    """``start-step`` chunks sent (the message's ``step-start`` parts)."""
    step_open: bool = False
    step_parts: int = 0
    """Parts added since the last ``start-step`` (a step with none is used again)."""
    shown: dict[str, int] = field(default_factory=dict)
    """Calls whose tool part exists, and the step it is in."""
    client_calls: set[str] = field(default_factory=set)
    approval_calls: set[str] = field(default_factory=set)
    approvals: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Approval id → its call's id and the step of its request, for the approvals requested."""
    data: dict[str, int] = field(default_factory=dict)
    """Data parts by id, and the step each is in (one sent again is replaced where it is)."""
    refused: set[str] = field(default_factory=set)
    """Calls denied or expired (their part is ``output-denied``; their observation is not shown)."""
    text: str | None = None
    """The open text part's id."""
    texts: int = 0
    answer: list[str] = field(default_factory=list)
    """The answer text streamed in the open attempt (E-04: compared with ``done.answer``)."""


class MessageChunks:
    """The chunks of one run's assistant message; feed its events in order with ``event``."""

    def __init__(self, run_id: str, client_output: ClientOutput = _no_output) -> None:
        self.run_id = run_id
        self._client_output = client_output
        self._s = _State()
        self._seen: list[StoredEvent] = []

    def start(self, **metadata: Any) -> list[Chunk]:
        return [
            {
                "type": "start",
                "messageId": self.run_id,
                "messageMetadata": {"run_id": self.run_id, **metadata},
            }
        ]

    def park(self) -> list[Chunk]:
        """The run stopped to wait for a person or the client: this response ends here."""
        out = self._close_text()
        if self._s.step_open:
            out.append({"type": "finish-step"})
            self._s.step_open = False
        metadata = {"run_id": self.run_id, "status": "waiting"}
        out.append({"type": "finish", "finishReason": "tool-calls", "messageMetadata": metadata})
        return out

    async def event(self, event: StoredEvent) -> list[Chunk]:
        self._seen.append(event)
        data = payload(event)
        kind = event.event
        if kind == "step":
            return await self._step(data)
        if kind == "answer":
            return self._answer(data)
        if kind == "approval":
            return self._approval(data)
        if kind == "phase":
            if data.get("phase") == "resumed":
                return await self._resumed(event, data)
            if data.get("phase") in _PHASE_PARTS:
                return self._data("phase", f"phase:{data['phase']}", data)
            return []
        if kind in ("inject", "compact"):
            return self._data(kind, f"{kind}:{event.id}", data)
        if kind == "done":
            return self._done(data)
        return []

    # --- steps, tools, approvals ---------------------------------------------------------------

    def _new_step(self) -> list[Chunk]:
        s = self._s
        if s.step_open and s.step_parts == 0:
            return []  # the open step has nothing yet: it is this one
        out = self._close_text()
        if s.step_open:
            out.append({"type": "finish-step"})
        out.append({"type": "start-step"})
        s.steps += 1
        s.step_open, s.step_parts = True, 0
        return out

    def _part(self, *chunks: Chunk) -> list[Chunk]:
        self._s.step_parts += 1
        return list(chunks)

    def _data(self, kind: str, part_id: str, data: dict[str, Any]) -> list[Chunk]:
        shown = {k: v for k, v in data.items() if k != "run_id"}
        chunk = {"type": f"data-agentstream-{kind}", "id": part_id, "data": shown}
        if part_id in self._s.data:
            return [chunk]  # the client replaces the part where it is
        self._s.data[part_id] = self._s.steps
        return self._part(chunk)

    async def _step(self, data: dict[str, Any]) -> list[Chunk]:
        s = self._s
        kind, status = data.get("type"), data.get("status")
        if kind in ("thinking", "answer") and status == "start":
            return self._new_step()
        if kind == "thinking" and status == "done":
            reasoning = data.get("reasoning") or ""
            if not reasoning.strip():
                return []
            rid = f"rsn_{self.run_id}_{data.get('iteration')}"
            return self._part(
                {"type": "reasoning-start", "id": rid},
                {"type": "reasoning-delta", "id": rid, "delta": reasoning},
                {"type": "reasoning-end", "id": rid},
            )
        call_id = data.get("call_id") or f"{self.run_id}_{data.get('iteration')}_{data.get('tool_name')}"
        if kind == "iteration" and status == "start":
            if call_id in s.shown:
                return []
            s.shown[call_id] = s.steps
            chunk: Chunk = {
                "type": "tool-input-available",
                "toolCallId": call_id,
                "toolName": data.get("tool_name", ""),
                "input": data.get("tool_args", {}),
            }
            if data.get("client"):
                s.client_calls.add(call_id)
                if data.get("expires_at"):
                    chunk["toolMetadata"] = {"expires_at": data["expires_at"]}
            else:
                chunk.update(dynamic=True, providerExecuted=True)
            return self._part(chunk)
        if kind == "iteration" and status == "done":
            if call_id in s.refused:
                return []
            if call_id not in s.shown:  # its start is not in this message: the part comes first
                opened = await self._step({**data, "status": "start", "tool_args": {}})
                return [*opened, *await self._output(call_id, data)]
            return await self._output(call_id, data)
        return []

    async def _output(self, call_id: str, data: dict[str, Any]) -> list[Chunk]:
        s = self._s
        error = data.get("error")
        if call_id in s.client_calls:
            stored = await self._client_output(call_id)
            if stored is not None and "error" not in stored:
                return [
                    {"type": "tool-output-available", "toolCallId": call_id, "output": stored.get("output")}
                ]
            text = (stored or {}).get("error") or error or data.get("observation") or "no result"
            return [{"type": "tool-output-error", "toolCallId": call_id, "errorText": str(text)}]
        extra: Chunk = {} if call_id in s.approval_calls else {"dynamic": True, "providerExecuted": True}
        if error is None:
            output = {
                "type": "tool-output-available",
                "toolCallId": call_id,
                "output": data.get("observation", ""),
            }
            return [{**output, **extra}]
        return [{"type": "tool-output-error", "toolCallId": call_id, "errorText": str(error), **extra}]

    def _approval(self, data: dict[str, Any]) -> list[Chunk]:
        s = self._s
        approval_id, status = data.get("approval_id", ""), data.get("status")
        if status == "requested":
            call_id = data.get("call_id", "")
            out: list[Chunk] = []
            if call_id not in s.shown:
                s.shown[call_id] = s.steps
                out.append(
                    {
                        "type": "tool-input-available",
                        "toolCallId": call_id,
                        "toolName": data.get("tool_name", ""),
                        "input": data.get("tool_args", {}),
                        "dynamic": True,
                        "toolMetadata": {"expires_at": data.get("expires_at")},
                    }
                )
                s.step_parts += 1
            s.approval_calls.add(call_id)
            if approval_id not in s.approvals:
                s.approvals[approval_id] = (call_id, s.steps)
                out.append(
                    {"type": "tool-approval-request", "approvalId": approval_id, "toolCallId": call_id}
                )
            return out
        if approval_id not in s.approvals:
            return []  # asked before what this message shows (not the case for a whole run)
        call_id = s.approvals[approval_id][0]
        approved = status == "approved"
        response: Chunk = {"type": "tool-approval-response", "approvalId": approval_id, "approved": approved}
        if data.get("reason"):
            response["reason"] = data["reason"]
        if approved:
            return [response]
        s.refused.add(call_id)
        return [response, {"type": "tool-output-denied", "toolCallId": call_id}]

    # --- the answer and the end ----------------------------------------------------------------

    def _answer(self, data: dict[str, Any]) -> list[Chunk]:
        s = self._s
        status = data.get("status")
        if status == "start":
            out = self._close_text()
            s.texts += 1
            s.text = f"txt_{self.run_id}_{s.texts}"
            s.answer = []
            return [*out, *self._part({"type": "text-start", "id": s.text})]
        if status == "delta":
            content = data.get("content") or ""
            if not content:
                return []
            out = [] if s.text is not None else self._answer({"status": "start"})
            s.answer.append(content)
            return [*out, {"type": "text-delta", "id": s.text, "delta": content}]
        if status == "done":
            return self._close_text()
        return []

    def _close_text(self) -> list[Chunk]:
        s = self._s
        if s.text is None:
            return []
        closed = [{"type": "text-end", "id": s.text}]
        s.text = None
        return closed

    def _done(self, data: dict[str, Any]) -> list[Chunk]:
        s = self._s
        status = data.get("status")
        out = self._close_text()
        answer = data.get("answer") or ""
        if status == "completed" and answer != "".join(s.answer):
            # E-04: synthesis failed mid-stream, and the fallback answer stands in for the partial
            # text (taken back with its step's parts: the answer's step holds only it).
            out += [{"type": "reset-step"}] if s.answer else self._new_step()
            s.texts += 1
            tid = f"txt_{self.run_id}_{s.texts}"
            out.append({"type": "text-start", "id": tid})
            if answer:
                out.append({"type": "text-delta", "id": tid, "delta": answer})
            out.append({"type": "text-end", "id": tid})
            s.step_parts += 1
        if s.step_open:
            out.append({"type": "finish-step"})
            s.step_open = False
        metadata = {
            "run_id": self.run_id,
            "status": status,
            "usage": data.get("usage"),
            "model": data.get("model"),
        }
        if status == "failed":
            # After an ``error`` chunk the client applies nothing more: the metadata comes first.
            out.append({"type": "message-metadata", "messageMetadata": metadata})
            out.append({"type": "error", "errorText": str(data.get("error") or "the run failed")})
            out.append({"type": "finish", "finishReason": "error"})
        else:
            reason = "stop" if status == "completed" else "other"
            out.append({"type": "finish", "finishReason": reason, "messageMetadata": metadata})
        return out

    # --- a worker's death ----------------------------------------------------------------------

    async def _resumed(self, event: StoredEvent, data: dict[str, Any]) -> list[Chunk]:
        """Another attempt carries the run on from ``after`` (RUNS.md R-03): what the open step
        shows of the redone work is taken back (``reset-step``) and its kept part sent again."""
        after = parse_cursor(str(data.get("after") or "0-0"))
        kept = [e for e in self._seen[:-1] if parse_cursor(e.id) <= after]
        fresh = MessageChunks(self.run_id, self._client_output)
        replayed: list[Chunk] = []
        for earlier in kept:
            replayed += await fresh.event(earlier)
        live = self._s
        out: list[Chunk] = [{"type": "reset-step"}]
        state = fresh._s
        if state.steps == live.steps:
            # The redone work began inside the open step: what came before it in the step is kept.
            last = max((i for i, c in enumerate(replayed) if c["type"] == "start-step"), default=-1)
            out += [c for c in replayed[last + 1 :] if c["type"] not in ("finish-step", "finish")]
        else:
            # It began with a later step than the one open now: the open step starts empty again,
            # and the redone step start lands in it (an empty step is used again).
            state.steps, state.step_open, state.step_parts = live.steps, live.step_open, 0
        # Parts of earlier steps stay in the client's message (outputs update them in place);
        # those of the open step after the reset are gone, and come again with the redone work.
        state.shown = {**{c: n for c, n in live.shown.items() if n < live.steps}, **state.shown}
        asked = {a: v for a, v in live.approvals.items() if v[1] < live.steps}
        state.approvals = {**asked, **state.approvals}
        state.data = {**{d: n for d, n in live.data.items() if n < live.steps}, **state.data}
        state.client_calls |= live.client_calls
        state.approval_calls |= live.approval_calls
        state.refused |= live.refused
        state.texts = max(state.texts, live.texts)
        self._s = state
        self._seen = [*kept, event]
        out += self._data("phase", "phase:resumed", data)
        return out
