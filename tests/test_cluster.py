"""client/wire/cluster.py, where a single Redis and Redis Cluster differ, on each of them (real servers): reading
many keys, commands for every node (a target's user), and grouping script calls by hash slot."""
from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from trainmedic.client.wire import cluster, keys
from trainmedic.client.wire.protocol import signals_line
from trainmedic.client.wire.redis import connect
from trainmedic.service import credentials, signals

from tests.support.keyspaces import BOTH


@BOTH
def test_mget_reads_keys_of_every_slot_in_order_past_one_chunk(r: Any) -> None:
    jobs = [keys.Target("job", f"mget-{i}") for i in range(cluster.MGET_CHUNK + 7)]
    pipe = r.pipeline(transaction=False)
    for i, t in enumerate(jobs[::2]):
        pipe.set(keys.signals(t), signals_line({"step": i, "loss": 0.5}))
    pipe.execute()
    got = cluster.mget(r, [keys.signals(t) for t in jobs])
    assert got == [signals_line({"step": i // 2, "loss": 0.5}) if i % 2 == 0 else None for i in range(len(jobs))]
    # The training signals GET /metrics shows read them so: every job that has a line, in order.
    assert [(t, v[0], v[2]) for t, v in signals.read(r, jobs)] == [(t, i, 0.5) for i, t in enumerate(jobs[::2])]


@BOTH
def test_a_targets_user_is_made_and_rotated_on_every_node(r: Any, redis_url: str, keyspace: str) -> None:
    t = keys.Target("job", "every-node")
    ports = sorted(n.port for n in r.get_nodes()) if keyspace == "cluster" else [urlsplit(redis_url).port]
    assert len(ports) == (3 if keyspace == "cluster" else 1)
    assert sorted(int(a["port"]) for a in cluster.on_every_node(r, "CONFIG", "GET", "port")) == ports

    def password(c: credentials.Credentials) -> str:
        return str(urlsplit(c.redis_url).password)

    def authenticates(port: int, pw: str) -> bool:
        # No retries: redis-py would retry a refused AUTH for seconds.
        with redis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0)) as node:
            try:
                return bool(node.execute_command("AUTH", credentials.user_name(t), pw))
            except redis.AuthenticationError:
                return False

    old = credentials.issue(r, redis_url, t)
    assert all(authenticates(p, password(old)) for p in ports)
    new = credentials.issue(r, redis_url, t)  # rotated: the old password stops working on every node
    assert [authenticates(p, password(new)) for p in ports] == [True] * len(ports)
    assert [authenticates(p, password(old)) for p in ports] == [False] * len(ports)
    cluster.on_every_node(r, "ACL", "DELUSER", credentials.user_name(t))
    assert not any(authenticates(p, password(new)) for p in ports)


@BOTH
def test_script_calls_are_grouped_by_hash_slot_on_a_cluster_and_kept_whole_on_a_single_redis(
        r: Any, keyspace: str) -> None:
    tags = [keys.Target("job", f"slot-{i}").tag for i in range(64)]
    groups = cluster.by_slot(r, tags, str)
    assert sorted(i for g in groups for i in g) == list(range(64))
    assert all(g == sorted(g) for g in groups)  # each group keeps the items' order
    if keyspace == "single":
        assert groups == [list(range(64))] and cluster.scripts_reach_all(r)
    else:
        slots = [{key_slot(tags[i].encode()) for i in g} for g in groups]
        assert all(len(s) == 1 for s in slots) and len({s.pop() for s in slots}) == len(groups) > 1
        assert not cluster.scripts_reach_all(r)
    assert cluster.by_slot(r, [], str) == []


def test_an_unreachable_redis_gives_the_plain_client_to_retry_with() -> None:
    c = connect("redis://127.0.0.1:1/0", timeout=0.2)
    assert isinstance(c, redis.Redis) and not cluster.is_cluster(c)
