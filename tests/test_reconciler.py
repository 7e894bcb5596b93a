"""The reconciler: every dispatched action reaches a terminal status by expire_after + 30 s (README: Guardrails)."""
from __future__ import annotations

import json
import threading
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.client.wire.protocol import Ack, dumps

from tests.support.jobs import send, service, wait_until

JOB = "llama-ft-01"
TARGET = keys.Target("job", JOB)


def reconciler(r: Any) -> Any:
    return service(r).extensions["trainmedic"].reconciler


def ended(r: Any, status: str) -> float:
    """trainmedic_records_ended_total{status} as GET /metrics shows it."""
    text = service(r).test_client().get("/metrics").get_data(as_text=True)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "trainmedic_records_ended_total" and s.labels == {"status": status}:
                return float(s.value)
    return 0.0


def beat(r: Any, host: str, pid: int) -> None:
    """The first heartbeat of a process host:pid of the job (a process starting), as the service hears it: the
    job is due now (the service's listener makes it so)."""
    service(r)  # its listener hears the announcement
    r.zadd(keys.DUE, {TARGET.label: int((time.time() + 3600) * 1000)})  # not due now until heard
    Mailbox(r, TARGET).heartbeat({"kind": "job", "name": JOB, "host": host, "pid": pid}, announce=True)
    wait_until(lambda: float(r.zscore(keys.DUE, TARGET.label) or "inf") <= time.time() * 1000
               and r.zscore(keys.TARGETS, TARGET.label) is not None, what="the service hearing the heartbeat")


def test_a_command_nobody_takes_ends_expired(r: Any) -> None:
    rid = send(r, JOB, "scale_lr", {"factor": 0.5}, expire_after=60)
    before = ended(r, "expired")
    assert reconciler(r).tick(time.time() + 30).changed == []
    report = reconciler(r).tick(time.time() + 61)
    assert report.changed == [(rid, "expired")]
    assert ended(r, "expired") == before + 1
    rec = records.get(r, rid)
    assert rec is not None and rec["status"] == "expired"
    act = rec["actions"][0]
    assert (act["status"], act["reason"]) == ("expired", "expired")
    assert act["result"] == {"message": "Nobody took the command before it expired."}
    # Terminal: it drops its signature, its mailbox entry and its due items.
    assert "sig" not in r.hgetall(keys.record(rid)) and r.zcard(keys.due_items(TARGET)) == 0
    assert r.xlen(keys.mailbox(TARGET)) == 0


def test_a_claim_held_by_a_process_that_is_gone_is_offered_to_the_one_that_heartbeats(r: Any) -> None:
    rid = send(r, JOB, "scale_lr", {"factor": 0.5})
    box = Mailbox(r, TARGET)
    [entry] = box.fetch()
    assert box.claim(entry, "gpu-1:100") == "ok"
    beat(r, "gpu-1", 100)
    assert reconciler(r).tick(time.time() + 11).changed == []  # the claimant is alive: it may still apply it
    beat(r, "gpu-1", 200)  # the trainer restarted: another pid heartbeats for the job
    reconciler(r).tick(time.time() + 11)  # its first heartbeat brought the target's next look forward
    rec = records.get(r, rid)
    assert rec is not None and rec["actions"][0]["status"] == "pending"
    [again] = box.fetch()  # the same signed command, after the cursor
    assert again.command is not None and again.command.record_id == rid
    assert box.claim(again, "gpu-1:200") == "ok"
    box.ack([Ack(rid, 0, "scale_lr", "applied", {"new_lr": [0.05]}, "gpu-1:200")])
    rec = records.get(r, rid)
    assert rec is not None and rec["status"] == "applied" and rec["actions"][0]["acked_by"] == "gpu-1:200"


