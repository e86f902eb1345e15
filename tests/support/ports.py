"""Loopback ports for the servers the tests start, private to this pytest-xdist worker.

``bind(("127.0.0.1", 0))`` would name a port that is free now, from the kernel's ephemeral range,
but the server binds it only later (a uvicorn subprocess: seconds later). Meanwhile another
worker's ``bind(0)``, or any process's outgoing connection, may take it, and the server fails to
start. So each worker hands out the ports of a block of its own below the ephemeral range
(32768-60999 on Linux), one after the other from a random place in the block, each checked free
when handed out: no other worker hands out the same one, nor does this one again until it has gone
round its block.

- ``free_port()``: one port.
- ``free_ports(count, plus=N)``: ``count`` consecutive ports, each free at ``port + N`` as well (a
  Redis Cluster node also listens on its port + 10000).
"""

from __future__ import annotations

import os
import random
import socket
import threading

FIRST_PORT = 10_000
BLOCK_SIZE = 1_000
BLOCKS = 10
"""Blocks cover 10000-19999; 10000 above them (a cluster's bus ports) is still below 32768."""


def _worker_index() -> int:
    """0 without xdist, 1 + N on worker ``gwN``."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class _Block:
    def __init__(self, index: int) -> None:
        self.first = FIRST_PORT + (index % BLOCKS) * BLOCK_SIZE
        # A random start: another test session on the machine (same worker name, same block)
        # most likely hands out other ports.
        self._next = random.randrange(BLOCK_SIZE)
        self._lock = threading.Lock()

    def take(self, count: int, plus: int | None) -> list[int]:
        with self._lock:
            for _ in range(BLOCK_SIZE):
                if self._next + count > BLOCK_SIZE:
                    self._next = 0
                ports = [self.first + self._next + i for i in range(count)]
                self._next += count
                if all(_is_free(p) and (plus is None or _is_free(p + plus)) for p in ports):
                    return ports
        raise RuntimeError(f"no {count} free ports left in {self.first}-{self.first + BLOCK_SIZE - 1}")


_block = _Block(_worker_index())


def free_port() -> int:
    """A loopback port nothing listens on, that no other test of this run is handed."""
    return _block.take(1, None)[0]


def free_ports(count: int, plus: int | None = None) -> list[int]:
    """``count`` consecutive free ports, also free ``plus`` above each if given."""
    return _block.take(count, plus)
