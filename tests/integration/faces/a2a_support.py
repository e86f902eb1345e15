"""What the A2A face's tests share: the official ``a2a-sdk`` client on a started service, and readers
of what it receives (FACES.md N-01..N-08)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from a2a.client import Client, ClientConfig, create_client
from a2a.types.a2a_pb2 import (
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    Task,
    TaskState,
)
from google.protobuf import json_format, struct_pb2

KEYS = "alice:key-alice,bob:key-bob"
ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
V1 = {"A2A-Version": "1.0"}
JSONRPC, REST = "JSONRPC", "HTTP+JSON"

WORKING = TaskState.TASK_STATE_WORKING
INPUT_REQUIRED = TaskState.TASK_STATE_INPUT_REQUIRED
COMPLETED = TaskState.TASK_STATE_COMPLETED
CANCELED = TaskState.TASK_STATE_CANCELED


@asynccontextmanager
async def a2a_client(
    base_url: str, headers: dict[str, str] = ALICE, *, binding: str = JSONRPC, streaming: bool = True
) -> AsyncIterator[Client]:
    """The SDK's client, from the service's agent card, on ``binding``."""
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(20.0)) as http:
        config = ClientConfig(streaming=streaming, httpx_client=http, supported_protocol_bindings=[binding])
        client = await create_client(base_url, client_config=config)
        try:
            yield client
        finally:
            await client.close()


def data(value: Any) -> Part:
    part = Part()
    part.data.CopyFrom(json_format.ParseDict(value, struct_pb2.Value()))
    return part


def message(
    *parts: Part | str, task_id: str = "", context_id: str = "", message_id: str | None = None
) -> Message:
    return Message(
        message_id=message_id or f"msg-{secrets.token_hex(4)}",
        role=Role.ROLE_USER,
        task_id=task_id,
        context_id=context_id,
        parts=[Part(text=p) if isinstance(p, str) else p for p in parts],
    )


def send(
    msg: Message, *, agent: dict[str, Any] | None = None, return_immediately: bool = False
) -> SendMessageRequest:
    request = SendMessageRequest(
        message=msg, configuration=SendMessageConfiguration(return_immediately=return_immediately)
    )
    if agent is not None:
        request.metadata.update({"agent": agent})
    return request


async def collect(stream: AsyncIterator[StreamResponse]) -> list[StreamResponse]:
    return [event async for event in stream]


def kinds(events: list[StreamResponse]) -> list[str]:
    return [str(e.WhichOneof("payload")) for e in events]


def states(events: list[StreamResponse]) -> list[int]:
    return [e.status_update.status.state for e in events if e.HasField("status_update")]


def artifact_text(events: list[StreamResponse], start: str = "") -> str:
    """The answer artifact as a client assembles it from chunks (``append`` adds, else replaces)."""
    text = start
    for event in events:
        if event.HasField("artifact_update"):
            update = event.artifact_update
            chunk = "".join(p.text for p in update.artifact.parts)
            text = text + chunk if update.append else chunk
    return text


def last_chunk(events: list[StreamResponse]) -> bool:
    updates = [e.artifact_update for e in events if e.HasField("artifact_update")]
    return bool(updates) and updates[-1].last_chunk and not any(u.last_chunk for u in updates[:-1])


def data_parts(msg: Message) -> list[dict[str, Any]]:
    return [json_format.MessageToDict(p.data) for p in msg.parts if p.WhichOneof("content") == "data"]


def task_answer(task: Task) -> str:
    return "".join(p.text for a in task.artifacts if a.artifact_id == "answer" for p in a.parts)


def context_id() -> str:
    return f"ctx-{secrets.token_hex(4)}"
