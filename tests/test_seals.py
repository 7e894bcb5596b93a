"""Record seals (Guarantees: approvals and later commands sign only what was decided): every record the
service makes is sealed and stays intact through acks, claims, reconcile, verdicts and approval; a record
whose sealed fields were rewritten in Redis is never acted on again: a deferred record's conditions, a
ladder's next stage and an on_resolved are each refused (skipped / tampered, counted, logged), with nothing
sent. Real Redis, the service's own reconciler."""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.client.wire.protocol import Ack
from trainmedic.client.wire.signing import Signer

from tests.conftest import ROOT, SIGNING_KEY, post_json, write_playbooks

JOB, NODE, OTHER = "seal-job", "seal-node", "seal-other"
SIGNER = Signer.from_secret(SIGNING_KEY)
PLAYBOOKS = """\
playbooks:
  - name: ladder
    matchers: ['alertname="Loss"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
    verify: 1m
    escalate:
      - after: 2m
        actions: [{scale_lr: {factor: 0.5}}]
      - after: 2m
        actions: [{set_lr: {lr: 0.01}}]
  - name: other-ladder
    matchers: ['alertname="OtherLoss"']
    target: job
    actions: [{scale_lr: {factor: 0.9}}]
    verify: 1m
    escalate:
      - after: 2m
        actions: [{scale_lr: {factor: 0.9}}]
      - after: 2m
        actions: [{stop_training: {}}]
  - name: held
    matchers: ['alertname="Held"']
    target: job
    actions: [{set_lr: {lr: 0.02}}]
    approval: true
  - name: dry
    matchers: ['alertname="Dry"']
    target: job
    actions: [{scale_lr: {factor: 0.9}}]
    dry_run: true
  - name: deferred
    matchers: ['alertname="Deferred"']
    target: job
    actions:
      - scale_lr: {factor: 0.5}
        when: 'up{job="$job"} > 0'
      - set_lr: {lr: 0.03}
  - name: hot
    matchers: ['alertname="Hot"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    on_resolved: [{restore_power_limit: {}}]
    resolve_timeout: 2s
  - name: hot-too
    matchers: ['alertname="HotToo"']
    target: node
    actions: [{power_limit: {fraction: 0.7}}]
    on_resolved: [{restore_power_limit: {}}]
    resolve_timeout: 1h
"""
STARTS = "2026-11-22T01:00:00.123Z"


@pytest.fixture
def svc(make_app: Any, tmp_path: Path) -> Any:
    # No Prometheus: a `when:` condition is condition_unknown, the step without one still goes out.
    return make_app(playbooks=str(write_playbooks(tmp_path / "seals.yaml", PLAYBOOKS)))


def alert(alertname: str, status: str = "firing", fingerprint: str = "", **labels: str) -> dict:
    ends = "0001-01-01T00:00:00Z" if status == "firing" else "2026-11-22T02:00:00Z"
    return {"status": status, "labels": {"alertname": alertname, "severity": "critical", **labels},
            "annotations": {"summary": "seal test"}, "startsAt": STARTS if status == "firing" else STARTS[:19] + "Z",
            "endsAt": ends, "generatorURL": "http://prometheus:9090/graph",
            "fingerprint": fingerprint or alertname.encode().hex()[:16].ljust(16, "0")}


def notify(http: Any, *alerts: dict) -> list[dict]:
    """One Alertmanager notification; the records it made."""
    status = "resolved" if all(a["status"] == "resolved" for a in alerts) else "firing"
    resp = post_json(http, "/webhook", {"version": "4", "status": status, "receiver": "trainmedic",
                                        "alerts": list(alerts)})
    assert resp.status_code == 200, resp.get_json()
    return list(resp.get_json()["remediations"])


def fire(http: Any, alertname: str, **labels: str) -> str:
    [made] = notify(http, alert(alertname, **labels))
    return str(made["id"])


def stored(r: redis.Redis, rid: str) -> dict[str, str]:
    return dict(r.hgetall(keys.record(rid)))


