"""Redis data of an earlier version: its cooldown and budget keys are folded into guard hashes at start."""
from __future__ import annotations

import time

from trainmedic.client.wire import keys
from trainmedic.service import upgrade

from tests.conftest import load_fixture, post_json

JOB = keys.Target("job", "llama-ft-01")


def test_an_earlier_cooldown_still_holds_after_the_upgrade(r, make_app) -> None:
    now_ms = int(time.time() * 1000)
    old_cooldown = f"{keys.PREFIX}{JOB.tag}:cooldown:loss-spike"
    r.set(old_cooldown, "01OLD", px=300_000)
    app = make_app()
    assert not r.exists(old_cooldown) and r.exists(upgrade.GUARDS_DONE)
    cool = int(r.hget(keys.guard(JOB, "loss-spike"), "cool"))
    assert now_ms + 290_000 < cool <= int(time.time() * 1000) + 300_000
    [rem] = post_json(app.test_client(), "/webhook", load_fixture("firing_single.json")).json["remediations"]
    assert (rem["status"], rem["reason"]) == ("skipped", "cooldown")


def test_an_earlier_budget_is_merged_with_runs_made_since_and_keeps_its_ttl(r) -> None:
    node = keys.Target("node", "gpu-node-01")
    now_ms = int(time.time() * 1000)
    old_budget = f"{keys.PREFIX}{node.tag}:budget:gpu-temperature-high"
    r.zadd(old_budget, {"01A": now_ms - 5000, "01B": now_ms - 4000})
    r.pexpire(old_budget, 86_400_000)
    guard = keys.guard(node, "gpu-temperature-high")
    r.hset(guard, "runs", str(now_ms - 1000))  # a run decided after the upgrade, before the fold
    r.pexpire(guard, 1000)
    assert upgrade.guards(r) == 1
    assert r.hget(guard, "runs").split() == [str(now_ms - 5000), str(now_ms - 4000), str(now_ms - 1000)]
    assert r.pttl(guard) > 86_000_000 and not r.exists(old_budget)
    r.zadd(old_budget, {"01C": now_ms})  # once done, later starts do not scan again
    assert upgrade.guards(r) == 0 and r.exists(old_budget)
