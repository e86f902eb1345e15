"""A stream's client cannot hurt the run: closing it does not cancel, a stalled one does not slow it.

A real uvicorn serves the app in a thread; clients read SSE through httpx.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    BUSES,
    Api,
    FakeLLM,
    GatedAgent,
    as_stored,
    clients_fixture,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.server import ServerThread

pytestmark = pytest.mark.timeout(30)


def largest_send_buffer() -> int:
    """The most a server socket may buffer for a peer that reads nothing (tcp_wmem max)."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 4 * 1024 * 1024


@BUSES
def test_closing_streams_at_any_point_never_cancels_the_run(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
) -> None:
    agent = gated_llm.play(GatedAgent(tokens=50, delay_s=0.002))
    api = clients(start_service(redis=redis_bus).base_url)
    conv = api.create_conversation()
    agent.close_gate()
    run_id = api.start_run(conv)

    with api.stream(conv) as stream:
        opening = stream.read(count=1)
    agent.gate.set()
    with api.stream(conv, last_event_id=opening[-1].id) as stream:
        stream.read(until=lambda e: e.event == "answer" and e.data.get("status") == "delta")
    with api.stream(conv) as stream:
        pass  # hung up before reading a byte

    run = api.wait_finished(run_id)
    assert run["status"] == "completed"
    assert run["answer"] == agent.answer
    stored = api.wait_stored(run_id)
    assert stored[-1]["data"]["status"] == "completed"


@BUSES
def test_a_client_that_reads_nothing_stalls_neither_the_run_nor_another_client(
    redis_bus: bool,
    start_service: Callable[..., ServerThread],
    gated_llm: FakeLLM,
    clients: Callable[..., Api],
) -> None:
    # An answer far larger than what the kernel buffers for a peer that does not read.
    token = "x" * 1999 + " "
    tokens = 2 * largest_send_buffer() // len(token) + 1
    agent = gated_llm.play(GatedAgent(tokens=[token] * tokens))
    server = start_service(redis=redis_bus)
    api = clients(server.base_url)
    slow = clients(server.base_url, receive_buffer=65536)
    conv = api.create_conversation()
    agent.close_gate()
    run_id = api.start_run(conv)

    with slow.stream(conv) as stalled:
        with api.stream(conv) as stream:
            agent.gate.set()
            live = stream.read()
        assert live[-1].event == "done"
        assert live[-1].data["answer"] == agent.answer
        run = api.wait_finished(run_id)
        assert run["status"] == "completed"
        stored = api.wait_stored(run_id)
        assert as_stored(live) == stored
        # Only now does the slow client read: it still gets everything, once, in order.
        assert as_stored(stalled.read()) == stored
