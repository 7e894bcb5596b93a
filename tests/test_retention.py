"""Retention (README: HTTP API, records are kept 30 days): every key trainmedic writes is bounded by count and by age.

A burst of webhooks, commands, acks (a real node agent and a real trainer process), approvals, rejections,
expiries and resolves, once the reconciler has looked at every target (which it does by their records'
expiry at the latest), leaves only keys with a TTL, except the records and their indexes (deleted by count and
age: the history's retention) and the few global keys the design keeps without one; each of those is bounded
by count or trimmed, as the comments on GLOBALS say.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.service import history, upgrade
from trainmedic.service.store.decision import ANNOTATIONS_MAX, MAILBOX_MAX

from tests.conftest import post_json, write_playbooks
from tests.support.faults import CrashTrainer, wait_for

# The global keys kept without a TTL, and what bounds each one.
GLOBALS = {
    # Record ids, trimmed to TRAINMEDIC_HISTORY_MAX by the reconciler (oldest first, record hashes deleted);
    # ids of records that expired by age are dropped by the history reader when it meets them.
    keys.HISTORY: "count",
    # The history index (service/history.py): its journal (drained by every query and tick), its sequence
    # counter, and per segment of 2^16 records a bitmap per (field, value) and the set naming them; retention
    # clears the bits of the records it deletes and drops a segment once none of its records is left.
    keys.HIST_JOURNAL: "count",
    keys.HIST_SEQ: "constant",
    # Facet digest -> playbook and alert name: one field per pair the playbooks answer.
    keys.HIST_FACETS: "constant",
    # Target label -> last heartbeat: the service drops targets silent for a day.
    keys.TARGETS: "age",
    # Target label -> earliest due item: the reconciler drops a target when its due items are gone.
    keys.DUE: "count",
    # Held record -> approval deadline: approve/reject remove it, the reconciler drops those past the deadline.
    keys.APPROVALS: "age",
    # One timestamp string, and one counter: constant size.
    keys.EPOCH: "constant",
    keys.MARK: "constant",
    keys.MARK_SEEN: "constant",
    upgrade.UPGRADED: "constant",
    keys.RESETS: "constant",
    # A hash of counts by refusal reason (bad_signature, unsigned, replayed): a few fields at most.
    keys.REJECTED: "constant",
    # Counters for /metrics: a field per (playbook, outcome), and per (playbook, histogram bucket).
    keys.OUTCOME_COUNTS: "constant",
    keys.RESOLVE_HISTOGRAM: "constant",
    # The scripts' counts for /metrics (backlog by kind, acks by action and status, latency buckets): a field
    # per (action, status) and (action, bucket).
    keys.METRICS: "constant",
    # Alerts no playbook matched, by alert name: at most 100 names and `other` (service/unmatched.py).
    keys.UNMATCHED: "constant",
    # Jobs judged hung: live jobs only (a hang resolves when the step moves or the heartbeats stop).
    keys.HUNG: "count",
    # Target label -> when its heartbeat stops counting as live: the reconciler drops those a day past it.
    keys.live("job"): "age",
    keys.live("node"): "age",
    # Goodput (service/goodput.py): every job seen in 30 days (swept past that), the jobs whose down time
    # still grows, how far the search for new records went, and where the sweep goes on.
    keys.GOODPUT_JOBS: "age",
    keys.GOODPUT_DOWN: "age",
    keys.GOODPUT_SEQ: "constant",
    keys.GOODPUT_SWEEP: "constant",
    # Nodes seen (Lemon nodes): each scrape of /metrics drops those not seen in 30 days.
    keys.NODES_SEEN: "age",
}
NODES = [f"gpu-node-{i}" for i in range(4)]
JOBS = [f"job-{i}" for i in range(5)]
PLAYBOOKS = """\
playbooks:
  - name: gpu-hot
    matchers: ['alertname="GPUTemperatureHigh"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    on_resolved: [{restore_power_limit: {}}]
    cooldown: 10m
    max_runs: {count: 5, per: 1h}
  - name: loss-spike
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    actions: [{scale_lr: {factor: 0.5, min_lr: 1.0e-7}}]
    cooldown: 1m
    max_runs: {count: 3, per: 24h}
  - name: held
    matchers: ['alertname="GPUHotHeld"']
    target: node
    approval: true
    actions: [{power_limit: {fraction: 0.9}}]
    on_resolved: [{restore_power_limit: {}}]
  - name: held-briefly
    matchers: ['alertname="LossHeld"']
    target: job
    approval: true
    approval_timeout: 1s
    actions: [{scale_lr: {factor: 0.5}}]
  - name: rehearsal
    matchers: ['alertname="Rehearsal"']
    target: job
    dry_run: true
    actions: [{scale_lr: {factor: 0.5}}]
    on_resolved: [{set_lr: {lr: 0.1}}]
"""


@pytest.fixture
def app(make_app: Any, tmp_path: Path) -> Any:
    return make_app(playbooks=str(write_playbooks(tmp_path / "pb.yaml", PLAYBOOKS)))


def alert(status: str, alertname: str, fingerprint: str, annotations: dict | None = None, **labels: str) -> dict:
    return {"status": status, "labels": {"alertname": alertname, **labels}, "annotations": annotations or {},
            "startsAt": "2026-11-22T01:00:00.5Z", "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else
            "2026-11-22T01:30:00Z", "fingerprint": fingerprint, "generatorURL": "http://prometheus:9090/graph"}


def webhook(http: Any, *alerts: dict) -> list[dict]:
    status = "resolved" if all(a["status"] == "resolved" for a in alerts) else "firing"
    resp = post_json(http, "/webhook", {"version": "4", "status": status, "receiver": "trainmedic",
                                        "groupLabels": {}, "commonLabels": {}, "alerts": list(alerts)})
    assert resp.status_code == 200, resp.get_json()
    return list(resp.get_json()["remediations"])


def every_key(r: Any) -> dict[str, int]:
    """Every key in Redis and its PTTL (-1: none)."""
    names = list(r.scan_iter(count=1000))
    pipe = r.pipeline(transaction=False)
    for k in names:
        pipe.pttl(k)
    return dict(zip(names, pipe.execute()))


def status(r: Any, rid: str) -> str | None:
    rec = records.get(r, rid)
    return None if rec is None else str(rec["status"])


def test_after_a_burst_every_key_has_a_ttl_except_the_global_indexes_which_are_bounded(
        app: Any, r: Any, redis_url: str, agents: Any, nvml_lib: Path, nvml_state: Any, tmp_path: Path) -> None:
    http = app.test_client()
    agent = agents(NODES[0], lib_dir=nvml_lib, state=nvml_state)
    trainer = CrashTrainer(tmp_path, JOBS[0], redis_url, "apply")
    try:
        agent.wait_ready(r)
        trainer.wait_beating(r)
        # Firings for every node and job (throttles, LR halvings), then resends (duplicates).
        made = webhook(http, *[alert("firing", "GPUTemperatureHigh", f"n{i}", node=n, gpu_id="0")
                               for i, n in enumerate(NODES)],
                       *[alert("firing", "TrainingLossSpike", f"j{i}", job_name=j) for i, j in enumerate(JOBS)])
        assert len(made) == len(NODES) + len(JOBS)
        webhook(http, alert("firing", "TrainingLossSpike", "j0", job_name=JOBS[0]))
        # Holds: one approved, one rejected, one left to expire; a dry run with an undo obligation.
        approve, reject = (webhook(http, alert("firing", "GPUHotHeld", f"h{i}", node=NODES[i], gpu_id="1"))[0]["id"]
                           for i in (0, 1))
        webhook(http, alert("firing", "LossHeld", "lh", job_name=JOBS[1]))
        webhook(http, alert("firing", "Rehearsal", "rh", job_name=JOBS[2]))
        assert post_json(http, f"/remediations/{approve}/approve", {}).status_code == 200
        assert post_json(http, f"/remediations/{reject}/reject", {"comment": "no"}).status_code == 200
        # Ad-hoc commands for a job nobody runs: they wait in its mailbox.
        for _ in range(300):
            assert post_json(http, "/commands", {"target": f"job:{JOBS[3]}", "action": "set_lr",
                                                 "params": {"lr": 0.01}}).status_code == 201
        # The real agent and trainer apply theirs and ack.
        node0 = next(m["id"] for m in made if m["id"].endswith(f"~node~{NODES[0]}"))
        job0 = next(m["id"] for m in made if m["id"].endswith(f"~job~{JOBS[0]}"))
        for rid in (node0, job0, approve):
            wait_for(lambda rid=rid: status(r, rid) == "applied", 20, f"{rid} to be applied")
        # Resolves: on_resolved for the throttled nodes and the rehearsal, nothing for the jobs.
        undo = webhook(http, *[alert("resolved", "GPUTemperatureHigh", f"n{i}", node=n, gpu_id="0")
                               for i, n in enumerate(NODES[:2])],
                       alert("resolved", "TrainingLossSpike", "j0", job_name=JOBS[0]),
                       alert("resolved", "Rehearsal", "rh", job_name=JOBS[2]))
        assert len(undo) == 3  # GPU 1 of the first node stays throttled (its alert still fires)
        wait_for(lambda: status(r, undo[0]["id"]) == "applied", 20, "the restore to be applied")
        # The reconciler passes over it all, past the short approval timeout and the commands' expiry.
        rc = app.extensions["trainmedic"].reconciler
        rc.tick(time.time() + 2)
        rc.tick(time.time() + 2 * 3600)
    finally:
        trainer.stop()
        agent.stop()

    ttl = every_key(r)
    kinds = {k.split("}:", 1)[1].split(":")[0] if "}:" in k else k for k in ttl}
    assert {"rec", "state", "undo", "cursor", "ledger", "power", "heartbeat", "hist"} <= kinds  # every kind
    segments = (keys.HIST_PREFIX + "bm:", keys.HIST_PREFIX + "seg:")  # bounded with the records (see GLOBALS)
    # Records and their targets' lists of them: deleted by the history's retention (count and age).
    by_retention = [k for k in ttl if "}:rec:" in k or k.endswith("}:hist")]
    unbounded = sorted(k for k, t in ttl.items() if t < 0 and k not in GLOBALS and not k.startswith(segments)
                       and k not in by_retention)
    assert unbounded == [], f"keys without a TTL: {unbounded}"
    assert set(GLOBALS) >= {k for k, t in ttl.items() if t < 0 and not k.startswith(segments)
                            and k not in by_retention}
    # What appliers leave for the service (their journals and counts) was taken in and is gone.
    assert not [k for k in ttl if k.endswith(("}:hj", "}:metrics"))]
    # The globals are bounded: pending approvals only, due targets only, a few refusal reasons.
    assert r.zcard(keys.APPROVALS) == 0  # one approved, one rejected, one expired
    for label in r.zrange(keys.DUE, 0, -1):
        target = keys.parse_label(label)
        assert target is not None and r.zcard(keys.due_items(target)) > 0
    assert r.zcard(keys.TARGETS) == 2
    # The mailbox is never trimmed: its commands expired, and left it then.
    assert r.xlen(keys.mailbox(keys.Target("job", JOBS[3]))) == 0
    assert all(status(r, m["id"]) == "expired" for m in made if m["id"].endswith(f"~job~{JOBS[3]}"))


def test_a_mailbox_holds_its_bound_of_waiting_commands_and_the_next_one_says_it_is_full(app: Any, r: Any) -> None:
    http = app.test_client()
    made = []
    for _ in range(MAILBOX_MAX + 1):
        resp = post_json(http, "/commands", {"target": "job:nobody-reads", "action": "set_lr", "params": {"lr": 0.01}})
        assert resp.status_code == 201
        made.append(resp.get_json())
    assert {m["status"] for m in made[:MAILBOX_MAX]} == {"dispatched"}
    assert (made[-1]["status"], made[-1]["reason"]) == ("skipped", "mailbox_full")
    # Nothing was trimmed: every waiting command is still there for the job to take.
    assert r.xlen(keys.mailbox(keys.Target("job", "nobody-reads"))) == MAILBOX_MAX


def test_records_past_the_age_are_deleted(make_app: Any, r: Any, tmp_path: Path) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "pb.yaml", PLAYBOOKS)))
    made = [m["id"] for m in webhook(app.test_client(), *[alert("firing", "TrainingLossSpike", f"a{i}",
                                                                job_name=f"aged-{i}") for i in range(3)])]
    rc = app.extensions["trainmedic"].reconciler
    assert rc.tick().trimmed == 0
    assert rc.tick(time.time() + 31 * 86400).trimmed == 3  # 30 days later
    assert not any(r.exists(keys.record(rid)) for rid in made) and r.zcard(keys.HISTORY) == 0


def test_history_is_trimmed_to_history_max_and_the_records_past_it_are_deleted(make_app: Any, r: Any,
                                                                               tmp_path: Path) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "pb.yaml", PLAYBOOKS)), history_max=50)
    http = app.test_client()
    ids = []
    for batch in range(6):
        ids += [m["id"] for m in webhook(http, *[alert("firing", "TrainingLossSpike", f"f{batch}x{i}",
                                                       job_name=f"job-{batch}-{i}") for i in range(20)])]
    history.catch_up(r)  # what the next history query (or the reconciler's tick) does first
    assert len(ids) == 120 and r.zcard(keys.HISTORY) == 120
    assert app.extensions["trainmedic"].reconciler.tick().trimmed == 70
    assert r.zcard(keys.HISTORY) == 50
    ordered = sorted(ids)  # ids sort by time
    assert not any(r.exists(keys.record(rid)) for rid in ordered[:70])  # deleted, not only unlisted
    assert all(r.exists(keys.record(rid)) for rid in ordered[70:])
    page = http.get("/history?limit=500").get_json()
    assert sorted(i["id"] for i in page["items"]) == ordered[70:]


def test_a_949_kb_alert_is_stored_as_a_record_of_a_few_kb_with_its_labels_whole(app: Any, r: Any) -> None:
    labels = {f"label_{i:02d}": f"value-{i}-" + "x" * 40 for i in range(40)}
    notes = {f"note_{i}": "y" * 94_900 for i in range(10)}  # 949 KB of annotations, under the 1 MiB body cap
    body = alert("firing", "TrainingLossSpike", "big", notes, job_name="big-job", **labels)
    assert 940_000 < len(json.dumps(body)) < 1024 * 1024
    [made] = webhook(http := app.test_client(), body)
    rec = http.get(f"/remediations/{made['id']}").get_json()
    assert rec["alert"]["truncated"] is True
    assert rec["alert"]["labels"] == {"alertname": "TrainingLossSpike", "job_name": "big-job", **labels}
    assert 0 < sum(len(v) for v in rec["alert"]["annotations"].values()) <= ANNOTATIONS_MAX
    size = r.memory_usage(keys.record(made["id"]), samples=0)  # every field, not an estimate
    assert size < 16 * 1024, f"the record takes {size} bytes in Redis"
    assert len(r.hget(keys.record(made["id"]), "d")) < 8 * 1024


def test_the_global_indexes_without_a_ttl_forget_targets_that_are_long_gone(app: Any, r: Any) -> None:
    http = app.test_client()
    made = webhook(http, alert("firing", "TrainingLossSpike", "g1", job_name="gone-job"))
    rid = made[0]["id"]
    target = keys.Target("job", "gone-job")
    # The job heartbeated two days ago and never again.
    r.zadd(keys.TARGETS, {target.label: time.time() - 2 * 86400, "job:alive": time.time()})
    r.set(keys.heartbeat(keys.Target("job", "alive")), "{}", px=60_000)
    rc = app.extensions["trainmedic"].reconciler
    rc.tick(time.time() + 3601)  # its command expired after an hour
    assert status(r, rid) == "expired"
    assert r.zrange(keys.TARGETS, 0, -1) == ["job:alive"]
    assert target.label not in r.zrange(keys.DUE, 0, -1)
