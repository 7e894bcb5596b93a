"""What one target's writes, or a Redis holding what trainmedic never wrote, can do to everyone else: nothing.

Real Redis and the service's own code throughout: a key of a wrong type or a value that does not parse is
repaired or skipped and counted (trainmedic_redis_repairs_total), never a 5xx nor a stuck reconciler; a
breaker's claim whose record was never made lapses within seconds; a decided hold that someone set back to
pending is never decided twice; a detector that flaps makes one record per cooldown, not one per flap.
"""
from __future__ import annotations

import re
import time
from typing import Any

import redis

from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire import keys
from trainmedic.service.decide.breaker import LEASE
from trainmedic.service.store import record as records

from tests.conftest import load_fixture, post_json, write_playbooks

JOB = keys.Target("job", "llama-ft-01")


def repairs_total(http: Any) -> float:
    text = http.get("/metrics").get_data(as_text=True)
    m = re.search(r"^trainmedic_redis_repairs_total (\S+)$", text, re.M)
    assert m, text[-2000:]
    return float(m.group(1))


def test_the_service_answers_whatever_redis_holds_and_repairs_and_counts_it(app: Any, r: redis.Redis) -> None:
    http = app.test_client()
    # The keys every target shares, of the wrong type or holding what is not a count; a job's own keys too.
    r.set(keys.DUE, "x")
    r.set(keys.HIST_JOURNAL, "x")
    r.set(keys.TARGETS, "x")
    r.set(keys.HISTORY, "x")
    r.set(keys.HIST_SEQ, "notanumber")
    r.hset(keys.REJECTED, "bad_signature", "notanumber")
    r.hset(keys.METRICS, mapping={"n|scale_lr|applied": "notanumber", "backlog|job": "1"})
    r.set(keys.target_state(JOB), "x")
    r.hset(keys.heartbeat(JOB), "not", "a string")
    resp = post_json(http, "/webhook", load_fixture("firing_single.json"))
    assert resp.status_code == 200, resp.get_json()
    [made] = resp.get_json()["remediations"]
    assert made["status"] == "dispatched"
    rc = app.extensions["trainmedic"].reconciler
    rc.tick()
    rc.tick(time.time() + 3700)  # past the command's expiry: the reconciler is not stuck on any of it
    assert records.get(r, made["id"])["status"] == "expired"  # type: ignore[index]
    for path in ("/history", "/", "/targets", "/metrics", "/readyz", f"/targets/job/{JOB.name}",
                 f"/remediations/{made['id']}"):
        assert http.get(path).status_code == 200, path
    assert [i["id"] for i in http.get("/history").get_json()["items"]] == [made["id"]]
    assert repairs_total(http) >= 6


def test_a_record_that_does_not_read_as_one_is_left_out_and_counted(app: Any, r: redis.Redis) -> None:
    http = app.test_client()
    [made] = post_json(http, "/webhook", load_fixture("firing_single.json")).get_json()["remediations"]
    assert http.get("/history").get_json()["items"][0]["id"] == made["id"]
    before = repairs_total(http)
    r.hset(keys.record(made["id"]), mapping={"d": "{not json", "status": "what"})
    assert http.get("/history").get_json()["items"] == []
    assert http.get(f"/remediations/{made['id']}").status_code == 404
    app.extensions["trainmedic"].reconciler.tick(time.time() + 3700)  # nor does it stop the reconciler
    assert repairs_total(http) > before


BOUNDED = """\
playbooks:
  - name: drain
    matchers: ['alertname="Broken"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    max_active: {count: 1}
"""


