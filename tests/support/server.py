"""Run the real service for tests: in a thread (fast) or as a uvicorn subprocess (for kill -9).

Both serve over a real socket on 127.0.0.1, so SSE is tested through a real HTTP stream.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from app.main import create_app
from app.settings import Settings
from app.tls import client_tls
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CLIENT_TLS = client_tls()
"""The TLS context of the tests' httpx clients, which speak plain HTTP to services on loopback: the
service's own (app.tls). Without one, httpx builds a context for each client, loading the CA bundle
again (some 20 ms of CPU), about once a test in most integration tests."""


def wait_until(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # keep polling: the thing may not be up yet
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}: {last_exc!r}")


def wait_healthy(base_url: str, check: Callable[[], object] = lambda: None, timeout: float = 30.0) -> None:
    """Poll ``base_url``'s ``/healthz`` until it answers 200; ``check()`` raises if the server died.

    One client for every try, with ``CLIENT_TLS``: a new client per try, every 20 ms, each loading
    the CA bundle, would keep a core busy while the server starts.
    """
    with httpx.Client(timeout=1, verify=CLIENT_TLS) as http:

        def healthy() -> bool:
            check()
            return http.get(f"{base_url}/healthz").status_code == 200

        wait_until(healthy, timeout=timeout, what=f"service at {base_url}")


async def async_wait_until(
    predicate: Callable[[], Any], within: float = 10.0, interval: float = 0.02, what: str = ""
) -> Any:
    """``wait_until`` for async tests; ``predicate`` may return an awaitable."""
    timeout = within
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


class ServerThread:
    """The app under a real uvicorn server in a background thread."""

    def __init__(self, settings: Settings) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(settings)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ServerThread:
        # The app's start collects the whole heap (the lifespan in app/main.py), here the test
        # process's, every collected test module in it: some 150 ms of CPU per start. Frozen first
        # (as the app freezes its own, and unfreezes all when it stops), a collection walks only
        # what came since, as in a service's own process.
        gc.freeze()
        self._thread.start()
        wait_until(lambda: self.server.started, timeout=30, what="uvicorn thread start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)

    @property
    def services(self) -> Any:
        return self.app.state.services


class ServerProcess:
    """``uvicorn app.main:create_app --factory`` as a subprocess with the given environment."""

    def __init__(self, env: Mapping[str, str], port: int | None = None) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def start(self, log_path: Path) -> ServerProcess:
        self.log_path = log_path
        # The child keeps its own copy of the descriptor; closing ours avoids a ResourceWarning.
        with log_path.open("wb") as log_file:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "app.main:create_app",
                    "--factory",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "warning",
                ],
                cwd=ROOT,
                env=self.env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        wait_healthy(self.base_url, self._alive)
        return self

    def _alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"service exited early:\n{self.logs()}")

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def running(settings: Settings) -> Iterator[ServerThread]:
    server = ServerThread(settings).start()
    try:
        yield server
    finally:
        server.stop()
