"""Processes ``bench/capacity_bench.py`` starts besides the service: Redis of its own, and CPU bookkeeping.

* ``RedisNode``: one ``redis-server`` on a free loopback port, no persistence, a child of this
  process (stopped by its pid), so that the measured load does not share the machine's Redis with
  other work, and so that it can be pinned to a CPU with the load generator;
* ``RedisClusterNodes``: three masters with a replica each on loopback (ports from 7501 up, six free
  in a row with their bus ports), created with ``redis-cli --cluster create`` and waited for until
  every slot is served and every replica is in sync (as scripts/test.sh does), stopped by pid;
* ``pin``: a process and all its threads (and its descendants) onto some CPUs;
* ``CpuMeter``: CPU seconds of named process trees between two readings, as % of one core.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

from bench.service_stack import HOST, cpu_seconds


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return not _port_open(port)


def _cli(port: int, *args: str, timeout: float = 10) -> str:
    return subprocess.run(
        ["redis-cli", "-h", HOST, "-p", str(port), *args], capture_output=True, text=True, timeout=timeout
    ).stdout


def _wait_ping(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    for _ in range(100):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} on port {port} exited with {proc.returncode}")
        if _cli(port, "ping").strip() == "PONG":
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} on port {port} did not answer")


class _Servers:
    """redis-server children of this process, stopped by pid."""

    def __init__(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="agentstream-capacity-redis-")
        self.procs: list[subprocess.Popen[bytes]] = []

    def _spawn(self, port: int, *extra: str) -> subprocess.Popen[bytes]:
        workdir = Path(self.tmp.name) / str(port)
        workdir.mkdir()
        proc = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                HOST,
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--logfile",
                str(workdir / "redis.log"),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs.clear()
        self.tmp.cleanup()

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        raise NotImplementedError


class RedisNode(_Servers):
    """One redis-server of our own; ``url`` once started."""

    def __init__(self) -> None:
        super().__init__()
        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = int(s.getsockname()[1])
        self.url = f"redis://{HOST}:{self.port}/0"

    def start(self) -> None:
        _wait_ping(self.port, self._spawn(self.port), "redis-server")


class RedisClusterNodes(_Servers):
    """Three masters and three replicas on loopback; ``url`` names the first node."""

    def __init__(self, first_port: int = 7501) -> None:
        super().__init__()
        base = first_port
        while not all(_free(base + i) and _free(base + i + 10000) for i in range(6)):
            base += 10
            if base > first_port + 1000:
                raise RuntimeError("no six free ports in a row for a cluster")
        self.ports = [base + i for i in range(6)]
        self.url = f"redis://{HOST}:{base}"

    def start(self) -> None:
        for port in self.ports:
            conf = Path(self.tmp.name) / f"nodes-{port}.conf"
            self._spawn(
                port,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(conf),
                "--cluster-node-timeout",
                "2000",
                "--repl-diskless-sync-delay",
                "0",
                "--repl-ping-replica-period",
                "1",
            )
        for port, proc in zip(self.ports, self.procs, strict=True):
            _wait_ping(port, proc, "cluster node")
        created = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"{HOST}:{p}" for p in self.ports),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if created.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {created.stdout[-500:]}{created.stderr[-500:]}"
            )
        deadline = time.monotonic() + 30
        while not self._whole():
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not become whole in 30 s")
            time.sleep(0.1)

    def _whole(self) -> bool:
        """Every slot served, every replica linked and in sync."""
        if "cluster_state:ok" not in _cli(self.ports[0], "cluster", "info"):
            return False
        for port in self.ports:
            info = dict(
                line.split(":", 1) for line in _cli(port, "info", "replication").splitlines() if ":" in line
            )
            if info.get("role") == "master":
                continue
            if info.get("master_link_status") != "up" or int(info.get("slave_repl_offset", "0")) <= 0:
                return False
        return True


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` and of its descendants onto ``cpus`` (new threads inherit it)."""
    for p in descendants(pid):
        _pin_threads(p, cpus)


def _pin_threads(pid: int, cpus: set[int]) -> None:
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:
            pass


@contextmanager
def load_generator_on(cpus: set[int] | None) -> Iterator[None]:
    """This process's own threads onto ``cpus`` for the block (None: left where they are), then
    back on every CPU. Not its children: the processes under test are its children, and pinning
    its tree put them on its CPU too (every knee measured before 2026-12-06 afternoon ran the
    worker on the load generator's CPU, the other one idle)."""
    if cpus is not None:
        _pin_threads(os.getpid(), cpus)
    try:
        yield
    finally:
        _pin_threads(os.getpid(), set(range(os.cpu_count() or 1)))


def tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in descendants(pid):
        try:
            total += cpu_seconds(p)
        except OSError:
            pass
    return total


class CpuMeter:
    """CPU of named process trees (and of this process, ``client``) between ``start()`` and ``read()``."""

    def __init__(self, trees: dict[str, list[int]]) -> None:
        self.trees = trees
        self._t0 = 0.0
        self._cpu0: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        now = {name: sum(tree_cpu_seconds(p) for p in pids) for name, pids in self.trees.items()}
        now["client"] = time.process_time()
        return now

    def start(self) -> None:
        self._t0, self._cpu0 = time.perf_counter(), self._now()

    def read(self) -> dict[str, float]:
        """% of one core per name over the time since ``start()``."""
        elapsed = max(1e-6, time.perf_counter() - self._t0)
        now = self._now()
        return {f"{name}_cpu_pct": round(100 * (now[name] - self._cpu0[name]) / elapsed, 1) for name in now}
