"""A private ``redis-server`` for tests that stop and restart Redis.

The machine's shared Redis (``tests.support.services.REDIS_URL``) serves every other test and is
never stopped; a test that needs Redis to go away starts one of these on a free loopback port,
without persistence (``--save "" --appendonly no``), so a restart always comes back empty::

    with PrivateRedis(tmp_path) as redis:
        settings = Settings(redis_url=redis.url, ...)
        redis.stop()      # SIGKILL: connections drop, new ones are refused
        redis.start()     # same port, empty

``available()`` says whether the binary is installed.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path
from types import TracebackType

import redis

from tests.support.server import free_port, wait_until

BINARY = "redis-server"


def available() -> bool:
    return shutil.which(BINARY) is not None


class PrivateRedis:
    """One ``redis-server`` process on 127.0.0.1; ``stop()`` and ``start()`` it at will (same port)."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.starts = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> PrivateRedis:
        """Start (or start again) on ``port``, with an empty dataset; returns once it answers PING."""
        if self.running:
            raise RuntimeError("the private Redis is already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        # The child keeps its own copy of the descriptor; closing ours avoids a ResourceWarning.
        with (self.workdir / f"redis-{self.starts}.log").open("wb") as log:
            self._proc = subprocess.Popen(
                [
                    BINARY,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.workdir),
                    "--daemonize",
                    "no",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_until(self.ping, timeout=10, what=f"redis-server on port {self.port}")
        return self

    def ping(self) -> bool:
        if not self.running:
            raise AssertionError(f"redis-server exited:\n{self.logs()}")
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def stop(self) -> None:
        """Kill it (SIGKILL, like a crash): its clients' connections drop at once."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(
            path.read_text(errors="replace") for path in sorted(self.workdir.glob("redis-*.log"))
        )

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
