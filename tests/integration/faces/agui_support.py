"""What the AG-UI face's tests share: a caller of ``POST /api/ag-ui`` that reads a response as the
AG-UI client would (LF-framed ``data:`` lines) and checks every response with ``ag-ui-validate``
(no error, no warning: FACES.md G-05), the inputs they send, and a service on the fake model.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from ag_ui_validate.pytest_plugin import assert_valid_agui

from tests.integration.service.workers_support import FakeLLM, GatedAgent
from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.server import CLIENT_TLS, ServerThread, wait_until

KEYS = "alice:key-alice,bob:key-bob"
ALICE = "key-alice"
BOB = "key-bob"


@dataclass
class Response:
    """One response of ``POST /api/ag-ui``: its status, and its AG-UI events when it streamed."""

    status: int
    events: list[dict[str, Any]] = field(default_factory=list)
    body: bytes = b""

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        (found,) = self.of(kind)
        return found

    @property
    def kinds(self) -> list[str]:
        return [e["type"] for e in self.events]

    @property
    def last(self) -> dict[str, Any]:
        return self.events[-1]

    @property
    def snapshot(self) -> list[dict[str, Any]]:
        """The messages of the response's last ``MESSAGES_SNAPSHOT``."""
        messages: list[dict[str, Any]] = self.of("MESSAGES_SNAPSHOT")[-1]["messages"]
        return messages

    def custom(self, name: str) -> list[Any]:
        return [e["value"] for e in self.events if e["type"] == "CUSTOM" and e["name"] == name]

    @property
    def text(self) -> str:
        return "".join(e["delta"] for e in self.of("TEXT_MESSAGE_CONTENT"))


class AgUi:
    """One owner calling the face (and the own API, for what the tests compare with)."""

    def __init__(self, base_url: str, key: str) -> None:
        headers = {"Authorization": f"Bearer {key}"}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=10, verify=CLIENT_TLS)

    def close(self) -> None:
        self.http.close()

    def post(self, body: Any) -> Response:
        """Send ``body``; a 200 is read to its end, split as the AG-UI client splits it (on
        ``\\n\\n``, ``data:`` lines), and must pass ``ag-ui-validate`` with nothing to say."""
        with self.http.stream("POST", "/api/ag-ui", json=body, headers={"Accept": "text/event-stream"}) as r:
            raw = r.read()
            if r.status_code != 200:
                return Response(r.status_code, body=raw)
            assert r.headers["content-type"].startswith("text/event-stream")
        events = [
            json.loads(line[len("data: ") :])
            for frame in raw.decode().split("\n\n")
            for line in frame.split("\n")
            if line.startswith("data: ")
        ]
        assert b"\r" not in raw and b"[DONE]" not in raw
        assert_valid_agui(events, max_warnings=0)
        assert all(isinstance(e.get("timestamp"), int) for e in events)
        return Response(200, events, raw)

    def thread(self, thread: str) -> list[dict[str, Any]]:
        """The thread as the service has it: the snapshot of a request that brings nothing (a
        response that streamed a whole run may end without one: the client holds it already)."""
        now = self.post(run_input(thread, []))
        assert now.kinds == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"], now.kinds
        return now.snapshot

    def run(self, run_id: str) -> dict[str, Any]:
        response = self.http.get(f"/api/runs/{run_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def conversations(self) -> list[dict[str, Any]]:
        response = self.http.get("/api/conversations", params={"limit": 100})
        assert response.status_code == 200, response.text
        return list(response.json()["items"])

    def conversation(self, conversation_id: str) -> dict[str, Any]:
        response = self.http.get(f"/api/conversations/{conversation_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def only_conversation(self) -> dict[str, Any]:
        (conversation,) = self.conversations()
        return self.conversation(conversation["id"])

    def parked_run(self) -> dict[str, Any]:
        """The run of the caller's one conversation, once it is parked (a response ends at the
        run's ``waiting`` event, which comes a moment before its row says ``waiting``)."""
        run_id = self.only_conversation()["active_run_id"]
        assert run_id is not None, "no run of the thread is active"
        found: dict[str, Any] = wait_until(
            lambda: (r := self.run(run_id))["status"] == "waiting" and r, timeout=5, what="the run to park"
        )
        return found

    def active_conversation(self) -> dict[str, Any]:
        """The caller's one conversation, once a run of it is active."""
        found: dict[str, Any] = wait_until(
            lambda: (
                (c := self.conversations()) and (d := self.conversation(c[0]["id"]))["active_run_id"] and d
            ),
            timeout=5,
            what="a run of the thread to be active",
        )
        return found


def thread_id() -> str:
    return f"thread-{secrets.token_hex(4)}"


def user(text: str, message_id: str | None = None) -> dict[str, Any]:
    return {"id": message_id or f"u-{secrets.token_hex(4)}", "role": "user", "content": text}


def run_input(thread: str, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A ``RunAgentInput`` as ``@ag-ui/client`` 1.0 sends it."""
    body: dict[str, Any] = {
        "threadId": thread,
        "runId": f"client-run-{secrets.token_hex(4)}",
        "protocolVersion": "1.0",
        "state": {},
        "messages": messages,
        "tools": [],
        "context": [],
        "forwardedProps": {},
    }
    body.update(fields)
    return body


def play(llm: FakeLLM, behaviour: EchoAgentBehaviour) -> GatedAgent:
    llm.agent.inner = behaviour
    return llm.agent


def in_background(fn: Callable[[], Response]) -> Future[Response]:
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


@pytest.fixture(name="service")
def service_fixture(start_service: Callable[..., ServerThread]) -> ServerThread:
    return start_service(redis=False, api_keys=KEYS)


@pytest.fixture(name="alice")
def alice_fixture(service: ServerThread) -> Iterator[AgUi]:
    caller = AgUi(service.base_url, ALICE)
    yield caller
    caller.close()


@pytest.fixture(name="bob")
def bob_fixture(service: ServerThread) -> Iterator[AgUi]:
    caller = AgUi(service.base_url, BOB)
    yield caller
    caller.close()
