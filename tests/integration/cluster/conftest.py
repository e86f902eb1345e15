"""Fixtures of the Redis Cluster tests (RUNS.md S-01): the shared cluster scripts/test.sh starts.

- ``cluster``: ``(url, prefix)``, the cluster and a key prefix private to the test (its keys are
  deleted afterwards, on every master).
- ``make_bus``: builds ``RedisClusterEventBus`` instances on it (each one a "worker"), closed after.
- ``raw``: a redis-py cluster client, to look at keys as Redis holds them.
- ``llm``: a started fake model of the module (``FakeLLM``), for the service tests.
- ``private_cluster``: a ``PrivateCluster`` of the module (one per module that asks), for tests
  that kill a master; stopped at the module's end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from app.streaming.redis_cluster_bus import RedisClusterEventBus
from tests.integration.service.workers_support import FakeLLM, fake_llm_serving
from tests.support.redis_cluster import PrivateCluster, cluster_prefix


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[str, str]]:
    async with cluster_prefix() as url_and_prefix:
        yield url_and_prefix


@pytest.fixture
async def make_bus(cluster: tuple[str, str]) -> AsyncIterator[Callable[..., RedisClusterEventBus]]:
    url, prefix = cluster
    made: list[RedisClusterEventBus] = []

    def make(**options: Any) -> RedisClusterEventBus:
        bus = RedisClusterEventBus(url, prefix, **options)
        made.append(bus)
        return bus

    try:
        yield make
    finally:
        for bus in made:
            await bus.close()


@pytest.fixture
async def raw(cluster: tuple[str, str]) -> AsyncIterator[RedisCluster]:
    client = await RedisCluster.from_url(cluster[0], decode_responses=True).initialize()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def private_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateCluster]:
    with PrivateCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with fake_llm_serving() as fake:
        yield fake
