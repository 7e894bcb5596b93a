"""Tests that run on a single Redis and on a Redis Cluster alike: `@BOTH` gives a test the two keyspaces in turn
through conftest's `keyspace` fixture, and with it `redis_url`, `r` and the apps made on them."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from trainmedic.client.wire import keys
from trainmedic.service import history

from tests.support.redis_cluster import EmbeddedCluster

KEYSPACES = ("single", "cluster")
BOTH = pytest.mark.parametrize("keyspace", KEYSPACES, indirect=True)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    """A real 3-master Redis Cluster, started for the first test that asks for one, shared by the session."""
    c = EmbeddedCluster(tmp_path_factory.mktemp("keyspace-cluster")).start()
    yield c
    c.stop()


def oldest_first(r: Any, ids: list[str]) -> list[str]:
    """The records' ids oldest first as the history numbers them: the order they were made in on a single Redis;
    on a cluster, records made between two folds are numbered in the order their targets' journals were moved
    (cluster.fold_batch), so their own sequence numbers say."""
    if not isinstance(r, redis.RedisCluster):
        return list(ids)
    history.catch_up(r)
    seqs = {rid: r.zscore(keys.HISTORY, rid) for rid in ids}
    assert None not in seqs.values(), "a record is not listed"
    return sorted(ids, key=lambda rid: float(seqs[rid] or 0))