def intact(r: redis.Redis, rid: str) -> bool:
    rec = records.load(r, rid)
    return rec is not None and rec.intact(SIGNER)


def decided(r: redis.Redis, rid: str) -> dict[str, Any]:
    """What a record says was decided (its `d`)."""
    return dict(json.loads(r.hget(keys.record(rid), "d") or "{}"))


def rewrite(r: redis.Redis, rid: str, change: Any) -> None:
    """Rewrite what a record says was decided, as someone with its target's Redis user could."""
    d = decided(r, rid)
    change(d)
    r.hset(keys.record(rid), "d", json.dumps(d, separators=(",", ":")))


def apply(r: redis.Redis, rid: str, status: str = "applied") -> float:
    """Claim and acknowledge every action of a record's command as its applier would; the time of the ack."""
    target = keys.target_of_record(rid)
    box = Mailbox(r, target)
    [entry] = [e for e in box.fetch() if e.command is not None and e.command.record_id == rid]
    assert box.claim(entry, "host-1:4242") == "ok"
    assert entry.command is not None
    box.ack([Ack(rid, a.index, a.action, status, {"step": 10}, "host-1:4242", reason=None if status == "applied"
                 else "boom") for a in entry.command.actions])
    return time.time()


def mailbox_len(r: redis.Redis, target: keys.Target) -> int:
    return int(r.xlen(keys.mailbox(target)))


def tampered_count(r: redis.Redis, app: Any) -> int:
    from_redis = int(r.get(keys.TAMPERED) or 0)
    text = app.test_client().get("/metrics").get_data(as_text=True)
    [shown] = re.findall(r"^trainmedic_records_tampered_total ([0-9.]+)$", text, re.M)
    assert float(shown) == from_redis
    return from_redis


def reconciler(app: Any) -> Any:
    return app.extensions["trainmedic"].reconciler


# -- (a) a deferred record's conditions ---------------------------------------------------------------------

def test_a_deferred_record_rewritten_before_its_conditions_sends_nothing_and_ends_tampered(
        r: redis.Redis, svc: Any, caplog: pytest.LogCaptureFixture) -> None:
    job = keys.Target("job", JOB)
    rid = fire(svc.test_client(), "Deferred", job_name=JOB)
    h = stored(r, rid)
    assert (h["status"], h.get("conds")) == ("dispatched", "1") and mailbox_len(r, job) == 0
    assert intact(r, rid)
    # The job's own credentials turn the step that runs without a condition into an LR of 100.
    rewrite(r, rid, lambda d: d["s"].__setitem__(1, ["set_lr", {"lr": 100.0}]))
    with caplog.at_level(logging.ERROR, logger="trainmedic.dispatch"):
        reconciler(svc).tick()
    assert mailbox_len(r, job) == 0, "nothing is signed or sent"
    got = records.get(r, rid)
    assert got is not None and (got["status"], got["reason"]) == ("skipped", "tampered"), got
    assert [(a["status"], a["reason"]) for a in got["actions"]] == [("skipped", "tampered")] * 2
    assert r.hget(keys.record(rid), "sig") is None and r.hget(keys.record(rid), "conds") is None
    assert tampered_count(r, svc) == 1
    assert any(f"remediation {rid} was changed in Redis after it was decided" in m for m in caplog.messages)
    # It is over: a later pass sends nothing and counts nothing more.
    reconciler(svc).tick(time.time() + 5)
    assert mailbox_len(r, job) == 0 and tampered_count(r, svc) == 1


def test_an_intact_deferred_record_still_sends_its_steps_after_the_conditions(r: redis.Redis, svc: Any) -> None:
    job = keys.Target("job", JOB)
    rid = fire(svc.test_client(), "Deferred", job_name=JOB)
    reconciler(svc).tick()
    [entry] = Mailbox(r, job).fetch()
    assert entry.command is not None and [(a.index, a.action, a.params) for a in entry.command.actions] == [
        (1, "set_lr", {"lr": 0.03})]
    got = records.get(r, rid)
    assert got is not None and got["actions"][0]["reason"] == "condition_unknown"
    assert tampered_count(r, svc) == 0 and intact(r, rid)


