"""Who a worker is (``host:pid:token``), and whether a worker of this host is gone: its runs need
not wait for their leases to run out (RUNS.md R-03)."""

from __future__ import annotations

import os
import secrets
import socket


def local_host() -> str:
    """This host as worker ids name it: its name, its boot (two machines, or VMs, of the same
    name are two hosts) and its process id namespace (containers that share a host name, with
    network_mode host say, do not share their process ids; the root namespace has the same
    number on every machine, hence the boot)."""
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = "-"
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip().replace("-", "")[:12] or "-"
    except OSError:
        boot = "-"
    return f"{socket.gethostname()}/{boot}/{namespace}"


def new_worker_id() -> str:
    """``host:pid:token``: unique to this process, and telling a worker of the same host whether
    the process still lives (``local_process_gone``)."""
    return f"{local_host()}:{os.getpid()}:{secrets.token_hex(3)}"


def local_process_gone(worker_id: str) -> bool:
    """Whether ``worker_id`` (``host:pid:token``) names a process of this host that no longer
    exists: its runs need not wait for their leases. False whenever that cannot be told."""
    host, _, rest = worker_id.partition(":")
    pid_text = rest.partition(":")[0]
    if host != local_host() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False  # this very process (several apps may share one, as tests do)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return _zombie(pid)


def _zombie(pid: int) -> bool:
    """A process that died but that its parent has not reaped yet (Linux; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            # "pid (comm) state ...": comm may hold spaces and parentheses; the state follows the last ')'.
            return stat.read().rpartition(")")[2].split()[:1] == ["Z"]
    except OSError:
        return False
