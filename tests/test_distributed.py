"""Ranks in lockstep: 2 and 4 gloo ranks in subprocesses, commands through the real service and Redis."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from trainmedic.client.wire import keys
from trainmedic.service.embedded_redis import free_port
from tests.conftest import ROOT
from tests.support.jobs import job_app, trigger, wait_record, wait_until
from tests.support.ranks import rank_log, rank_results

JOB = "ddp-job"


class Ranks:
    """`world` rank processes of tests/rank_worker.py, killed if the test ends first."""

    def __init__(self, tmp: Path, world: int, redis_url: str, name: str, **cfg: Any):
        self.tmp, self.world, self.name = tmp, world, name
        port = free_port()
        self.procs = []
        for rank in range(world):
            conf = {"rank": rank, "world": world, "port": port, "redis_url": redis_url, "job": JOB,
                    "out": str(tmp / f"{name}-{rank}.json"), "max_steps": 3000, **cfg}
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
            log = open(tmp / f"{name}-{rank}.log", "wb")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "tests.rank_worker", json.dumps(conf)],
                                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()

    def wait(self, timeout: float = 120) -> list[dict]:
        return rank_results(self.procs, self.tmp, self.name, self.kill, timeout)

    def log(self, rank: int) -> str:
        return rank_log(self.tmp, self.name, rank)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def ranks(tmp_path: Path) -> Any:
    started: list[Ranks] = []

    def start(world: int, redis_url: str, name: str = "run", **cfg: Any) -> Ranks:
        rk = Ranks(tmp_path, world, redis_url, name, **cfg)
        started.append(rk)
        return rk
    yield start
    for rk in started:
        rk.kill()


def heartbeat_step(r: redis.Redis) -> int:
    raw = r.get(keys.heartbeat(keys.Target("job", JOB)))
    return (json.loads(raw).get("step") or -1) if raw else -1


def trainmedic_connections(r: redis.Redis) -> set[str]:
    return {c["name"] for c in r.client_list() if c.get("name", "").startswith("trainmedic-client:")}


def run_two_commands(r: redis.Redis, http: Any, rk: Ranks) -> tuple[list[dict], dict, dict, set[str]]:
    """Halve the LR, then send rollback (fails on the last rank) + halve, while watching who connects."""
    names: set[str] = set()

    def seen_step(n: int) -> bool:
        names.update(trainmedic_connections(r))
        return heartbeat_step(r) >= n

    def tick() -> None:
        names.update(trainmedic_connections(r))
        time.sleep(0.05)

    wait_until(lambda: seen_step(15), timeout=90, tick=tick, what="rank 0's heartbeat at step 15")
    halve = trigger(http, "halve-lr", JOB)
    wait_record(r, halve["id"], timeout=60, tick=tick)
    rollback = trigger(http, "rollback-then-halve", JOB)
    wait_record(r, rollback["id"], timeout=60, tick=tick)
    results = rk.wait()
    return results, wait_record(r, halve["id"]), wait_record(r, rollback["id"]), names


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_applies_each_command_at_the_same_step(world: int, r: redis.Redis, make_app: Any,
                                                         tmp_path: Path, redis_url: str, ranks: Any) -> None:
    http = job_app(make_app, tmp_path).test_client()
    rk = ranks(world, redis_url, min_steps=60, expect=2)
    results, halve, rollback, names = run_two_commands(r, http, rk)

    by_rank = [[(a["record_id"], a["action"], a["step"]) for a in res["applied"]] for res in results]
    assert all(b == by_rank[0] for b in by_rank), by_rank  # same commands, same actions, same steps
    assert [a for _, a, _ in by_rank[0]] == ["scale_lr", "rollback_checkpoint", "scale_lr"]
    for res in results:
        assert res["world"] == world
        assert res["n_violations"] == 0, res["violations"]  # the twin check on every rank
        assert res["factors"] == [0.25, 0.25]
        assert res["has_inbox"] == (res["rank"] == 0)

    # The acks count the ranks that really applied each action.
    act = halve["actions"][0]
    assert halve["status"] == "applied"
    assert act["result"]["ranks"] == world and act["result"]["ranks_applied"] == world
    assert act["result"]["step"] == by_rank[0][0][2]
    assert act["acked_by"].endswith(":0")
    assert len(act["result"]["old_lr"]) == 2 and len(act["result"]["new_lr"]) == 2
    roll, again = rollback["actions"]
    assert roll["status"] == "failed" and roll["result"]["ranks_applied"] == world - 1
    assert roll["result"]["rank_statuses"] == {"applied": world - 1, "failed": 1}
    assert again["status"] == "applied" and again["result"]["ranks_applied"] == world
    assert rollback["status"] == "partially_applied"

    # Rank 0 alone talks to Redis.
    rank0 = next(res for res in results if res["rank"] == 0)
    assert names and all(n == f"trainmedic-client:{rank0['identity']}" for n in names), names


def test_a_restarted_job_does_not_replay_applied_commands(r: redis.Redis, make_app: Any, tmp_path: Path,
                                                          redis_url: str, ranks: Any) -> None:
    http = job_app(make_app, tmp_path).test_client()
    ckpt = str(tmp_path / "ckpt.pt")
    first = ranks(2, redis_url, name="first", min_steps=30, expect=1, save=ckpt)
    wait_until(lambda: heartbeat_step(r) >= 10, timeout=90, what="the first run at step 10")
    halve = trigger(http, "halve-lr", JOB)
    before = first.wait()
    assert wait_record(r, halve["id"])["status"] == "applied"
    assert all(res["factors"] == [0.5, 0.5] for res in before)
    last = before[0]["last_step"]

    # Restarted from the checkpoint: the halving is kept (not redone), later commands still arrive.
    second = ranks(2, redis_url, name="second", resume=ckpt, min_steps=40, expect=1)
    wait_until(lambda: heartbeat_step(r) >= last + 20, timeout=90, what="the second run at 20 steps")
    quarter = trigger(http, "quarter-lr", JOB)
    after = second.wait()
    for res in after:
        assert [a["record_id"] for a in res["applied"]] == [quarter["id"]]
        assert res["factors"] == [0.125, 0.125]
        assert res["n_violations"] == 0, res["violations"]
    assert after[0]["applied"][0]["step"] == after[1]["applied"][0]["step"] > last
    assert wait_record(r, quarter["id"])["actions"][0]["result"]["ranks_applied"] == 2


def test_a_client_made_before_init_process_group_finds_its_rank_and_a_late_rank_gets_the_same_step(
        r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str, ranks: Any) -> None:
    http = job_app(make_app, tmp_path).test_client()
    waiting = trigger(http, "halve-lr", JOB)  # sent before any rank runs
    rk = ranks(2, redis_url, client_before_init=True, late_rank=1.5, min_steps=20, expect=1, sync_every=4)
    results = rk.wait()
    steps = [res["applied"][0]["step"] for res in results]
    assert steps[0] == steps[1] and steps[0] % 4 == 0  # the first sync point both ranks reached
    assert [res["has_inbox"] for res in results] == [True, False]
    assert all(res["n_violations"] == 0 and res["world"] == 2 for res in results)
    assert wait_record(r, waiting["id"])["actions"][0]["result"]["ranks_applied"] == 2