# -- (b) a ladder's next stage -------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["context", "alert"])
def test_a_ladder_whose_first_record_was_rewritten_makes_no_next_stage_and_ends(
        r: redis.Redis, svc: Any, field: str, caplog: pytest.LogCaptureFixture) -> None:
    job = keys.Target("job", JOB)
    first = fire(svc.test_client(), "Loss", job_name=JOB)
    acked = apply(r, first)
    sent = mailbox_len(r, job)
    if field == "context":
        rewrite(r, first, lambda d: d.__setitem__("c", {"gpu_id": "7"}))
    else:  # the same alert (its fingerprint kept, so the episode is still open), other labels
        rewrite(r, first, lambda d: d["a"]["labels"].__setitem__("job_name", "someone-else"))
    with caplog.at_level(logging.ERROR, logger="trainmedic.dispatch"):
        reconciler(svc).tick(acked + 121)
    h = stored(r, first)
    assert not h.get("next"), "no stage was made"
    assert h.get("ladder_end") == "tampered"
    assert mailbox_len(r, job) == sent
    assert tampered_count(r, svc) == 1
    assert any(f"remediation {first} was changed in Redis" in m for m in caplog.messages)
    # The ladder is over: later passes make nothing and count nothing more.
    reconciler(svc).tick(acked + 400)
    assert not stored(r, first).get("next") and tampered_count(r, svc) == 1


def test_a_stage_record_rewritten_to_an_earlier_stage_makes_no_stage_again(r: redis.Redis, svc: Any) -> None:
    job = keys.Target("job", JOB)
    first = fire(svc.test_client(), "Loss", job_name=JOB)
    acked = apply(r, first)
    reconciler(svc).tick(acked + 121)
    stage1 = stored(r, first)["next"]
    assert decided(r, stage1)["g"] == 1 and intact(r, stage1) and intact(r, first)
    acked1 = apply(r, stage1)
    sent = mailbox_len(r, job)
    # The first record is untouched; its stage now says it was stage 0, so that stage 1 (halving the LR
    # again) would follow it, and again after each one made.
    rewrite(r, stage1, lambda d: d.pop("g"))
    reconciler(svc).tick(acked1 + 121)
    assert not stored(r, stage1).get("next") and mailbox_len(r, job) == sent
    assert stored(r, first).get("ladder_end") == "tampered"
    assert tampered_count(r, svc) == 1


def test_an_intact_ladder_still_makes_its_stages(r: redis.Redis, svc: Any) -> None:
    first = fire(svc.test_client(), "Loss", job_name=JOB)
    acked = apply(r, first)
    reconciler(svc).tick(acked + 121)
    stage1 = stored(r, first)["next"]
    acked1 = apply(r, stage1)
    reconciler(svc).tick(acked1 + 121)
    stage2 = stored(r, stage1)["next"]
    assert [a["action"] for a in (records.get(r, stage2) or {})["actions"]] == ["set_lr"]
    assert tampered_count(r, svc) == 0


# -- (c) on_resolved without a resolve notification ------------------------------------------------------------

def _obligation(r: redis.Redis, fingerprint: str) -> str:
    return keys.obligation(keys.Target("node", NODE), "hot", fingerprint)


@pytest.mark.parametrize("how", ["context rewritten", "alert rewritten", "another node's record",
                                 "another playbook's record"])