def test_a_claim_whose_record_was_never_made_is_released_within_the_lease(make_app: Any, r: redis.Redis,
                                                                           tmp_path: Any) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "pb.yaml", BOUNDED)))
    svc = app.extensions["trainmedic"]
    [pb] = svc.playbooks
    now = time.time()
    # A worker claimed the one place, then died before DECIDE made the record.
    assert svc.dispatcher.breaker.claim([(pb, "1K1CH0000000000000000000AA~node~gpu-1")], now) == ["ok"]
    assert r.zcard(keys.breaker_open("drain")) == 1
    svc.reconciler.tick(now + 1)
    assert r.zcard(keys.breaker_open("drain")) == 0  # no record: not renewed, let go at once
    body = load_fixture("firing_single.json")
    body["alerts"][0]["labels"] = {"alertname": "Broken", "node": "gpu-2"}
    [made] = post_json(app.test_client(), "/webhook", body).get_json()["remediations"]
    assert made["status"] == "dispatched"  # the place was free
    # An open remediation keeps its place past the lease, renewed by the reconciler.
    for dt in (LEASE / 2, LEASE, 1.5 * LEASE):
        svc.reconciler.tick(now + dt)
    assert r.zrange(keys.breaker_open("drain"), 0, -1) == [made["id"]]


HELD = """\
playbooks:
  - name: held
    matchers: ['alertname="Held"']
    target: job
    approval: true
    actions: [{set_lr: {lr: 0.02}}]
"""


def test_a_decided_hold_set_back_to_pending_is_never_decided_again(make_app: Any, r: redis.Redis,
                                                                  tmp_path: Any) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "pb.yaml", HELD)))
    http = app.test_client()
    body = load_fixture("firing_single.json")
    body["alerts"][0]["labels"] = {"alertname": "Held", "job_name": JOB.name}
    [held] = post_json(http, "/webhook", body).get_json()["remediations"]
    assert held["status"] == "pending_approval"
    rejected = post_json(http, f"/remediations/{held['id']}/reject", {"comment": "no"}).get_json()
    assert (rejected["status"], rejected["reason"]) == ("skipped", "rejected")
    # The job's own user sets its record back to held, with a deadline far away.
    r.hset(keys.record(held["id"]), mapping={"status": "pending_approval", "ab": int((time.time() + 3600) * 1000),
                                             "as": "P"})
    resp = post_json(http, f"/remediations/{held['id']}/approve", {})
    assert resp.status_code == 200, resp.get_json()
    assert (resp.get_json()["status"], resp.get_json()["reason"]) == ("skipped", "tampered")
    assert r.xlen(keys.mailbox(JOB)) == 0 and not r.exists(keys.mailbox(JOB))  # nothing was sent
    assert post_json(http, f"/remediations/{held['id']}/approve", {}).status_code == 409


def test_a_flapping_detector_makes_one_record_per_cooldown(app: Any, r: redis.Redis) -> None:
    box = Mailbox(r, JOB)
    detections = app.extensions["trainmedic"].reconciler.detections
    base = time.time() - 600
    for i in range(150):  # 150 flaps, a second apart: firing, then resolved
        start = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(base + 2 * i)) + ".000Z"
        end = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(base + 2 * i + 1)) + ".000Z"
        box.detect("TrainingLossSpike", "firing", start, "", i, 9.9)
        box.detect("TrainingLossSpike", "resolved", start, end, i, 0.1)
    while detections.waiting([JOB]):
        detections.handle(JOB)
    made = [i for i in app.test_client().get("/history?limit=500").get_json()["items"]
            if i["alert"]["alertname"] == "TrainingLossSpike"]
    assert len(made) == 1 and made[0]["requested_by"] == "detector"


def test_what_an_applier_counted_while_no_service_listened_is_folded_in_once_one_listens(
        r: redis.Redis, make_app: Any) -> None:
    from trainmedic.service.beats import announce

    box = Mailbox(r, JOB)
    box.heartbeat({"kind": "job", "name": JOB.name})
    announce(r, [JOB])  # the service knew the job from before
    box.count_refused("bad_signature", 2)  # said on the job's channel while no service listened
    app = make_app()  # starts its listener
    text = app.test_client().get("/metrics").get_data(as_text=True)
    assert 'trainmedic_commands_rejected_total{reason="bad_signature"} 2.0' in text
    assert not r.exists(keys.target_metrics(JOB))  # taken in, once