def test_a_claim_nobody_acknowledges_ends_lost_and_a_late_ack_still_tells_the_truth(r: Any) -> None:
    rid = send(r, JOB, "scale_lr", {"factor": 0.5}, expire_after=5)
    box = Mailbox(r, TARGET)
    assert box.claim(box.fetch()[0], "gpu-1:100") == "ok"
    before = ended(r, "lost")
    report = reconciler(r).tick(time.time() + 5 + 21)  # expire_after + the reconciler's grace
    assert report.changed == [(rid, "lost")]
    assert ended(r, "lost") == before + 1
    rec = records.get(r, rid)
    assert rec is not None and rec["status"] == "lost" and rec["actions"][0]["reason"] == "lost"
    # The process did apply it after all, and says so: the record follows the truth.
    box.ack([Ack(rid, 0, "scale_lr", "applied", {"new_lr": [0.05]}, "gpu-1:100")])
    rec = records.get(r, rid)
    assert rec is not None and rec["status"] == "applied"
    assert r.hget(keys.record(rid), "late:0") == "1"


def test_claiming_and_expiring_are_atomic_with_respect_to_each_other(r: Any) -> None:
    rid = send(r, JOB, "scale_lr", {"factor": 0.5}, expire_after=0.2)
    time.sleep(0.3)
    box = Mailbox(r, TARGET)
    [entry] = box.fetch()
    assert box.claim(entry, "gpu-1:100") == "expired"  # ended in the claim itself: never applied
    rec = records.get(r, rid)
    assert rec is not None and rec["status"] == "expired"
    assert reconciler(r).tick(time.time() + 60).changed == []  # and nothing left for the reconciler


def test_an_expired_command_is_not_taken_even_when_a_clock_is_slow(r: Any) -> None:
    rid = send(r, JOB, "scale_lr", {"factor": 0.5}, expire_after=60)
    box = Mailbox(r, TARGET)
    [entry] = box.fetch()  # read before the reconciler expired it; claimed after, by a slow clock
    reconciler(r).tick(time.time() + 61)  # the reconciler's clock passed the expiry
    assert box.fetch() == []  # the expired command left the mailbox
    assert box.claim(entry, "gpu-1:100") == "gone"
    rec = records.get(r, rid)
    assert rec is not None and rec["status"] == "expired"


