"""GET /metrics: the README's metrics, exact across gunicorn workers, plus acks, backlog and Redis health."""
from __future__ import annotations

import copy
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
import requests
from prometheus_client.parser import text_string_to_metric_families

from trainmedic.client.wire import keys
from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire.protocol import Ack
from trainmedic.service.embedded_redis import free_port

from tests.conftest import AUTH, load_fixture, post_json
from tests.support.keyspaces import BOTH


def loss_spike(job: str, fingerprint: str, status: str = "firing") -> dict:
    """A one-alert Alertmanager notification for the loss-spike playbook on one job."""
    body = copy.deepcopy(load_fixture("firing_single.json"))
    alert = body["alerts"][0]
    alert["labels"]["job_name"] = job
    alert["fingerprint"] = fingerprint
    alert["status"] = body["status"] = status
    return body


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape, keyed by (name, labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(scrape: dict, name: str, **labels: str) -> float:
    return scrape.get((name, frozenset(labels.items())), 0.0)


def scrape_until(get: Any, holds: Any, timeout: float = 10.0) -> dict:
    """Scrape until holds(samples) (acks reach /metrics once the service has heard of them: its listener, at
    once); the last scrape's samples."""
    deadline = time.monotonic() + timeout
    while True:
        s = samples(get())
        if holds(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def ack_all(r: redis.Redis, target: keys.Target, statuses: dict[str, str]) -> int:
    """Take every command of the target's mailbox as its trainer would and ack each action; returns acks."""
    box = Mailbox(r, target)
    n = 0
    for entry in box.fetch():
        assert entry.command is not None, entry.error
        assert box.claim(entry, "test:1") == "ok"
        acks = [Ack(entry.command.record_id, a.index, a.action, statuses[a.action], {"ok": True}, "test:1")
                for a in entry.command.actions]
        box.ack(acks)
        n += len(acks)
    return n


def test_every_scrape_shows_exactly_n_across_four_workers(gunicorn: Any, r: redis.Redis) -> None:
    g = gunicorn(workers=4)
    metrics_dir = Path(g.env["PROMETHEUS_MULTIPROC_DIR"])

    def send(i: int) -> int:
        resp = requests.post(g.url + "/webhook", data=json.dumps(loss_spike(f"job-{i}", f"fp{i:04d}")),
                             headers={**AUTH, "Content-Type": "application/json", "Connection": "close"},
                             timeout=10)
        return resp.status_code

    # Batches of concurrent requests until at least two workers took some (each writes its own file):
    # which worker accepts a connection is the kernel's choice, so one batch may land on one worker.
    n = 0
    with ThreadPoolExecutor(8) as pool:
        while n < 40 or (len(list(metrics_dir.glob("counter_*.db"))) < 2 and n < 400):
            assert list(pool.map(send, range(n, n + 8))) == [200] * 8
            n += 8
    assert len(list(metrics_dir.glob("counter_*.db"))) >= 2

    for i in range(n):
        assert ack_all(r, keys.Target("job", f"job-{i}"),
                       {"rollback_checkpoint": "unsupported", "scale_lr": "applied"}) == 2
    scrape_until(lambda: requests.get(g.url + "/metrics", timeout=10).text,
                 lambda s: value(s, "trainmedic_actions_acked_total", action="scale_lr", status="applied") == n)
    for _ in range(8):  # a fresh connection each time, so different workers answer
        text = requests.get(g.url + "/metrics", headers={"Connection": "close"}, timeout=10).text
        s = samples(text)
        assert value(s, "trainmedic_alerts_received_total", status="firing") == n
        assert value(s, "trainmedic_remediations_total", playbook="loss-spike", status="dispatched") == n
        assert value(s, "trainmedic_webhook_duration_seconds_count") == n
        assert value(s, "trainmedic_actions_acked_total", action="scale_lr", status="applied") == n
        assert value(s, "trainmedic_actions_acked_total", action="rollback_checkpoint", status="unsupported") == n
        assert value(s, "trainmedic_ack_latency_seconds_count", action="scale_lr") == n
        assert value(s, "trainmedic_mailbox_backlog", kind="job") == 0
        assert value(s, "trainmedic_redis_up") == 1


def test_counts_survive_a_worker_that_dies(gunicorn: Any) -> None:
    g = gunicorn(workers=2)
    for i in range(6):
        resp = requests.post(g.url + "/webhook", data=json.dumps(loss_spike(f"job-{i}", f"fp{i}")),
                             headers={**AUTH, "Content-Type": "application/json", "Connection": "close"},
                             timeout=10)
        assert resp.status_code == 200
    metrics_dir = Path(g.env["PROMETHEUS_MULTIPROC_DIR"])
    victim = int(sorted(metrics_dir.glob("counter_*.db"))[0].stem.split("_")[1])
    os.kill(victim, signal.SIGKILL)  # a worker of our own gunicorn; its master starts another
    deadline = time.monotonic() + 15
    while os.path.exists(f"/proc/{victim}") and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(6):
        s = samples(requests.get(g.url + "/metrics", headers={"Connection": "close"}, timeout=10).text)
        assert value(s, "trainmedic_alerts_received_total", status="firing") == 6
        assert value(s, "trainmedic_remediations_total", playbook="loss-spike", status="dispatched") == 6


def test_an_ack_is_counted_once_however_often_it_is_sent(http: Any, r: redis.Redis) -> None:
    assert post_json(http, "/webhook", loss_spike("llama-ft-01", "aaa1")).status_code == 200
    target = keys.Target("job", "llama-ft-01")
    box = Mailbox(r, target)
    [entry] = box.fetch()
    assert box.claim(entry, "test:1") == "ok"
    rid = entry.command.record_id
    acks = [Ack(rid, 0, "rollback_checkpoint", "applied", {"restored_step": 10}, "test:1"),
            Ack(rid, 1, "scale_lr", "failed", {"error": "no optimizer"}, "test:1")]
    box.ack(acks)
    box.ack(acks)  # a retried ack (lost reply) must not count twice
    scrape_until(lambda: http.get("/metrics").get_data(as_text=True),
                 lambda s: value(s, "trainmedic_ack_latency_seconds_count", action="scale_lr") == 1)
    time.sleep(0.2)  # and nothing more comes in
    s = samples(http.get("/metrics").get_data(as_text=True))
    assert value(s, "trainmedic_actions_acked_total", action="rollback_checkpoint", status="applied") == 1
    assert value(s, "trainmedic_actions_acked_total", action="scale_lr", status="failed") == 1
    assert value(s, "trainmedic_actions_acked_total", action="scale_lr", status="applied") == 0
    assert value(s, "trainmedic_ack_latency_seconds_count", action="scale_lr") == 1


def test_ack_latency_lands_in_the_right_bucket(http: Any, r: redis.Redis) -> None:
    assert post_json(http, "/webhook", loss_spike("llama-ft-02", "bbb2")).status_code == 200
    box = Mailbox(r, keys.Target("job", "llama-ft-02"))
    [(_, fields)] = r.xrange(keys.mailbox(keys.Target("job", "llama-ft-02")))
    rid = fields["r"] + "~job~llama-ft-02"
    # As if the trainer took three seconds to reach a step boundary: its command was issued 3 s before now
    # (unsigned here: no verify key, so the record's expiry may be moved).
    r.hset(keys.record(rid), "exp", int((time.time() - 3 + 3600) * 1000))
    [entry] = box.fetch()
    assert box.claim(entry, "test:1") == "ok"
    box.ack([Ack(rid, 1, "scale_lr", "applied", {}, "test:1")])
    s = scrape_until(lambda: http.get("/metrics").get_data(as_text=True),
                     lambda s: value(s, "trainmedic_ack_latency_seconds_count", action="scale_lr") == 1)
    bucket = "trainmedic_ack_latency_seconds_bucket"
    assert value(s, bucket, action="scale_lr", le="2.5") == 0
    assert value(s, bucket, action="scale_lr", le="5.0") == 1
    assert value(s, bucket, action="scale_lr", le="+Inf") == 1
    assert 3.0 <= value(s, "trainmedic_ack_latency_seconds_sum", action="scale_lr") < 4.0


@BOTH
def test_backlog_counts_commands_not_yet_applied_waiting_or_delivered_by_kind(http: Any, r: redis.Redis) -> None:
    for i in range(3):
        assert post_json(http, "/webhook", loss_spike(f"idle-{i}", f"c{i}")).status_code == 200
    node_alert = copy.deepcopy(load_fixture("firing_single.json"))
    node_alert["alerts"][0]["labels"] = {"alertname": "DiskSpaceLow", "node": "gpu-node-07"}
    assert post_json(http, "/webhook", node_alert).status_code == 200
    box = Mailbox(r, keys.Target("job", "idle-0"))
    assert box.claim(box.fetch()[0], "test:1") == "ok"  # delivered, not acknowledged: still not applied
    s = samples(http.get("/metrics").get_data(as_text=True))
    assert value(s, "trainmedic_mailbox_backlog", kind="job") == 3
    assert value(s, "trainmedic_mailbox_backlog", kind="node") == 1
    other = Mailbox(r, keys.Target("job", "idle-1"))
    rid = other.fetch()[0].command.record_id
    other.ack([Ack(rid, i, a, "applied", {}, "test:1") for i, a in enumerate(("rollback_checkpoint", "scale_lr"))])
    s = scrape_until(lambda: http.get("/metrics").get_data(as_text=True),
                     lambda s: value(s, "trainmedic_mailbox_backlog", kind="job") == 2)
    assert value(s, "trainmedic_mailbox_backlog", kind="job") == 2


def test_live_targets_are_counted_from_the_heartbeats_the_service_heard(http: Any, r: redis.Redis) -> None:
    Mailbox(r, keys.Target("job", "alive")).heartbeat({"host": "h"}, announce=True)
    Mailbox(r, keys.Target("node", "gpu-node-01")).heartbeat({"host": "h"}, announce=True)
    # A heartbeat nobody announced (a target the service never heard of) does not count; nor does a target
    # the service knew whose heartbeat is gone.
    Mailbox(r, keys.Target("job", "unheard")).heartbeat({"host": "h"})
    r.zadd(keys.TARGETS, {"job:long-gone": time.time() - 3600})
    s = scrape_until(lambda: http.get("/metrics").get_data(as_text=True),
                     lambda s: value(s, "trainmedic_targets_live", kind="node") == 1
                     and value(s, "trainmedic_targets_live", kind="job") == 1)
    assert value(s, "trainmedic_targets_live", kind="job") == 1
    assert value(s, "trainmedic_targets_live", kind="node") == 1


def test_a_scrape_answers_with_redis_down_when_redis_is_unreachable(make_app: Any) -> None:
    app = make_app(redis_url=f"redis://127.0.0.1:{free_port()}/0", REDIS_TIMEOUT=0.5)
    resp = app.test_client().get("/metrics")
    assert resp.status_code == 200
    s = samples(resp.get_data(as_text=True))
    assert value(s, "trainmedic_redis_up") == 0
    assert not [k for k in s if k[0] == "trainmedic_mailbox_backlog"]  # no made-up zeros either


def test_the_counters_follow_the_webhook_in_one_process(http: Any) -> None:
    before = samples(http.get("/metrics").get_data(as_text=True))
    body = loss_spike("llama-ft-03", "ddd4")
    assert post_json(http, "/webhook", body).status_code == 200
    assert post_json(http, "/webhook", body).status_code == 200  # a resend: an alert, not a remediation
    after = samples(http.get("/metrics").get_data(as_text=True))
    name, labels = "trainmedic_alerts_received_total", {"status": "firing"}
    assert value(after, name, **labels) - value(before, name, **labels) == 2
    name, labels = "trainmedic_remediations_total", {"playbook": "loss-spike", "status": "dispatched"}
    assert value(after, name, **labels) - value(before, name, **labels) == 1


def _scan(r: redis.Redis) -> dict[str, Any]:
    """The same figures counted from scratch, record by record (the service reads its aggregates instead)."""
    backlog = {"job": 0, "node": 0}
    acked: dict[tuple[str, str], int] = {}
    for key in r.scan_iter(match="trainmedic:{*}:rec:*"):
        h = r.hgetall(key)
        if h.get("status") == "dispatched":
            backlog[key.split("{", 1)[1].split(":", 1)[0]] += 1
        steps = json.loads(h["d"])["s"]
        for i, code in enumerate(h.get("as") or ""):
            answer = json.loads(h.get(f"r:{i}") or "{}")
            if answer.get("by", "").startswith("test:"):  # an applier's ack
                st = {"A": "applied", "F": "failed", "U": "unsupported", "S": "skipped", "E": "expired"}[code]
                acked[(steps[i][0], st)] = acked.get((steps[i][0], st), 0) + 1
    return {"backlog": backlog, "acked": acked}


def _check_exact(http: Any, r: redis.Redis) -> dict[str, Any]:
    truth = _scan(r)

    def exact(s: dict) -> bool:
        return (all(value(s, "trainmedic_mailbox_backlog", kind=kind) == truth["backlog"][kind]
                    for kind in ("job", "node"))
                and all(value(s, "trainmedic_actions_acked_total", action=action, status=st) == n
                        for (action, st), n in truth["acked"].items()))

    assert exact(scrape_until(lambda: http.get("/metrics").get_data(as_text=True), exact))
    return truth


def live(http: Any, kind: str, n: int) -> bool:
    s = scrape_until(lambda: http.get("/metrics").get_data(as_text=True),
                     lambda s: value(s, "trainmedic_targets_live", kind=kind) == n)
    return value(s, "trainmedic_targets_live", kind=kind) == n


def test_the_scrape_aggregates_stay_exact_through_dispatch_ack_expiry_and_heartbeat_expiry(
        app: Any, http: Any, r: redis.Redis) -> None:
    jobs = [keys.Target("job", f"agg-{i}") for i in range(6)]
    for i, t in enumerate(jobs):
        assert post_json(http, "/webhook", loss_spike(t.name, f"ag{i}")).status_code == 200
    node_alert = copy.deepcopy(load_fixture("firing_single.json"))
    node_alert["alerts"][0]["labels"] = {"alertname": "DiskSpaceLow", "node": "gpu-node-09"}
    assert post_json(http, "/webhook", node_alert).status_code == 200
    assert _check_exact(http, r)["backlog"] == {"job": 6, "node": 1}
    # Acks: one job applies everything, one fails; one claims and never acks (delivered: still backlog).
    ack_all(r, jobs[0], {"rollback_checkpoint": "applied", "scale_lr": "applied"})
    ack_all(r, jobs[1], {"rollback_checkpoint": "failed", "scale_lr": "failed"})
    box = Mailbox(r, jobs[2])
    assert box.claim(box.fetch()[0], "test:1") == "ok"
    assert _check_exact(http, r)["backlog"] == {"job": 4, "node": 1}
    # Heartbeats: two live; one with a short TTL stops counting once it expires (the service reads them).
    Mailbox(r, jobs[3]).heartbeat({"host": "h", "pid": 1}, announce=True)
    Mailbox(r, jobs[4]).heartbeat({"host": "h", "pid": 2}, ttl=2.0, announce=True)
    assert live(http, "job", 2) and live(http, "node", 0)
    time.sleep(2.5)
    app.extensions["trainmedic"].reconciler.tick()  # its look at the heartbeats
    assert live(http, "job", 1)
    # Expiry: an hour later the reconciler ends every command nobody applied (expired or lost).
    rc = app.extensions["trainmedic"].reconciler
    for _ in range(3):
        rc.tick(time.time() + 3700)
    assert _check_exact(http, r)["backlog"] == {"job": 0, "node": 0}


def unmatched(*names: str) -> dict:
    """A notification of alerts that no shipped playbook matches."""
    return {"version": "4", "status": "firing", "receiver": "trainmedic", "alerts": [
        {"status": "firing", "labels": {"alertname": name, "job_name": "j"}, "startsAt": "2026-11-22T08:40:00Z",
         "fingerprint": f"f{i}"} for i, name in enumerate(names)]}


def test_unmatched_alerts_are_counted_by_name_across_workers_and_logged_once_a_minute(gunicorn: Any) -> None:
    g = gunicorn(workers=2)
    metrics_dir = Path(g.env["PROMETHEUS_MULTIPROC_DIR"])

    def send(i: int) -> int:
        resp = requests.post(g.url + "/webhook", data=json.dumps(unmatched("NobodyAsked", "NobodyAsked", "Other2")),
                             headers={**AUTH, "Content-Type": "application/json", "Connection": "close"},
                             timeout=10)
        return resp.status_code

    n = 0
    with ThreadPoolExecutor(8) as pool:  # until both workers took some (see the test above)
        while n < 16 or (len(list(metrics_dir.glob("counter_*.db"))) < 2 and n < 400):
            assert list(pool.map(send, range(8))) == [200] * 8
            n += 8
    assert len(list(metrics_dir.glob("counter_*.db"))) >= 2
    for _ in range(4):  # whichever worker answers the scrape
        s = samples(requests.get(g.url + "/metrics", headers={"Connection": "close"}, timeout=10).text)
        assert value(s, "trainmedic_alerts_unmatched_total", alertname="NobodyAsked") == 2 * n
        assert value(s, "trainmedic_alerts_unmatched_total", alertname="Other2") == n
    log = Path(g.log.name).read_text()
    assert log.count("alert NobodyAsked matched no playbook") == 1, log
    assert log.count("alert Other2 matched no playbook") == 1, log


def test_unmatched_alert_names_are_bounded_to_100_then_other(http: Any, r: redis.Redis) -> None:
    names = [f"Stray{i:03d}" for i in range(130)]
    for i in range(0, len(names), 10):
        assert post_json(http, "/webhook", unmatched(*names[i:i + 10])).status_code == 200
    assert post_json(http, "/webhook", unmatched("Stray000", "Stray129")).status_code == 200
    s = samples(http.get("/metrics").get_data(as_text=True))
    counted = {dict(labels)["alertname"]: v for (name, labels), v in s.items()
               if name == "trainmedic_alerts_unmatched_total"}
    assert len(counted) == 101 and counted["other"] == 31  # 30 names past the first 100, and one of them again
    assert counted["Stray000"] == 2 and counted["Stray099"] == 1 and "Stray100" not in counted
    # A matched alert is not counted.
    assert post_json(http, "/webhook", loss_spike("llama-ft-09", "m1")).json["remediations"]
    after = samples(http.get("/metrics").get_data(as_text=True))
    assert {k: v for k, v in after.items() if k[0] == "trainmedic_alerts_unmatched_total"} == {
        k: v for k, v in s.items() if k[0] == "trainmedic_alerts_unmatched_total"}
    assert r.hlen(keys.UNMATCHED) == 101
