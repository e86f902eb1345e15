"""Redis Clusters for the tests (RUNS.md S-01).

- ``cluster_prefix()``: the shared cluster scripts/test.sh starts (``REDIS_CLUSTER_URL``) and a key
  prefix private to the test; every key under it is deleted afterwards, on every master.
  ``shared_cluster_prefix()`` is the same for sync code (fixtures of any scope).
- ``PrivateCluster``: three masters with a replica each on free loopback ports, for a test that
  kills a master (``kill_master_of(key)``) and must not break the shared one::

      with PrivateCluster(tmp_path) as cluster:
          bus = RedisClusterEventBus(cluster.url, prefix)
          cluster.kill_master_of(key)       # SIGKILL; its replica takes over
          cluster.wait_whole()              # every slot served again
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from types import TracebackType

import redis
from redis.cluster import RedisCluster

from tests.support.ports import free_ports
from tests.support.server import wait_until
from tests.support.services import REDIS_CLUSTER_URL, unavailable

NODE_TIMEOUT_MS = 2000
CLUSTER_BUS_OFFSET = 10_000


@asynccontextmanager
async def cluster_prefix() -> AsyncIterator[tuple[str, str]]:
    """``(url, prefix)``: the shared test cluster and a key prefix private to the test."""
    url, prefix = _shared_cluster_and_new_prefix()
    try:
        yield url, prefix
    finally:
        await asyncio.to_thread(delete_keys, url, prefix)


@contextmanager
def shared_cluster_prefix() -> Iterator[tuple[str, str]]:
    """``cluster_prefix()`` for sync code."""
    url, prefix = _shared_cluster_and_new_prefix()
    try:
        yield url, prefix
    finally:
        delete_keys(url, prefix)


def _shared_cluster_and_new_prefix() -> tuple[str, str]:
    if REDIS_CLUSTER_URL is None:
        unavailable("no Redis Cluster to test against (AGENTSTREAM_TEST_REDIS_CLUSTER)")
    return str(REDIS_CLUSTER_URL), f"agentstream-test:{random.getrandbits(48):012x}"


def delete_keys(url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` of the cluster at ``url``, on every master."""
    client = RedisCluster.from_url(url)
    try:
        for key in list(client.scan_iter(match=f"{prefix}:*", count=1000)):
            client.delete(key)
    finally:
        client.close()


class PrivateCluster:
    """Six ``redis-server`` processes (three masters, a replica each) on 127.0.0.1, stopped on exit."""

    def __init__(self, workdir: Path) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            unavailable("redis-server and redis-cli are needed for a private Redis Cluster")
        self.workdir = workdir
        self.ports = free_ports(6, plus=CLUSTER_BUS_OFFSET)  # and their cluster bus ports
        self.url = f"redis://127.0.0.1:{self.ports[0]}"
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self) -> PrivateCluster:
        for port in self.ports:
            self._start_node(port)
        for port in self.ports:
            wait_until(lambda p=port: self._answers(p), timeout=10, what=f"redis-server on {port}")
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        self.wait_whole()
        return self

    def _start_node(self, port: int) -> None:
        node_dir = self.workdir / f"node-{port}"
        node_dir.mkdir(parents=True, exist_ok=True)
        # The child keeps its own copy of the descriptor; closing ours avoids a ResourceWarning.
        with (node_dir / "redis.log").open("ab") as log:
            self._procs[port] = subprocess.Popen(
                [
                    "redis-server",
                    *("--port", str(port), "--bind", "127.0.0.1"),
                    *("--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf")),
                    *("--cluster-node-timeout", str(NODE_TIMEOUT_MS)),
                    *("--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1"),
                    *("--save", "", "--appendonly", "no", "--dir", str(node_dir)),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    @staticmethod
    def _answers(port: int) -> bool:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _info(self, port: int, section: str) -> dict[str, str]:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, decode_responses=True)
        try:
            if section == "cluster":
                text = str(client.execute_command("CLUSTER", "INFO"))
                return dict(line.split(":", 1) for line in text.split() if ":" in line)
            return {k: str(v) for k, v in client.info(section).items()}
        finally:
            client.close()

    def _whole(self) -> bool:
        """Every slot served, by masters every live node agrees on, and every replica in sync."""
        try:
            for port in self.live_ports:
                if self._info(port, "cluster").get("cluster_state") != "ok":
                    return False
                replication = self._info(port, "replication")
                if replication["role"] != "master" and replication.get("master_link_status") != "up":
                    return False
            return True
        except redis.RedisError:
            return False

    def wait_whole(self, timeout: float = 30.0) -> None:
        wait_until(self._whole, timeout=timeout, what="the private cluster to serve every slot")

    @property
    def live_ports(self) -> list[int]:
        return [port for port, proc in self._procs.items() if proc.poll() is None]

    def master_port_of(self, key: str) -> int:
        client = RedisCluster.from_url(f"redis://127.0.0.1:{self.live_ports[0]}")
        try:
            node = client.get_node_from_key(key)
            assert node is not None
            return int(node.port)
        finally:
            client.close()

    def kill_master_of(self, key: str) -> int:
        """SIGKILL the master serving ``key``'s slot (its replica takes over); returns its port."""
        port = self.master_port_of(key)
        proc = self._procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        return port

    def restart(self, port: int) -> None:
        """Start a killed node again: it rejoins from its nodes.conf (as a replica, once failed over)."""
        self._start_node(port)
        wait_until(lambda: self._answers(port), timeout=10, what=f"redis-server on {port} again")

    def stop(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
        self._procs.clear()

    def __enter__(self) -> PrivateCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
