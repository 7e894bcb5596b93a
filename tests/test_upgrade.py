"""Redis data of an earlier version: its episode, cooldown and budget keys are folded into playbook states at
the first start, found from the records the history lists, so an upgrade neither decides an open episode again
nor forgets a guard."""
from __future__ import annotations

import time
from typing import Any

from trainmedic.client.wire import keys
from trainmedic.service import history, upgrade

from tests.conftest import load_fixture, post_json

JOB = keys.Target("job", "llama-ft-01")
NODE = keys.Target("node", "gpu-node-01")
FINGERPRINT = load_fixture("firing_single.json")["alerts"][0]["fingerprint"]


def as_an_earlier_version_left_it(r: Any, app: Any, body: dict) -> list[dict]:
    """Records made through the webhook, then their playbook states taken back out, as if an earlier version
    had written them (it kept episodes and guards in keys of their own), and the upgrade not yet run."""
    made = post_json(app.test_client(), "/webhook", body).json["remediations"]
    history.catch_up(r)
    for k in r.scan_iter(match="trainmedic:*:playbook:*"):
        r.delete(k)
    r.delete(keys.STATES_UPGRADED)
    return made


def test_an_open_episode_and_a_cooldown_of_an_earlier_version_still_hold_after_the_upgrade(r, make_app) -> None:
    app = make_app()
    as_an_earlier_version_left_it(r, app, load_fixture("firing_single.json"))
    now_ms = int(time.time() * 1000)
    old_episode = f"{keys.PREFIX}{JOB.tag}:episode:loss-spike:{FINGERPRINT}"
    r.hset(old_episode, mapping={"open": "2026-11-22T01:25:24Z", "rid": "01JOLDRECORD0000000000000A", "st": "x"})
    r.pexpire(old_episode, 86_400_000)
    old_cooldown = f"{keys.PREFIX}{JOB.tag}:cooldown:loss-spike"
    r.set(old_cooldown, "01OLD", px=300_000)
    assert upgrade.playbook_states(r) == 2
    assert not r.exists(old_cooldown) and not r.exists(old_episode) and r.exists(keys.STATES_UPGRADED)
    state = r.hgetall(keys.playbook_state(JOB, "loss-spike"))
    assert now_ms + 290_000 < int(state["cool"]) <= int(time.time() * 1000) + 300_000
    assert state[f"{FINGERPRINT}|open"] == "2026-11-22T01:25:24Z" and f"{FINGERPRINT}|st" not in state
    assert r.pttl(keys.playbook_state(JOB, "loss-spike")) > 86_000_000
    # The same alert again: the open episode's resend, not a new remediation.
    http = app.test_client()
    answer = post_json(http, "/webhook", load_fixture("firing_single.json")).json
    assert answer["remediations"] == [] and answer["duplicates"] == 1
    # Another alert of the playbook on the job: the cooldown of the earlier version holds it back.
    other = load_fixture("firing_single.json")
    other["alerts"][0]["fingerprint"] = "0123456789abcdef"
    [rem] = post_json(http, "/webhook", other).json["remediations"]
    assert (rem["status"], rem["reason"]) == ("skipped", "cooldown")


def test_an_earlier_budget_is_merged_with_runs_made_since_keeps_its_ttl_and_is_folded_once(r, make_app) -> None:
    body = load_fixture("firing_group.json")
    made = as_an_earlier_version_left_it(r, make_app(), body)
    assert {m["playbook"] for m in made} == {"gpu-temperature-high"}
    now_ms = int(time.time() * 1000)
    old_budget = f"{keys.PREFIX}{NODE.tag}:budget:gpu-temperature-high"
    r.zadd(old_budget, {"01A": now_ms - 5000, "01B": now_ms - 4000})
    r.pexpire(old_budget, 86_400_000)
    state = keys.playbook_state(NODE, "gpu-temperature-high")
    r.hset(state, "runs", str(now_ms - 1000))  # a run decided after the upgrade, before the fold
    r.pexpire(state, 1000)
    assert upgrade.playbook_states(r) == 1
    assert r.hget(state, "runs").split() == [str(now_ms - 5000), str(now_ms - 4000), str(now_ms - 1000)]
    assert r.pttl(state) > 86_000_000 and not r.exists(old_budget)
    r.zadd(old_budget, {"01C": now_ms})  # once done, later starts do not look again
    assert upgrade.playbook_states(r) == 0 and r.exists(old_budget)


def test_a_second_service_starting_meanwhile_waits_for_the_first_to_fold(r, monkeypatch) -> None:
    r.set(keys.STATES_UPGRADING, "another", px=60_000)
    monkeypatch.setattr(upgrade, "WAIT", 0.3)
    t0 = time.monotonic()
    assert upgrade.playbook_states(r) == 0 and time.monotonic() - t0 >= 0.3
    assert not r.exists(keys.STATES_UPGRADED)  # the first one says when it is done
