"""How the CLI shows a run's events: readable lines for people, JSON lines for scripts.

``HumanRenderer`` prints tool steps, phase/compact/inject notes, the answer token by token and a
footer from ``done``; ``JsonRenderer`` prints every event as one JSON line on stdout and keeps its
own notes on stderr so stdout stays machine-readable.

A run carried on by another worker announces its new attempt with ``phase: resumed`` {attempt,
after} (RUNS.md R-03): the tool calls shown after the cursor ``after`` are redone, and the answer
streams again from its start (R-04: ``done.answer`` is the deltas after the last ``resumed``).
Printed text cannot be taken back, so the human output says so and starts the answer afresh.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from app.cli.sse import ServerEvent

OBSERVATION_PREVIEW_CHARS = 200


class Renderer(Protocol):
    def handle(self, event: ServerEvent) -> None:
        """Show one event as it arrives."""
        ...

    def info(self, text: str) -> None:
        """A note about the session (conversation id, reconnects, hints), not an event."""
        ...

    def break_line(self) -> None:
        """Make sure the next output starts on a fresh line (after a half-streamed answer)."""
        ...

    def run_summary(self, run: dict[str, Any]) -> None:
        """Show a finished run read from ``GET /api/runs/{id}`` when its ``done`` was not streamed."""
        ...


@dataclass(slots=True)
class _ToolCall:
    """A tool call printed for the run: enough to tell whether a resume redoes it."""

    iteration: object
    tool: object
    last_id: str | None
    open: bool = True
    redone: bool = False


class HumanRenderer:
    """Readable output; tracks the streamed answer (since the last resume) to notice when
    ``done.answer`` replaces it."""

    def __init__(self, out: TextIO, *, verbose: bool = False) -> None:
        self._out = out
        self._verbose = verbose
        self._streamed: list[str] = []
        self._mid_line = False
        self._calls: list[_ToolCall] = []
        self.final_answer: str | None = None
        """The run's answer as this renderer reported it at the end: ``done.answer``, else the text
        streamed after the run's last ``resumed``; None until the run has ended."""

    @property
    def streamed_answer(self) -> str:
        """The answer text streamed since the answer (re)started; a ``resumed`` empties it."""
        return "".join(self._streamed)

    def handle(self, event: ServerEvent) -> None:
        data = event.data
        match event.event:
            case "step":
                self._step(data, event.id)
            case "answer":
                self._answer(data)
            case "phase" if data.get("phase") == "resumed":
                self._resumed(data)
            case "phase" if data.get("phase") == "queued":
                self._line(f"· queued (position {data.get('position', '?')}): starts when a worker has room")
            case "phase" if data.get("phase") == "fallback":
                self._line(
                    f"· model {data.get('from_model', '?')} unavailable: falling back to "
                    f"{data.get('to_model', '?')}"
                )
            case "phase":
                total = data.get("total_tools")
                suffix = f" ({total} tools)" if total is not None else ""
                self._line(f"· phase: {data.get('phase', '?')}{suffix}")
            case "compact":
                self._line(
                    f"· context compacted: {data.get('original_messages', '?')} → "
                    f"{data.get('kept_messages', '?')} messages"
                )
            case "inject":
                self._line(f"· injected: {data.get('content', '')}")
            case "approval":
                self._approval(data)
            case "done":
                self._done(data)
            case _:
                self._line(f"· {event.event}: {json.dumps(data, ensure_ascii=False)}")

    def info(self, text: str) -> None:
        self._line(text)

    def _approval(self, data: dict[str, Any]) -> None:
        status = data.get("status")
        if status == "requested":
            args = json.dumps(data.get("tool_args", {}), ensure_ascii=False)
            self._line(
                f"⏸ waiting for approval: {data.get('tool_name', '?')} {args}  [{data.get('approval_id')}]"
            )
            return
        mark = {"approved": "✓ approved", "denied": "✗ denied", "expired": "⌛ expired"}.get(
            str(status), str(status)
        )
        reason = f": {data['reason']}" if data.get("reason") else ""
        self._line(f"  {mark}{reason}")

    def break_line(self) -> None:
        if self._mid_line:
            self._write("\n")
            self._mid_line = False

    def run_summary(self, run: dict[str, Any]) -> None:
        answer = run.get("answer") or ""
        if answer and answer != self.streamed_answer:
            self._line(answer)
        self.final_answer = answer or self.streamed_answer
        self._footer(run)

    def _step(self, data: dict[str, Any], event_id: str | None) -> None:
        kind, status = data.get("type"), data.get("status")
        if kind == "iteration" and status == "start":
            self._calls.append(_ToolCall(data.get("iteration"), data.get("tool_name"), event_id))
            args = json.dumps(data.get("tool_args", {}), ensure_ascii=False)
            self._line(f"→ {data.get('tool_name', '?')} {args}")
        elif kind == "iteration" and status == "done":
            self._call_done(data, event_id)
            elapsed = _seconds(data.get("iter_elapsed"))
            error = data.get("error")
            if error:
                self._line(f"  ✗ {self._preview(str(error))}{elapsed}")
            else:
                self._line(f"  ← {self._preview(str(data.get('observation', '')))}{elapsed}")
            artifact = data.get("artifact")
            if isinstance(artifact, dict):
                self._line(f"  ⎘ {artifact.get('filename', 'artifact')} ({artifact.get('mime_type', '?')})")
        elif kind == "thinking" and status == "done" and self._verbose:
            reasoning = str(data.get("reasoning", "")).strip()
            if reasoning:
                self._line(f"  … {reasoning}")

    def _call_done(self, data: dict[str, Any], event_id: str | None) -> None:
        key = (data.get("iteration"), data.get("tool_name"))
        call = next((c for c in self._calls if c.open and (c.iteration, c.tool) == key), None)
        if call is None:
            call = _ToolCall(*key, last_id=event_id)
            self._calls.append(call)
        call.open = False
        call.last_id = event_id

    def _resumed(self, data: dict[str, Any]) -> None:
        """A new attempt from the run's last checkpoint: say what is redone; the answer restarts."""
        self.break_line()
        after = _cursor(data.get("after"))
        redone: int | None = 0
        for call in self._calls:
            if call.redone:
                continue
            last = _cursor(call.last_id)
            if after is None or last is None:
                redone = None
            elif last > after:
                call.redone, call.open = True, False
                if redone is not None:
                    redone += 1
        notes = []
        if redone is None:
            notes.append("any steps shown after its last checkpoint are redone")
        elif redone:
            notes.append(f"{_count(redone, 'tool call')} shown above {'is' if redone == 1 else 'are'} redone")
        if self._streamed:
            notes.append("the answer starts again")
        attempt = data.get("attempt", "?")
        detail = " and ".join(notes) if notes else "it carries on from its last checkpoint"
        self._line(f"· resumed on another worker (attempt {attempt}): {detail}")
        self._streamed = []

    def _answer(self, data: dict[str, Any]) -> None:
        status = data.get("status")
        if status == "start":
            self.break_line()
            self._streamed = []
        elif status == "delta":
            content = str(data.get("content", ""))
            self._streamed.append(content)
            if content:
                self._write(content)
                self._mid_line = not content.endswith("\n")
        elif status == "done":
            self.break_line()

    def _done(self, data: dict[str, Any]) -> None:
        self.break_line()
        answer = data.get("answer") or ""
        streamed = self.streamed_answer
        self.final_answer = answer or streamed
        if answer and answer != streamed:
            # Synthesis failed mid-stream (or we joined late): the server's answer replaces the text.
            if streamed:
                self._line("(the streamed answer was incomplete; the final answer is:)")
            self._line(answer)
        self._footer(data)
        self._streamed = []
        self._calls = []

    def _footer(self, data: dict[str, Any]) -> None:
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        parts = [str(data.get("status", "?"))]
        if data.get("iterations") is not None:
            parts.append(_count(data["iterations"], "iteration"))
        if usage:
            parts.append(
                f"{usage.get('total_tokens', 0)} tokens "
                f"({usage.get('prompt_tokens', 0)} in, {usage.get('completion_tokens', 0)} out)"
            )
            parts.append(_count(usage.get("llm_calls", 0), "LLM call"))
        if isinstance(data.get("elapsed"), int | float):
            parts.append(f"{data['elapsed']:.2f}s")
        self._line("── " + " · ".join(parts))
        if data.get("error"):
            self._line(f"   error: {data['error']}")
        for pending in data.get("pending_injections") or ():
            self._line(f"   not delivered: {pending}")

    def _preview(self, text: str) -> str:
        if self._verbose:
            return text
        flat = " ".join(text.split())
        if len(flat) > OBSERVATION_PREVIEW_CHARS:
            return flat[: OBSERVATION_PREVIEW_CHARS - 1] + "…"
        return flat

    def _line(self, text: str) -> None:
        self.break_line()
        self._write(text + "\n")

    def _write(self, text: str) -> None:
        self._out.write(text)
        self._out.flush()


class JsonRenderer:
    """One JSON line per event on ``out``; notes go to ``err``."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self._out = out
        self._err = err

    def handle(self, event: ServerEvent) -> None:
        self._out.write(event.json_line() + "\n")
        self._out.flush()

    def info(self, text: str) -> None:
        self._err.write(text + "\n")
        self._err.flush()

    def break_line(self) -> None:
        return None

    def run_summary(self, run: dict[str, Any]) -> None:
        self._out.write(json.dumps({"id": None, "event": "run", "data": run}, ensure_ascii=False) + "\n")
        self._out.flush()


def _cursor(value: object) -> tuple[int, int] | None:
    """A cursor ``"<ms>-<seq>"`` as numbers, to compare; None when ``value`` is not one."""
    if not isinstance(value, str):
        return None
    ms, sep, seq = value.partition("-")
    if not ms.isdigit() or (sep and not seq.isdigit()):
        return None
    return int(ms), int(seq or 0)


def _seconds(value: object) -> str:
    return f" ({value:.2f}s)" if isinstance(value, int | float) else ""


def _count(n: object, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
