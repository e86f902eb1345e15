"""The Redis Cluster the tests run against (RUNS.md S-01): scripts/test.sh starts three masters
with a replica each on loopback when none is given (``AGENTSTREAM_TEST_REDIS_CLUSTER``), and stops
them after. These tests check that what the cluster tests will stand on is there and whole."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from redis.cluster import RedisCluster

from tests.support.services import REDIS_CLUSTER_URL, unavailable


@pytest.fixture
def cluster() -> Iterator[RedisCluster]:
    if REDIS_CLUSTER_URL is None:
        unavailable("no Redis Cluster to test against (AGENTSTREAM_TEST_REDIS_CLUSTER)")
    client = RedisCluster.from_url(str(REDIS_CLUSTER_URL))
    try:
        yield client
    finally:
        client.close()


def test_three_masters_with_a_replica_each_serve_every_slot(cluster: RedisCluster) -> None:
    info = cluster.cluster_info(target_nodes=RedisCluster.RANDOM)

    assert (info["cluster_state"], int(info["cluster_slots_ok"])) == ("ok", 16384)
    assert len(cluster.get_primaries()) == 3
    assert len(cluster.get_replicas()) == 3
    assert {node.host for node in cluster.get_nodes()} == {"127.0.0.1"}  # loopback only


def test_keys_reach_every_master_and_a_hash_tag_keeps_a_conversations_keys_on_one(
    cluster: RedisCluster,
) -> None:
    prefix = f"agentstream-test:harness-{secrets.token_hex(4)}"
    conversations = [f"conv_{i}" for i in range(24)]
    keys = [f"{prefix}:{kind}:{{{conv}}}" for conv in conversations for kind in ("events", "followups")]
    try:
        for key in keys:
            cluster.set(key, key, ex=60)

        assert [cluster.get(key) for key in keys] == [key.encode() for key in keys]
        masters = {cluster.get_node_from_key(f"{prefix}:events:{{{conv}}}").name for conv in conversations}
        assert len(masters) == 3, "24 conversations all on fewer than three masters"
        for conv in conversations:
            slots = {cluster.keyslot(f"{prefix}:{kind}:{{{conv}}}") for kind in ("events", "followups")}
            assert len(slots) == 1
    finally:
        for key in keys:
            cluster.delete(key)