def test_an_on_resolved_whose_record_was_rewritten_or_swapped_is_skipped_and_sends_nothing(
        r: redis.Redis, svc: Any, how: str, caplog: pytest.LogCaptureFixture) -> None:
    http = svc.test_client()
    node = keys.Target("node", NODE)
    hot = alert("Hot", node=NODE, gpu_id="0")
    [first] = notify(http, hot)
    rid = first["id"]
    assert first["status"] == "dispatched" and intact(r, rid)
    ob = _obligation(r, hot["fingerprint"])
    assert r.hget(ob, "rid") == rid
    if how == "context rewritten":
        rewrite(r, rid, lambda d: d.__setitem__("c", {"gpu_id": "3"}))
    elif how == "alert rewritten":
        rewrite(r, rid, lambda d: d["a"]["labels"].__setitem__("gpu_id", "3"))
    elif how == "another node's record":
        other = fire(http, "HotToo", node=OTHER, gpu_id="3")
        assert intact(r, other)
        r.hset(ob, "rid", other)
    else:  # an intact record of the same node, but of another playbook and alert
        other = fire(http, "HotToo", node=NODE, gpu_id="3")
        assert intact(r, other)
        r.hset(ob, "rid", other)
    sent = mailbox_len(r, node)
    with caplog.at_level(logging.ERROR, logger="trainmedic.dispatch"):
        report = reconciler(svc).tick(time.time() + 2.5)
    [undo] = report.resolved
    got = records.get(r, undo)
    assert got is not None and got["on_resolved"] is True
    assert (got["status"], got["reason"]) == ("skipped", "tampered"), got
    assert "changed in Redis" in (got.get("detail") or "")
    assert mailbox_len(r, node) == sent, "no command is sent"
    assert r.exists(ob) == 0, "the obligation is discharged: nothing is tried again"
    assert tampered_count(r, svc) == 1
    assert any("was changed in Redis after it was decided" in m for m in caplog.messages)
    assert reconciler(svc).tick(time.time() + 10).resolved == []


def test_an_intact_on_resolved_still_undoes_with_the_records_context(r: redis.Redis, svc: Any) -> None:
    node = keys.Target("node", NODE)
    [first] = notify(svc.test_client(), alert("Hot", node=NODE, gpu_id="0"))
    apply(r, first["id"])
    [undo] = reconciler(svc).tick(time.time() + 2.5).resolved
    got = records.get(r, undo)
    assert got is not None and (got["status"], got["reason"]) == ("dispatched", "resolved_not_notified")
    entry = [e for e in Mailbox(r, node).fetch() if e.command and e.command.record_id == undo]
    assert entry and entry[0].command is not None and entry[0].command.context == {"gpu_id": "0"}
    assert tampered_count(r, svc) == 0


# -- (d) every kind of record is sealed, and nothing the service or an applier does breaks its seal ------------

def every_record(r: redis.Redis) -> list[str]:
    return [k.split(":rec:", 1)[1] for k in r.scan_iter("trainmedic:*:rec:*") if r.type(k) == "hash"]


