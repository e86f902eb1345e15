"""Where the real Redis, Redis Cluster and PostgreSQL of the tests are (scripts/test.sh sets these;
loopback defaults for Redis and PostgreSQL)."""

from __future__ import annotations

import os

import pytest

REDIS_URL = os.environ.get("AGENTSTREAM_TEST_REDIS", "redis://127.0.0.1:6379/0")
REDIS_CLUSTER_URL = os.environ.get("AGENTSTREAM_TEST_REDIS_CLUSTER")
"""A node of the Redis Cluster on loopback that scripts/test.sh starts (three masters, a replica each)."""
POSTGRES_SERVER_URL = os.environ.get(
    "AGENTSTREAM_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432"
).rstrip("/")


def unavailable(what: str) -> None:
    """A real service the test needs is missing: skip locally, but fail under CI, where the test
    command is responsible for starting it (a silent skip there would hide a broken set-up)."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI must provide it: scripts/test.sh starts it)")
    pytest.skip(what)
