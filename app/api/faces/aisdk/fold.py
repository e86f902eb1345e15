"""UI message chunks folded into the ``UIMessage`` a client builds from them (FACES.md V-06).

The same steps as the ``ai`` package's ``processUIMessageStream`` (ai 7:
``src/ui/process-ui-message-stream.ts``), for the chunks ``MessageChunks`` sends: ``GET
.../messages`` shows a run's message exactly as a client that streamed it holds it. A key the
client leaves ``undefined`` is absent here (JSON has no ``undefined``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from app.api.faces.aisdk.chunks import Chunk

Part = dict[str, Any]


class FoldError(ValueError):
    """A chunk the client would refuse (it names a part the message does not have)."""


def _is_tool(part: Part) -> bool:
    kind: str = part["type"]
    return kind == "dynamic-tool" or kind.startswith("tool-")


def _merge(base: Any, overrides: Any) -> Any:
    """``mergeObjects``: a deep merge of plain objects where ``overrides`` wins."""
    if not isinstance(base, dict) or not isinstance(overrides, dict):
        return overrides
    merged = dict(base)
    for key, value in overrides.items():
        merged[key] = _merge(merged[key], value) if isinstance(merged.get(key), dict) else value
    return merged


def _put(part: Part, key: str, value: Any) -> None:
    """Set ``key``, or drop it for a value the client leaves undefined (None here)."""
    if value is None:
        part.pop(key, None)
    else:
        part[key] = value


class MessageFold:
    """One assistant message, built chunk by chunk."""

    def __init__(self, message_id: str = "") -> None:
        self.message: dict[str, Any] = {"id": message_id, "role": "assistant", "parts": []}
        self._texts: dict[str, Part] = {}
        self._reasoning: dict[str, Part] = {}

    @property
    def parts(self) -> list[Part]:
        parts: list[Part] = self.message["parts"]
        return parts

    def _step_parts(self) -> list[Part]:
        last = max((i for i, p in enumerate(self.parts) if p["type"] == "step-start"), default=-1)
        return self.parts[last + 1 :]

    def _tool(self, call_id: str) -> Part:
        for part in self._step_parts():
            if _is_tool(part) and part["toolCallId"] == call_id:
                return part
        for part in reversed(self.parts):
            if _is_tool(part) and part["toolCallId"] == call_id:
                return part
        raise FoldError(f'No tool invocation found for tool call ID "{call_id}".')

    def feed(self, chunks: Iterable[Chunk]) -> dict[str, Any]:
        for chunk in chunks:
            self.chunk(chunk)
        return self.message

    def chunk(self, chunk: Chunk) -> None:
        kind = chunk["type"]
        if kind == "start":
            if chunk.get("messageId") is not None:
                self.message["id"] = chunk["messageId"]
            self._metadata(chunk.get("messageMetadata"))
        elif kind in ("finish", "message-metadata"):
            self._metadata(chunk.get("messageMetadata"))
        elif kind == "start-step":
            self.parts.append({"type": "step-start"})
        elif kind == "reset-step":
            self._texts, self._reasoning = {}, {}
            step = self._step_parts()
            if step:
                del self.parts[len(self.parts) - len(step) :]
        elif kind in ("text-start", "reasoning-start"):
            part: Part = {"type": "text", "text": "", "state": "streaming"}
            active = self._texts
            if kind == "reasoning-start":
                part = {"type": "reasoning", "id": chunk["id"], "text": "", "state": "streaming"}
                active = self._reasoning
            active[chunk["id"]] = part
            self.parts.append(part)
        elif kind in ("text-delta", "reasoning-delta", "text-end", "reasoning-end"):
            active = self._texts if kind.startswith("text") else self._reasoning
            open_part = active.get(chunk["id"])
            if open_part is None:
                raise FoldError(f'Received {kind} for missing part with ID "{chunk["id"]}".')
            if kind.endswith("delta"):
                open_part["text"] += chunk["delta"]
            else:
                open_part["state"] = "done"
                del active[chunk["id"]]
        elif kind == "tool-input-available":
            self._input(chunk)
        elif kind == "tool-approval-request":
            tool = self._tool(chunk["toolCallId"])
            tool["state"] = "approval-requested"
            tool["approval"] = {"id": chunk["approvalId"]}
        elif kind == "tool-approval-response":
            self._approval_response(chunk)
        elif kind == "tool-output-denied":
            self._tool(chunk["toolCallId"])["state"] = "output-denied"
        elif kind in ("tool-output-available", "tool-output-error"):
            self._output(chunk)
        elif kind.startswith("data-"):
            same = next(
                (p for p in self.parts if p["type"] == kind and "id" in chunk and p.get("id") == chunk["id"]),
                None,
            )
            if same is not None:
                same["data"] = chunk["data"]
            else:
                self.parts.append(dict(chunk))

    def _approval_response(self, chunk: Chunk) -> None:
        wanted = chunk["approvalId"]
        for tool in self.parts:
            if _is_tool(tool) and tool.get("approval", {}).get("id") == wanted:
                approval = {**tool["approval"], "id": wanted, "approved": chunk["approved"]}
                if chunk.get("reason") is not None:
                    approval["reason"] = chunk["reason"]
                tool["state"] = "approval-responded"
                tool["approval"] = approval
                return
        raise FoldError(f'No tool invocation found for approval ID "{wanted}".')

    def _metadata(self, metadata: Any) -> None:
        if metadata is not None:
            self.message["metadata"] = _merge(self.message.get("metadata"), metadata)

    def _input(self, chunk: Chunk) -> None:
        dynamic = bool(chunk.get("dynamic"))
        call_id = chunk["toolCallId"]
        existing = next(
            (
                p
                for p in self._step_parts()
                if p["type"] != "step-start"
                and (p["type"] == "dynamic-tool" if dynamic else p["type"].startswith("tool-"))
                and p.get("toolCallId") == call_id
            ),
            None,
        )
        if existing is None:
            part: Part = {"type": "dynamic-tool", "toolName": chunk["toolName"]} if dynamic else {}
            if not dynamic:
                part["type"] = f"tool-{chunk['toolName']}"
            part.update(toolCallId=call_id, state="input-available", input=chunk["input"])
            for key in ("providerExecuted", "title", "toolMetadata"):
                _put(part, key, chunk.get(key))
            self.parts.append(part)
            return
        existing["state"] = "input-available"
        if dynamic:
            existing["toolName"] = chunk["toolName"]
        else:
            existing["type"] = f"tool-{chunk['toolName']}"
        existing["input"] = chunk["input"]
        for key in ("output", "errorText", "rawInput", "inputEncoding", "preliminary"):
            existing.pop(key, None)
        for key in ("title", "toolMetadata"):
            if chunk.get(key) is not None:
                existing[key] = chunk[key]
        _put(existing, "providerExecuted", chunk.get("providerExecuted", existing.get("providerExecuted")))

    def _output(self, chunk: Chunk) -> None:
        tool = self._tool(chunk["toolCallId"])
        if chunk["type"] == "tool-output-available":
            tool["state"] = "output-available"
            tool["output"] = chunk["output"]
            tool.pop("errorText", None)
            tool.pop("preliminary", None)
        else:
            tool["state"] = "output-error"
            tool["errorText"] = chunk["errorText"]
            tool.pop("output", None)
            tool.pop("preliminary", None)
        tool.pop("inputEncoding", None)
        if tool["type"] == "dynamic-tool" or chunk["type"] == "tool-output-available":
            tool.pop("rawInput", None)
        _put(tool, "providerExecuted", chunk.get("providerExecuted", tool.get("providerExecuted")))
        if chunk.get("toolMetadata") is not None:
            tool["toolMetadata"] = chunk["toolMetadata"]


def fold(chunks: Iterable[Chunk]) -> dict[str, Any]:
    """The message a client that read ``chunks`` from a fresh start holds."""
    return MessageFold().feed(chunks)
