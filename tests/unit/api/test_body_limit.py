"""``BodySizeLimit`` counts a body whose size no header declares, and only such a body."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from app.api.limits import BodySizeLimit


async def call(http_version: str, headers: list[tuple[bytes, bytes]], body: bytes) -> list[Message]:
    """Run an app that reads the whole body and answers 200, behind a limit of 10 bytes."""
    sent: list[Message] = []
    messages = [
        {"type": "http.request", "body": body[i : i + 4], "more_body": i + 4 < len(body)}
        for i in range(0, max(len(body), 1), 4)
    ]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: dict[str, Any] = {"type": "http", "http_version": http_version, "headers": headers}
    await BodySizeLimit(app, max_bytes=10)(scope, receive, send)
    return sent


@pytest.mark.parametrize(
    ("http_version", "headers"),
    [("2", []), ("1.1", [(b"transfer-encoding", b"chunked")])],
    ids=["http2-undeclared", "http1-chunked"],
)
async def test_an_undeclared_body_over_the_limit_is_413(
    http_version: str, headers: list[tuple[bytes, bytes]]
) -> None:
    sent = await call(http_version, headers, b"x" * 20)

    assert sent[0]["status"] == 413
    assert len(sent) == 2  # the 413 and its body; the app's own answer is dropped


async def test_a_declared_body_over_the_limit_is_413_before_it_is_read() -> None:
    sent = await call("1.1", [(b"content-length", b"20")], b"x" * 20)

    assert sent[0]["status"] == 413


@pytest.mark.parametrize(
    ("http_version", "headers", "body"),
    [
        ("1.1", [], b""),
        ("1.1", [(b"content-length", b"8")], b"x" * 8),
        ("2", [(b"content-length", b"8")], b"x" * 8),
    ],
    ids=["http1-no-body", "http1-declared", "http2-declared"],
)
async def test_a_body_within_the_limit_reaches_the_app(
    http_version: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    sent = await call(http_version, headers, body)

    assert sent[0]["status"] == 200
