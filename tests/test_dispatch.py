"""Guard, record, then dispatch: the DECIDE script's episode logic and the history index."""
from __future__ import annotations

import copy
import time

from trainmedic.client.wire import keys
from trainmedic.service import history
from trainmedic.service.store import record as records
from trainmedic.service.rules.alerts import parse_group
from trainmedic.client.wire.signing import Signer
from trainmedic.service.decide.dispatch import DispatchSettings, Dispatcher, new_record_id
from trainmedic.service.decide.plan import plan
from trainmedic.service.decide.reconciler import Reconciler, ReconcilerSettings
from trainmedic.service.rules.playbooks import load

from tests.conftest import ROOT, SIGNING_KEY, load_fixture
from tests.support.jobs import entry_command
from tests.support.keyspaces import BOTH, oldest_first

JOB = keys.Target("job", "llama-ft-01")


def run(r, body: dict, **settings):
    dispatcher = Dispatcher(r, Signer.from_secret(SIGNING_KEY), DispatchSettings(**settings))
    return dispatcher.execute(plan(parse_group(body), load([ROOT / "playbooks"])))


@BOTH
def test_record_and_command_are_written_together(r) -> None:
    [o] = run(r, load_fixture("firing_single.json"))
    h = r.hgetall(keys.record(o.record_id))
    assert h["status"] == "dispatched" and h["sig"] and h["d"]
    [(_, fields)] = r.xrange(keys.mailbox(JOB))
    assert entry_command(r, JOB, fields)[0].record_id == o.record_id


@BOTH
def test_a_later_start_is_a_new_episode(r) -> None:
    body = load_fixture("firing_group.json")
    body["alerts"] = body["alerts"][:1]
    run(r, body)
    later = copy.deepcopy(body)
    later["alerts"][0]["startsAt"] = "2026-11-22T09:00:00Z"
    [o] = run(r, later)
    assert o.status == "skipped" and o.reason == "cooldown"  # decided anew, then guarded
    earlier_resend = copy.deepcopy(body)
    [dup] = run(r, earlier_resend)
    assert dup.status == "duplicate"


@BOTH
def test_a_resend_refreshes_the_episode_and_heals_the_index(r) -> None:
    body = load_fixture("firing_single.json")
    [first] = run(r, body)
    history.catch_up(r)
    r.zrem(keys.HISTORY, first.record_id)  # as if the index write was lost to a crash
    ep = keys.target_state(JOB)
    r.pexpire(ep, 1000)
    r.hdel(ep, "x")  # the mark of until when its TTL runs
    [dup] = run(r, body)
    assert dup.status == "duplicate" and dup.record_id == first.record_id
    history.catch_up(r)  # the duplicate journaled its record again: the next query lists it again
    assert r.zscore(keys.HISTORY, first.record_id) is not None
    assert r.pttl(ep) > 2 * 86400 * 1000


@BOTH
def test_decide_indexes_the_held_records_the_due_targets_and_the_journal_of_what_it_made(r) -> None:
    # One notification, two targets (two hash slots on a cluster): a job's loss spike goes out, a node's drain
    # is held for approval (4 h). The approvals and due-target indexes and the history list them at once.
    body = load_fixture("firing_single.json")
    xid = {**body["alerts"][0], "labels": {"alertname": "GPUXidError", "severity": "critical",
                                           "node": "gpu-node-01", "xid_class": "drain"}, "fingerprint": "x1d0"}
    body["alerts"].append(xid)
    before = time.time()
    sent, held = run(r, body)
    assert (sent.status, held.status) == ("dispatched", "pending_approval")
    assert r.zrange(keys.APPROVALS, 0, -1) == [held.record_id]
    deadline = float(r.zscore(keys.APPROVALS, held.record_id)) / 1000
    assert before + 4 * 3600 <= deadline <= time.time() + 4 * 3600
    due = dict(r.zrange(keys.DUE, 0, -1, withscores=True))
    assert set(due) == {JOB.label, "node:gpu-node-01"}
    assert all(before * 1000 < ms <= (time.time() + 4 * 3600) * 1000 for ms in due.values())
    assert r.zcard(keys.HISTORY) == 0 and history.catch_up(r) == 2
    assert set(r.zrange(keys.HISTORY, 0, -1)) == {sent.record_id, held.record_id}


@BOTH
def test_dry_run_records_what_would_run_and_dispatches_nothing(r) -> None:
    [o] = run(r, load_fixture("firing_single.json"), dry_run=True)
    assert o.status == "dry_run"
    rec = records.load(r, o.record_id)
    assert rec is not None and [a.status for a in rec.actions] == ["skipped", "skipped"]
    assert r.xlen(keys.mailbox(JOB)) == 0
    # No cooldown was consumed by the dry run.
    assert set(r.hgetall(keys.target_state(JOB))) == {"loss-spike|071ff15f8faead0f|open",
                                                      "loss-spike|071ff15f8faead0f|rid", "x"}


@BOTH
def test_a_resolved_alert_never_seen_firing_does_nothing(r) -> None:
    assert [o.status for o in run(r, load_fixture("resolved.json"))] == ["stale"]
    assert r.zcard(keys.HISTORY) == 0


@BOTH
def test_history_past_its_count_is_deleted_not_only_unlisted(r) -> None:
    body = load_fixture("firing_single.json")
    made = []
    for i in range(5):
        b = copy.deepcopy(body)
        b["alerts"][0]["fingerprint"] = f"{i:016x}"
        b["alerts"][0]["labels"]["job_name"] = f"j{i}"
        made += [o.record_id for o in run(r, b)]
    made = oldest_first(r, made)
    dispatcher = Dispatcher(r, Signer.from_secret(SIGNING_KEY), DispatchSettings())
    report = Reconciler(r, dispatcher, [], ReconcilerSettings(history_max=3)).tick()
    assert report.trimmed == 2
    assert r.zrange(keys.HISTORY, 0, -1) == made[2:]
    assert [bool(r.exists(keys.record(rid))) for rid in made] == [False, False, True, True, True]


def test_record_ids_sort_in_creation_order_and_name_their_target() -> None:
    ids = [new_record_id(JOB) for _ in range(1000)]
    assert ids == sorted(ids) and len(set(ids)) == 1000
    assert all(keys.target_of_record(i) == JOB for i in ids)


@BOTH
def test_a_redis_that_lost_its_scripts_still_decides_each_alert_once(r) -> None:
    run(r, load_fixture("firing_single.json"))
    r.script_flush()  # as after a Redis restart or a fresh cluster node
    group = load_fixture("firing_group.json")
    assert [o.status for o in run(r, group)] == ["dispatched", "dispatched"]
    assert r.xlen(keys.mailbox(keys.Target("node", "gpu-node-01"))) == 1
    history.catch_up(r)
    assert r.zcard(keys.HISTORY) == 3