def test_reconcilers_racing_end_each_record_once(r: Any) -> None:
    ids = [send(r, f"job-{i}", "scale_lr", {"factor": 0.5}, expire_after=1) for i in range(60)]
    box_claims = {}
    for i, rid in enumerate(ids[:30]):  # half were delivered to a process that then died without a heartbeat
        box = Mailbox(r, keys.Target("job", f"job-{i}"))
        box_claims[rid] = box.claim(box.fetch()[0], f"gpu-1:{1000 + i}")
    assert set(box_claims.values()) == {"ok"}
    reconcilers = [service(r).extensions["trainmedic"].reconciler for _ in range(4)]
    changes: list[tuple[str, str]] = []
    lock = threading.Lock()

    def run(rc: Any) -> None:
        for _ in range(5):
            report = rc.tick(time.time() + 30)
            with lock:
                changes.extend(report.changed)

    threads = [threading.Thread(target=run, args=(rc,)) for rc in reconcilers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(rid for rid, _ in changes) == sorted(ids)  # each record changed exactly once
    statuses = {rid: status for rid, status in changes}
    assert {statuses[rid] for rid in ids[:30]} == {"lost"} and {statuses[rid] for rid in ids[30:]} == {"expired"}
    assert r.zcard(keys.DUE) == 0


def test_holds_nobody_approves_expire_through_the_reconciler(r: Any, tmp_path: Any) -> None:
    from tests.conftest import post_json, write_playbooks

    path = write_playbooks(tmp_path / "held.yaml", "playbooks:\n  - name: held\n    matchers: ['alertname=\"H\"']\n"
                           "    target: job\n    approval: true\n    approval_timeout: 1s\n"
                           "    actions: [{scale_lr: {factor: 0.5}}]\n")
    from trainmedic.service.app import create_app
    from tests.conftest import OPERATOR, SIGNING_KEY, TOKEN

    kw = r.connection_pool.connection_kwargs
    app = create_app({"TESTING": True, "redis_url": f"redis://127.0.0.1:{kw['port']}/0", "webhook_token": TOKEN,
                      "operator_token": OPERATOR, "signing_key": SIGNING_KEY, "playbooks": str(path)})
    made = post_json(app.test_client(), "/remediations", {"playbook": "held", "labels": {"job_name": JOB}})
    rid = made.get_json()["id"]
    report = app.extensions["trainmedic"].reconciler.tick(time.time() + 2)
    assert report.changed == [(rid, "expired")]
    rec = records.get(r, rid)
    assert rec is not None and (rec["status"], rec["reason"]) == ("expired", "approval_expired")


def test_a_keyspace_that_came_back_empty_is_noticed_once(r: Any, caplog: Any) -> None:
    rc = reconciler(r)
    rc.mark_epoch()
    assert rc.tick().reset is False
    assert 'id="reset-banner"' not in service(r).test_client().get("/").get_data(as_text=True)
    r.flushall()  # Redis restarted without persistence
    assert rc.tick().reset is True
    assert rc.tick().reset is False  # noticed once: a new epoch is marked
    assert r.get(keys.RESETS) == "1" and r.get(keys.RESET_AT)
    page = service(r).test_client().get("/").get_data(as_text=True)
    assert 'id="reset-banner"' in page
    assert "Redis came back without trainmedic's data at " + r.get(keys.RESET_AT) in page
    assert any("Redis came back without trainmedic's data" in m for m in caplog.messages)
    text = service(r).test_client().get("/metrics").get_data(as_text=True)
    assert "trainmedic_redis_resets_total 1.0" in text


def test_a_record_reads_back_as_the_contract_shows_it(r: Any) -> None:
    rid = send(r, JOB, "set_lr", {"lr": 0.01})
    rec = records.get(r, rid)
    assert rec is not None
    assert json.loads(dumps(rec)) == rec  # strict JSON: no NaN, no Infinity
    assert rec["requested_by"] == "operator" and rec["escalation"] == {"stage": 0, "parent": None, "next": None}


def test_a_burst_larger_than_a_page_is_visited_once_a_pass_and_still_followed_up(r: Any, make_app: Any) -> None:
    from dataclasses import replace

    from trainmedic.service.decide.reconciler import VISIT_SHARE

    from tests.conftest import post_json

    app = make_app()  # the shipped playbooks: a loss spike's record answers for its alert
    jobs = [f"burst-{i}" for i in range(12)]
    body = {"version": "4", "status": "firing", "receiver": "trainmedic", "alerts": [
        {"status": "firing", "labels": {"alertname": "TrainingLossSpike", "job_name": job, "severity": "critical"},
         "annotations": {},
         "startsAt": "2026-11-22T01:00:00.5Z", "endsAt": "0001-01-01T00:00:00Z", "fingerprint": f"{i:016x}",
         "generatorURL": "http://prometheus:9090/graph"} for i, job in enumerate(jobs)]}
    resp = post_json(app.test_client(), "/webhook", body)
    made = resp.get_json()["remediations"]
    assert resp.status_code == 200, resp.get_json()
    assert [m["status"] for m in made] == ["dispatched"] * len(jobs)
    rc = app.extensions["trainmedic"].reconciler
    # Pages of 5: nobody took the commands, so every job is due with its followed record once they expire.
    rc.settings = replace(rc.settings, targets_per_tick=5)
    t0 = time.monotonic()
    report = rc.tick(time.time() + 3601)
    assert report.targets == len(jobs)  # each job visited once, not its page again and again
    assert sorted(status for _, status in report.changed) == ["expired"] * len(jobs)
    # The follow-ups still ran within the pass: every expired record answers for its alert (its outcome).
    assert report.followed >= len(jobs)
    assert all(records.get(r, m["id"])["outcome"] is not None for m in made)
    assert time.monotonic() - t0 < rc.settings.interval * (1 + VISIT_SHARE) + 5
