"""A keyspace version 3 made with its own code (tests/fixtures/v3_keyspace.json) brought to today's layout at the
first start: no open episode, guard, record or held approval is lost, and every record reads as it did."""
from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest

from trainmedic.client.trainer.state import STATE_VERSION
from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import parse_rfc3339, rfc3339
from trainmedic.client.wire.signing import Signer
from trainmedic.service import upgrade

from tests.conftest import SIGNING_KEY, VERIFY_KEY, post_json, write_playbooks
from tests.support import v3_keyspace
from tests.support.jobs import wait_record, wait_until
from tests.support.loop import Loop
from tests.support.v3_keyspace import V3Keyspace

SIGNER = Signer.from_secret(SIGNING_KEY)


@pytest.fixture
def v3(r: Any) -> V3Keyspace:
    """The keyspace version 3 left, in the test's Redis, not yet upgraded."""
    return v3_keyspace.load(r)


@pytest.fixture
def start(v3: V3Keyspace, make_app: Any, tmp_path: Path) -> Any:
    """Factory: today's service on the fixture's playbooks (its start runs the upgrade)."""
    return lambda: make_app(playbooks=str(write_playbooks(tmp_path / "v3.yaml", v3.playbooks)))


def everything(r: Any) -> dict[str, Any]:
    """Every key's type and value (the upgrade's whole effect)."""
    out: dict[str, Any] = {}
    for key in sorted(r.scan_iter(count=1000)):
        kind = r.type(key)
        out[key] = (kind, r.hgetall(key) if kind == "hash" else r.zrange(key, 0, -1, withscores=True)
                    if kind == "zset" else r.dump(key))
    return out


def fire(http: Any, alert: dict, fingerprint: str | None = None) -> dict:
    """The webhook's answer to a notification (of another alert of the same name when given a fingerprint)."""
    body = copy.deepcopy(alert)
    if fingerprint is not None:
        body["alerts"][0]["fingerprint"] = fingerprint
    resp = post_json(http, "/webhook", body)
    assert resp.status_code == 200, resp.get_json()
    return dict(resp.get_json())


def moved(text: str, shift_ms: int) -> str:
    """An RFC 3339 time version 3 showed, moved forward as the fixture's deadlines were (to the millisecond)."""
    seconds = parse_rfc3339(text)
    assert seconds is not None, text
    return rfc3339((round(seconds * 1000) + shift_ms) / 1000)


def as_v3_showed(view: dict[str, Any], v3: V3Keyspace) -> dict[str, Any]:
    """A record as version 3's API showed it, with the deadlines the fixture moved moved the same way."""
    view = dict(view)
    for name in ("approval_expires_at", "expires_at"):
        if view.get(name):
            view[name] = moved(view[name], v3.shift_ms)
    return view


def test_after_the_upgrade_open_episodes_are_duplicates_and_the_cooldown_and_the_budget_still_hold(
        r: Any, v3: V3Keyspace, start: Any) -> None:
    http = start().test_client()
    assert r.exists(upgrade.UPGRADED)
    for name in ("followed", "dispatched", "held"):  # each still firing, its record open
        answer = fire(http, v3.alerts[name])
        assert answer["remediations"] == [] and answer["duplicates"] == 1, (name, answer)
    # Another alert of the playbook that ran on llama-a an hour's cooldown ago.
    [cooled] = fire(http, v3.alerts["applied"], "a1a1a1a1a1a1a1ff")["remediations"]
    assert (cooled["status"], cooled["reason"]) == ("skipped", "cooldown")
    # Two runs a day: version 3 spent one, so one more runs and the next is refused.
    [second] = fire(http, v3.alerts["dispatched"], "b1b1b1b1b1b1b1f1")["remediations"]
    [third] = fire(http, v3.alerts["dispatched"], "b1b1b1b1b1b1b1f2")["remediations"]
    assert second["status"] == "dispatched"
    assert (third["status"], third["reason"]) == ("skipped", "budget_exhausted")