def test_every_kind_of_record_is_sealed_when_made_and_stays_intact_through_its_life(
        r: redis.Redis, svc: Any) -> None:
    http = svc.test_client()
    made: dict[str, str] = {}

    def check(kind: str, rid: str) -> None:
        made[kind] = rid
        h = stored(r, rid)
        assert h.get("seal"), (kind, h)
        assert intact(r, rid), kind

    check("firing", fire(http, "Loss", job_name=JOB))
    check("held", fire(http, "Held", job_name=JOB))
    check("dry_run", fire(http, "Dry", job_name=JOB))
    check("deferred", fire(http, "Deferred", job_name=JOB))
    check("bad_label", fire(http, "Loss", job_name="not a name!", fingerprint="bad0bad0bad0bad0"))
    [hot] = notify(http, alert("Hot", node=NODE, gpu_id="0"))
    check("node firing", hot["id"])
    resp = post_json(http, "/commands", {"target": f"job:{JOB}", "action": "set_lr", "params": {"lr": 0.1},
                                         "expire_after": "10m"})
    assert resp.status_code == 201, resp.get_json()
    check("manual command", resp.get_json()["id"])
    resp = post_json(http, "/remediations", {"playbook": "held", "labels": {"job_name": JOB}})
    assert resp.status_code == 201, resp.get_json()
    check("manual playbook", resp.get_json()["id"])
    assert stored(r, made["bad_label"])["reason"] == "bad_label"
    assert stored(r, made["dry_run"])["status"] == "dry_run"

    # Approval (through the API) of both holds, the deferred record's conditions, then the acks of everything
    # sent, in each mailbox's order (a claim moves the applier's cursor past what came before).
    for kind in ("held", "manual playbook"):
        resp = post_json(http, f"/remediations/{made[kind]}/approve", {"comment": "ok"})
        assert resp.status_code == 200 and resp.get_json()["status"] == "dispatched", resp.get_json()
    reconciler(svc).tick()
    for rid in (made["firing"], made["manual command"], made["held"]):
        apply(r, rid)
    apply(r, made["manual playbook"], "failed")
    apply(r, made["deferred"])
    apply(r, made["node firing"])
    # The ladder's stage and the on_resolved of the node's alert after its resolve_timeout; then verdicts and
    # the ladder's last stage.
    now = time.time()
    [undo] = reconciler(svc).tick(now + 121).resolved
    check("on_resolved (timeout)", undo)
    stage = stored(r, made["firing"]).get("next")
    assert stage, "the ladder made its stage"
    check("stage", stage)
    apply(r, stage)
    apply(r, undo)
    reconciler(svc).tick(now + 400)
    # A resolve notification of another alert of the node: on_resolved through the webhook.
    hot2 = alert("HotToo", node=NODE, gpu_id="1")
    [fired] = notify(http, hot2)
    check("node firing 2", fired["id"])
    apply(r, fired["id"])
    [resolved] = notify(http, {**hot2, "status": "resolved", "startsAt": STARTS[:19] + "Z",
                               "endsAt": "2026-11-22T02:00:00Z"})
    check("on_resolved (resolved)", resolved["id"])
    apply(r, resolved["id"])
    reconciler(svc).tick(now + 4000)
    reconciler(svc).tick(now + 8000)
    assert http.get("/history?limit=100").status_code == 200  # the history's fold writes its marks too
    assert stored(r, made["firing"]).get("outcome") and stored(r, stage).get("outcome")
    assert stored(r, made["manual playbook"])["status"] == "failed"

    everything = every_record(r)
    assert set(made.values()) <= set(everything)
    broken = [rid for rid in everything if not intact(r, rid)]
    assert broken == [], [(rid, stored(r, rid)) for rid in broken]
    assert tampered_count(r, svc) == 0


def test_no_script_writes_a_sealed_field_after_the_record_is_made() -> None:
    # DECIDE writes the record once, what was decided (`d`) and its seal among it; no other call of a script may
    # name either in a write to a hash.
    sealed = {"d", "seal"}
    offending = []
    for path in sorted((ROOT / "client" / "wire" / "lua").glob("*.lua")):
        text = path.read_text()
        for m in re.finditer(r"redis\.call\(\s*'(HSET|HSETNX|HMSET|HDEL|HINCRBY|HINCRBYFLOAT)'", text):
            depth, i = 0, m.start() + len("redis.call")
            while True:  # the whole call, over lines
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
                if depth == 0:
                    break
            call = text[m.start():i]
            names = set(re.findall(r"'([^']*)'", call)) | set(re.findall(r'"([^"]*)"', call))
            bad = names & sealed
            if bad:
                offending.append((path.name, text[:m.start()].count("\n") + 1, sorted(bad)))
    assert offending == []
    # The service's own marks on a record (record.mark_once / set_marks) never name one either.
    calls = [c for path in sorted((ROOT / "service").rglob("*.py"))
             for c in re.findall(r"record\.(?:mark_once|set_marks)\(([^)]*)\)", path.read_text())]
    assert len(calls) >= 5, calls
    named = set()
    for call in calls:
        named |= set(re.findall(r'"([^"{]+)"', call)) | set(re.findall(r"(\w+)=", call))
    assert "ladder_end" in named and "silence_id" in named
    assert not named & sealed, named & sealed


