"""Clients that read slowly or never: the run and the other clients go on, the server's memory stays bounded.

A stalled client here is a raw socket with a tiny receive buffer that sends its request and never
reads a byte. The answers are larger than everything the kernel buffers for such a peer, so the
server itself would have to hold the rest if it buffered per client. ``test_stream_clients.py``
(tests/integration/service) checks that a stalled client slows neither the run nor another
client and still gets every event; here: the server drops a stalled client once a send has
waited ``SEND_TIMEOUT_S``, and a worker streaming a long answer to 20 stalled clients grows by a
bounded amount of memory, about what it grows by for one client that reads.
"""

from __future__ import annotations

import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from app.api.routes import stream as stream_route
from tests.integration.reliability.conftest import FaultyModel, ServiceLog
from tests.integration.service.workers_support import (
    Api,
    SseEvent,
    as_stored,
    new_redis_prefix,
    redis_keys,
    worker_env,
)
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.server import ServerProcess, ServerThread, wait_until
from tests.support.services import REDIS_URL

STALLED_CLIENTS = 20
TOKEN = "x" * 1999 + " "
"""One answer delta: 2,000 characters."""


def largest_send_buffer() -> int:
    """The most a server socket may buffer for a peer that reads nothing (tcp_wmem max)."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 4 * 1024 * 1024


def long_answer(times: int = 2) -> list[str]:
    """An answer ``times`` the size of what the kernel buffers for one peer that does not read."""
    return [TOKEN] * (times * largest_send_buffer() // len(TOKEN) + 1)


class StalledClient:
    """Asks for a conversation's stream, then never reads (a 4 KiB receive buffer)."""

    def __init__(self, port: int, conversation_id: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(
            f"GET /api/conversations/{conversation_id}/stream HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{port}\r\nAccept: text/event-stream\r\n\r\n".encode()
        )

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def stalled_clients() -> Iterator[Callable[[int, str], StalledClient]]:
    made: list[StalledClient] = []

    def make(port: int, conversation_id: str) -> StalledClient:
        client = StalledClient(port, conversation_id)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def open_streams(base_url: str) -> int:
    """The server's ``agentstream_active_streams`` gauge."""
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    match = re.search(r"^agentstream_active_streams (\S+)$", text, re.MULTILINE)
    assert match is not None, "no agentstream_active_streams in /metrics"
    return int(float(match[1]))


def read_to_done(api: Api, conversation_id: str) -> list[SseEvent]:
    with api.stream(conversation_id) as stream:
        return stream.read()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("database_backend", ["sqlite"])
def test_a_client_that_never_reads_is_dropped_once_a_send_waits_past_the_send_timeout(
    monkeypatch: pytest.MonkeyPatch,
    start_faulty_service: Callable[..., ServerThread],
    faulty_llm: tuple[FakeOpenAIServer, FaultyModel],
    stalled_clients: Callable[[int, str], StalledClient],
    service_log: ServiceLog,
    figures: Callable[[str, str], None],
) -> None:
    send_timeout_s = 1.0
    monkeypatch.setattr(stream_route, "SEND_TIMEOUT_S", send_timeout_s)
    _, model = faulty_llm
    model.answer_with(long_answer())
    server = start_faulty_service()
    api = Api(server.base_url)
    try:
        conv = api.create_conversation()
        model.loop_gate.clear()
        run_id = api.start_run(conv, "a long answer")
        stalled_clients(server.port, conv)
        wait_until(lambda: open_streams(server.base_url) == 1, timeout=5, what="the stalled stream to open")

        model.loop_gate.set()
        received = read_to_done(api, conv)
        finished = time.monotonic()
        assert received[-1].data["status"] == "completed"
        assert received[-1].data["answer"] == model.answer
        assert as_stored(received) == api.wait_stored(run_id)

        # The stalled client still holds its connection open, yet the server lets go of it.
        wait_until(
            lambda: open_streams(server.base_url) == 0,
            timeout=send_timeout_s + 10,
            what="the server to drop the client that never reads",
        )
        dropped = time.monotonic() - finished
        assert service_log.problems() == [], service_log.text
        figures(
            "a client that never reads: dropped after the run's done", f"{dropped:.2f}s (send timeout 1s)"
        )
    finally:
        api.close()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def run_measuring_rss(
    worker: ServerProcess, api: Api, model: FaultyModel, conv: str, stalled: Callable[[], None]
) -> tuple[int, float]:
    """One long run read by one client (``stalled()`` opens others first).

    Returns the worker's peak RSS growth over the run and the run's duration.
    """
    assert worker.proc is not None
    pid = worker.proc.pid
    model.loop_gate.clear()
    run_id = api.start_run(conv, "a long answer, please")
    stalled()
    before = rss_bytes(pid)
    with ThreadPoolExecutor(max_workers=1) as pool:
        started = time.monotonic()
        reading = pool.submit(read_to_done, api, conv)
        model.loop_gate.set()
        peak = before
        while not reading.done():
            peak = max(peak, rss_bytes(pid))
            time.sleep(0.01)  # sampling interval of the measurement, not a synchronisation
        received = reading.result()
        took = time.monotonic() - started
    assert received[-1].event == "done"
    assert received[-1].data["status"] == "completed"
    assert received[-1].data["answer"] == model.answer
    assert as_stored(received) == api.wait_stored(run_id, timeout=30)
    return peak - before, took


@pytest.fixture
def worker_database(sqlite_migrated_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "worker.db"
    shutil.copyfile(sqlite_migrated_template, path)
    return f"sqlite+aiosqlite:///{path}"


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "redis_bus", [False, pytest.param(True, marks=pytest.mark.redis)], ids=["memory", "redis"]
)
def test_twenty_clients_that_never_read_a_long_run_cost_the_worker_bounded_memory(
    redis_bus: bool,
    worker_database: str,
    faulty_llm: tuple[FakeOpenAIServer, FaultyModel],
    stalled_clients: Callable[[int, str], StalledClient],
    tmp_path: Path,
    figures: Callable[[str, str], None],
) -> None:
    server, model = faulty_llm
    answer = long_answer(4)
    answer_bytes = len("".join(answer))
    bus_name = "redis" if redis_bus else "memory"
    with redis_keys(new_redis_prefix()) as prefix:
        bus = {"REDIS_URL": REDIS_URL, "REDIS_KEY_PREFIX": prefix} if redis_bus else {}
        worker = ServerProcess(worker_env(worker_database, server.base_url, **bus)).start(
            tmp_path / "worker.log"
        )
        assert worker.proc is not None
        api = Api(worker.base_url)
        opened: list[StalledClient] = []
        try:
            # Warm up with the same answer: the first long run also pays for imports and pools.
            model.answer_with(answer)
            api.wait_finished(api.start_run(api.create_conversation(), "warm up"), timeout=30)

            # Live: the same long run read by one client, then by one client while 20 never read.
            alone, alone_s = run_measuring_rss(worker, api, model, api.create_conversation(), lambda: None)
            conv = api.create_conversation()

            def open_stalled() -> None:
                opened.extend(stalled_clients(worker.port, conv) for _ in range(STALLED_CLIENTS))
                wait_until(
                    lambda: open_streams(worker.base_url) == STALLED_CLIENTS,
                    timeout=10,
                    what="the stalled streams to open",
                )

            crowded, crowded_s = run_measuring_rss(worker, api, model, conv, open_stalled)
            assert open_streams(worker.base_url) == STALLED_CLIENTS, "the stalled clients are still connected"
            # The run is not held up by them.
            # (A bound of sanity, not a speed measurement: beside the other test workers on two
            # cores a run's time varies threefold; a writer blocked by them would never finish.)
            assert crowded_s < 5 * alone_s + 10.0, (
                f"{crowded_s:.1f}s with stalled clients, {alone_s:.1f}s without"
            )
            # Holding for each of them what its socket did not take (the answer less what the
            # kernel buffers) would cost 20 x 12 MiB more; the run's own footprint (several times
            # the answer) varies by tens of MiB from run to run, so the bound is two thirds of that.
            unsent = answer_bytes - largest_send_buffer()
            assert crowded - alone < STALLED_CLIENTS * unsent * 2 / 3, (
                f"{(crowded - alone) / 2**20:.0f} MiB more with {STALLED_CLIENTS} clients that never read"
            )
            # Once they hang up, the worker lets go of their streams.
            for client in opened:
                client.close()
            wait_until(lambda: open_streams(worker.base_url) == 0, timeout=10, what="the streams to close")

            figures(
                f"slow clients ({bus_name} bus, {answer_bytes / 2**20:.0f} MiB answer): worker RSS growth",
                f"{alone / 2**20:.0f} MiB for 1 reader ({alone_s:.2f}s); {crowded / 2**20:.0f} MiB for 1"
                f" reader + {STALLED_CLIENTS} never reading ({crowded_s:.2f}s)",
            )
            assert "Traceback" not in worker.logs(), worker.logs()
        finally:
            for client in opened:
                client.close()
            api.close()
            worker.stop()
