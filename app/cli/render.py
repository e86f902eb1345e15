"""How the CLI shows a run's events: readable lines for people, JSON lines for scripts.

``HumanRenderer`` prints tool steps, phase/compact/inject notes, the answer token by token and a
footer from ``done``; ``JsonRenderer`` prints every event as one JSON line on stdout and keeps its
own notes on stderr so stdout stays machine-readable.
"""

from __future__ import annotations

import json
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


class HumanRenderer:
    """Readable output; tracks the streamed answer to notice when ``done.answer`` replaces it."""

    def __init__(self, out: TextIO, *, verbose: bool = False) -> None:
        self._out = out
        self._verbose = verbose
        self._streamed: list[str] = []
        self._mid_line = False

    def handle(self, event: ServerEvent) -> None:
        data = event.data
        match event.event:
            case "step":
                self._step(data)
            case "answer":
                self._answer(data)
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
            case "done":
                self._done(data)
            case _:
                self._line(f"· {event.event}: {json.dumps(data, ensure_ascii=False)}")

    def info(self, text: str) -> None:
        self._line(text)

    def break_line(self) -> None:
        if self._mid_line:
            self._write("\n")
            self._mid_line = False

    def run_summary(self, run: dict[str, Any]) -> None:
        answer = run.get("answer") or ""
        if answer and answer != "".join(self._streamed):
            self._line(answer)
        self._footer(run)

    def _step(self, data: dict[str, Any]) -> None:
        kind, status = data.get("type"), data.get("status")
        if kind == "iteration" and status == "start":
            args = json.dumps(data.get("tool_args", {}), ensure_ascii=False)
            self._line(f"→ {data.get('tool_name', '?')} {args}")
        elif kind == "iteration" and status == "done":
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
        streamed = "".join(self._streamed)
        if answer and answer != streamed:
            # Synthesis failed mid-stream (or we joined late): the server's answer replaces the text.
            if streamed:
                self._line("(the streamed answer was incomplete; the final answer is:)")
            self._line(answer)
        self._footer(data)
        self._streamed = []

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


def _seconds(value: object) -> str:
    return f" ({value:.2f}s)" if isinstance(value, int | float) else ""


def _count(n: object, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