# -- silences: made from the record's alert as decided, and only the one made is ever expired -----------------

QUIET = """\
playbooks:
  - name: quiet
    matchers: ['alertname="Loss"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
    verify: 15m
    silence: true
    escalate: [{after: 10m, actions: [{set_lr: {lr: 0.01}}]}]
"""


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.support.stack import Alertmanager

    am = Alertmanager(tmp_path_factory.mktemp("am"), "http://127.0.0.1:9/webhook", "unused")
    yield am
    am.stop()


def silences(am: Any, state: str = "active") -> dict[str, dict]:
    return {s["id"]: s for s in am.silences() if s["status"]["state"] == state}


def test_a_silence_is_never_made_from_a_rewritten_alert_nor_another_silence_expired(
        r: redis.Redis, make_app: Any, tmp_path: Path, alertmanager: Any) -> None:
    import requests

    app = make_app(playbooks=str(write_playbooks(tmp_path / "quiet.yaml", QUIET)),
                   alertmanager_urls=(alertmanager.url,))
    http = app.test_client()
    before = set(silences(alertmanager))
    # A record whose alert labels were rewritten (to silence another job's alerts): no silence at all.
    forged = fire(http, "Loss", job_name=JOB, fingerprint="f0f0f0f0f0f0f0f0")
    rewrite(r, forged, lambda d: d["a"].__setitem__("labels", {"job_name": "someone-else"}))
    apply(r, forged)
    reconciler(app).tick()
    got = records.get(r, forged)
    assert got is not None and got["silence_id"] is None and "changed in Redis" in (got["silence_error"] or "")
    assert set(silences(alertmanager)) == before and tampered_count(r, app) == 1
    reconciler(app).tick(time.time() + 1)
    assert tampered_count(r, app) == 1, "counted once"

    # An intact ladder gets its silence; a person's own silence, whose id was written into the record,
    # is not expired when the ladder ends (the one trainmedic made ends at its endsAt).
    job2 = "seal-job-2"
    first = fire(http, "Loss", job_name=job2)
    apply(r, first)
    reconciler(app).tick()
    made = records.get(r, first)
    assert made is not None and made["silence_id"] in silences(alertmanager)
    theirs = requests.post(alertmanager.url + "/api/v2/silences", timeout=5, json={
        "matchers": [{"name": "alertname", "value": "Maintenance", "isRegex": False, "isEqual": True}],
        "startsAt": "2020-01-01T00:00:00Z", "endsAt": "2099-01-01T00:00:00Z", "createdBy": "a person",
        "comment": "rack maintenance"}).json()["silenceID"]
    r.hset(keys.record(first), "silence_id", theirs)
    notify(http, {**alert("Loss", "resolved", job_name=job2)})
    reconciler(app).tick(time.time() + 2)
    assert r.hget(keys.record(first), "ladder_end") == "resolved"
    assert theirs in silences(alertmanager), "a silence trainmedic did not make is left alone"
    assert tampered_count(r, app) == 2


def test_the_silence_a_ladder_made_is_expired_when_it_ends(r: redis.Redis, make_app: Any, tmp_path: Path,
                                                            alertmanager: Any) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "quiet.yaml", QUIET)),
                   alertmanager_urls=(alertmanager.url,))
    http = app.test_client()
    job3 = "seal-job-3"
    first = fire(http, "Loss", job_name=job3)
    apply(r, first)
    reconciler(app).tick()
    sid = (records.get(r, first) or {})["silence_id"]
    assert sid in silences(alertmanager) and r.hget(keys.record(first), "silence_seal")
    notify(http, alert("Loss", "resolved", job_name=job3))
    reconciler(app).tick(time.time() + 2)
    assert r.hget(keys.record(first), "ladder_end") == "resolved"
    assert sid in silences(alertmanager, "expired") and tampered_count(r, app) == 0