def test_the_upgrade_folds_each_playbook_state_into_its_targets_keeping_runs_made_since_and_the_longer_ttl(
        r: Any, v3: V3Keyspace) -> None:
    idle, trained = v3.target("dispatched"), v3.target("applied")
    old_idle = [keys.playbook_state(idle, pb) for pb in ("budgeted", "ask-first")]
    old_trained = [keys.playbook_state(trained, pb) for pb in ("halve-lr", "quarter-lr")]
    before = {key: (r.hgetall(key), r.pttl(key)) for key in old_idle + old_trained}
    assert all(fields for fields, _ in before.values())
    # A run decided by today's code before the fold, in a state that would expire sooner than the old one.
    now_ms = int(time.time() * 1000)
    r.hset(keys.target_state(idle), "budgeted|runs", str(now_ms + 1))
    r.pexpire(keys.target_state(idle), 1000)
    assert upgrade.run(r, SIGNER) > 0
    assert not any(r.exists(key) for key in old_idle + old_trained)
    idle_state, trained_state = r.hgetall(keys.target_state(idle)), r.hgetall(keys.target_state(trained))
    [spent] = before[keys.playbook_state(idle, "budgeted")][0]["runs"].split()
    assert idle_state["budgeted|runs"].split() == [spent, str(now_ms + 1)]
    assert trained_state["halve-lr|cool"] == before[keys.playbook_state(trained, "halve-lr")][0]["cool"]
    for key in old_idle + old_trained:  # each field under its playbook's name
        state = idle_state if key in old_idle else trained_state
        playbook = key.rsplit(":", 1)[1]
        for name, value in before[key][0].items():
            if name not in ("cool", "runs"):
                assert state[f"{playbook}|{name}"] == value
    # The longer TTL of the old hashes and the state is kept (less the time since they were read).
    longest = max(ttl for key, (_, ttl) in before.items() if key in old_idle)
    assert longest - 5000 < r.pttl(keys.target_state(idle)) <= longest
    # Done once: a second run changes nothing.
    after = everything(r)
    assert upgrade.run(r, SIGNER) == 0 and everything(r) == after


def test_a_second_service_starting_while_the_first_upgrades_waits_for_it_and_changes_nothing(
        r: Any, v3: V3Keyspace, monkeypatch: pytest.MonkeyPatch) -> None:
    r.set(upgrade.UPGRADING, "another service", px=60_000)
    monkeypatch.setattr(upgrade, "WAIT", 0.3)
    before = everything(r)
    t0 = time.monotonic()
    assert upgrade.run(r, SIGNER) == 0 and time.monotonic() - t0 >= 0.3
    assert everything(r) == before and not r.exists(upgrade.UPGRADED)  # the first one says when it is done


def test_history_and_each_record_show_every_version_3_record_as_version_3_did(v3: V3Keyspace, start: Any) -> None:
    http = start().test_client()
    items = http.get("/history?limit=100").get_json()["items"]
    assert [i["id"] for i in items] == [i["id"] for i in v3.history]
    assert [as_v3_showed(i, v3) for i in v3.history] == items
    for rid, shown in v3.remediations.items():
        got = http.get(f"/remediations/{rid}")
        assert got.status_code == 200 and got.get_json() == as_v3_showed(shown, v3), rid
    # Version 3's history index still answers its filters.
    held = http.get("/history?status=pending_approval").get_json()["items"]
    assert [i["id"] for i in held] == [v3.records["held"]]
    effective = http.get("/history?outcome=effective&playbook=halve-lr").get_json()["items"]
    assert [i["id"] for i in effective] == [v3.records["applied"]]


def test_a_held_version_3_record_is_approved_and_its_command_applied_by_a_training_process_of_today(
        r: Any, redis_url: str, v3: V3Keyspace, start: Any) -> None:
    http = start().test_client()
    rid = v3.records["held"]
    approved = post_json(http, f"/remediations/{rid}/approve", {"comment": "after the upgrade"})
    assert approved.status_code == 200, approved.get_json()
    assert approved.get_json()["status"] == "dispatched" and approved.get_json()["approved_by"] == "operator"
    assert r.zscore(keys.APPROVALS, rid) is None
    loop = Loop(redis_url, v3.target("held").name, verify_key=VERIFY_KEY)
    try:
        rec = wait_record(r, rid, tick=loop.tick)
        dispatched = wait_record(r, v3.records["dispatched"], tick=loop.tick)
    finally:
        loop.rc.close()
    assert rec["status"] == "applied" and rec["actions"][0]["result"]["factors"] == [0.5]
    assert dispatched["status"] == "applied"
    assert loop.lr == pytest.approx(0.025)  # both halvings, each once


