"""Pieces of the service tests on a Redis Cluster (RUNS.md S-01).

- ``start_on_cluster``: an in-thread server on a database and a cluster, under a key prefix.
- ``follow``: a client that follows a conversation's stream to its run's ``done`` as a browser's
  EventSource does, connecting again with its cursor after an error or an early end.
- ``in_order``: whether event ids rise strictly (so none came twice).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import httpx

from tests.integration.service.workers_support import Api, FakeLLM, service_settings
from tests.support.server import ServerThread
from tests.support.sse import SseEvent

RECONNECT_S = 0.2
"""A follower's pause before it connects again (an EventSource waits its ``retry``, 3 s by default)."""


def start_on_cluster(
    database_url: str, llm: FakeLLM, cluster_url: str, prefix: str, **overrides: Any
) -> ServerThread:
    """An in-thread server with ``REDIS_CLUSTER=true`` on ``cluster_url`` under ``prefix``."""
    settings = service_settings(
        database_url,
        llm.base_url,
        redis_url=cluster_url,
        redis_cluster=True,
        redis_key_prefix=prefix,
        **overrides,
    )
    return ServerThread(settings).start()


def follow(
    api: Api,
    conversation_id: str,
    *,
    within: float = 30.0,
    on_event: Callable[[SseEvent], object] | None = None,
) -> tuple[list[SseEvent], int]:
    """The events of the conversation's run up to its ``done``, and over how many connections.

    After a transport error, an error status or an end without ``done``, the follower connects
    again with the last event's id as ``Last-Event-ID``. ``on_event`` sees each event as it comes.
    """
    received: list[SseEvent] = []
    connections = 0
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        connections += 1
        try:
            with api.stream(conversation_id, last_event_id=received[-1].id if received else None) as stream:
                assert stream.status_code != 204, f"nothing more to stream, {len(received)} events in"
                if stream.status_code == 200:
                    while batch := stream.read(count=1):
                        received += batch
                        if on_event is not None:
                            on_event(batch[0])
                        if batch[0].event == "done":
                            return received, connections
        except httpx.TransportError:
            pass
        time.sleep(RECONNECT_S)
    raise AssertionError(f"no done within {within}s: {len(received)} events over {connections} connections")


def in_order(ids: list[str]) -> bool:
    """Whether the stream ids rise strictly."""
    keys = [tuple(int(part) for part in i.split("-")) for i in ids]
    return all(a < b for a, b in pairwise(keys))
