"""Whether a worker of this host is gone: its runs need not wait for their leases (RUNS.md R-03)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from app.runs.workers import local_host, local_process_gone, new_worker_id
from tests.support.server import wait_until


def worker_id(pid: int, host: str | None = None) -> str:
    return f"{host or local_host()}:{pid}:abc123"


def test_a_live_process_of_this_host_is_not_gone_and_one_of_another_host_cannot_be_told() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not local_process_gone(worker_id(child.pid))
        assert not local_process_gone(worker_id(child.pid, host="another-host"))
        # The same host name in another process id namespace (a container) cannot be told either.
        assert not local_process_gone(worker_id(child.pid, host=f"{socket.gethostname()}/1"))
        assert not local_process_gone(worker_id(os.getpid()))  # this very process
        assert not local_process_gone("not a worker id")
    finally:
        child.kill()
        child.wait()
    assert local_process_gone(worker_id(child.pid))


def test_a_dead_process_its_parent_has_not_reaped_yet_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # Not reaped (no wait()): a zombie, which kill(pid, 0) still finds.
        wait_until(lambda: local_process_gone(worker_id(child.pid)), timeout=10, what="the child to exit")
    finally:
        child.wait()


def test_a_worker_id_names_this_host_and_process() -> None:
    host, pid, token = new_worker_id().split(":")
    assert (host, pid) == (local_host(), str(os.getpid())) and len(token) == 6
    assert host.startswith(socket.gethostname() + "/")


def test_the_host_part_names_this_boot() -> None:
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        boot = f.read().strip().replace("-", "")[:12]
    name, host_boot, namespace = local_host().split("/")
    assert (name, host_boot) == (socket.gethostname(), boot) and len(boot) == 12
    assert namespace == str(os.stat("/proc/self/ns/pid").st_ino)


def test_a_worker_of_the_same_host_name_and_pid_namespace_but_another_boot_is_not_judged_gone() -> None:
    """Two machines (or VMs) of the same name both have the root pid namespace's number: a pid
    that does not exist here says nothing about a process there."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid exists no more on this host
    name, boot, namespace = local_host().split("/")
    other_boot = ("0" if boot[0] != "0" else "1") + boot[1:]
    assert local_process_gone(worker_id(child.pid))
    assert not local_process_gone(worker_id(child.pid, host=f"{name}/{other_boot}/{namespace}"))