def test_a_dispatched_version_3_command_is_applied_by_a_training_process_of_today(
        r: Any, redis_url: str, v3: V3Keyspace, start: Any) -> None:
    http = start().test_client()
    rid = v3.records["dispatched"]
    loop = Loop(redis_url, v3.target("dispatched").name, verify_key=VERIFY_KEY)
    try:
        rec = wait_record(r, rid, tick=loop.tick)
    finally:
        loop.rc.close()
    assert rec["status"] == "applied" and rec["actions"][0]["acked_by"]
    assert rec["actions"][0]["result"]["old_lr"] == [0.1] and rec["actions"][0]["result"]["new_lr"] == [0.05]
    assert loop.lr == pytest.approx(0.05)
    # Its alert still fires: the record is followed for its outcome, as version 3 would have.
    assert http.get(f"/remediations/{rid}").get_json()["outcome"]["status"] == "pending"


def test_a_held_version_3_record_changed_in_redis_is_not_rewritten_and_ends_tampered_when_approved(
        r: Any, v3: V3Keyspace, start: Any) -> None:
    rid = v3.records["held"]
    alert = r.hget(keys.record(rid), "alert")
    r.hset(keys.record(rid), "alert", alert.replace("llama-idle", "llama-other"))
    http = start().test_client()
    assert r.hget(keys.record(rid), "d") is None and r.hget(keys.record(rid), "playbook") == "ask-first"
    waiting = r.xlen(keys.mailbox(v3.target("held")))
    answer = post_json(http, f"/remediations/{rid}/approve", {})
    rec = http.get(f"/remediations/{rid}").get_json()
    assert (rec["status"], rec["reason"]) == ("skipped", "tampered"), (answer.status_code, answer.get_json())
    assert r.xlen(keys.mailbox(v3.target("held"))) == waiting  # nothing went out
    assert int(r.get(keys.TAMPERED) or 0) == 1


def test_the_approvals_index_is_in_milliseconds_after_the_upgrade(r: Any, v3: V3Keyspace) -> None:
    rid = v3.records["held"]
    seconds = r.zscore(keys.APPROVALS, rid)
    assert seconds < 1e11
    upgrade.run(r, SIGNER)
    ms = r.zscore(keys.APPROVALS, rid)
    assert abs(ms - seconds * 1000) < 1 and ms == int(r.hget(keys.record(rid), "ab"))


def test_a_followed_version_3_record_is_effective_when_its_alert_resolves(
        r: Any, v3: V3Keyspace, start: Any) -> None:
    app = start()
    http = app.test_client()
    rid = v3.records["followed"]
    resolved = copy.deepcopy(v3.alerts["followed"])
    ends = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
    resolved["status"] = resolved["alerts"][0]["status"] = "resolved"
    resolved["alerts"][0]["endsAt"] = ends
    fire(http, resolved)
    app.extensions["trainmedic"].reconciler.tick()
    rec = http.get(f"/remediations/{rid}").get_json()
    assert rec["status"] == "applied" and rec["outcome"]["status"] == "effective"
    assert rec["outcome"]["resolved_at"] == ends
    assert [i["id"] for i in http.get("/history?outcome=effective&playbook=quarter-lr").get_json()["items"]] == [rid]


def test_a_training_process_resuming_from_before_version_3s_changes_applies_them_again(
        r: Any, redis_url: str, v3: V3Keyspace, start: Any) -> None:
    start()
    loop = Loop(redis_url, v3.target("applied").name, verify_key=VERIFY_KEY)
    try:
        loop.rc.load_state_dict({"version": STATE_VERSION, "commands": []})  # a checkpoint from before them
        wait_until(lambda: loop.lr == pytest.approx(0.1 * 0.5 * 0.25), tick=loop.tick, what="the ledger's changes")
        loop.run_for(0.5)
    finally:
        loop.rc.close()
    assert loop.lr == pytest.approx(0.0125)  # each once


def test_a_version_3_command_that_expired_long_ago_is_answered_expired_and_never_applied(
        r: Any, redis_url: str, v3: V3Keyspace, start: Any) -> None:
    """Its record's deadline moved with the fixture, but the command's own expiry is signed inside it."""
    app = start()
    rid = v3.records["short"]
    loop = Loop(redis_url, v3.target("short").name, verify_key=VERIFY_KEY)
    try:
        rec = wait_record(r, rid, tick=loop.tick)
        wait_record(r, v3.records["dispatched"], tick=loop.tick)  # the mailbox's next command is applied
    finally:
        loop.rc.close()
    assert (rec["status"], rec["actions"][0]["status"]) == ("expired", "expired"), rec
    assert loop.lr == pytest.approx(0.05)  # only the valid command's halving
    app.extensions["trainmedic"].reconciler.tick()
    assert app.test_client().get(f"/remediations/{rid}").get_json()["status"] == "expired"
