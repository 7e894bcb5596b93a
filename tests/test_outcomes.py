"""Did it work? Outcomes, escalation ladders and notifications, driven through the webhook and the reconciler
with the real Redis (README: "Did it work?"). Time is the reconciler's `now`."""
from __future__ import annotations

import re
import threading
import time
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import pytest

from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.client.wire.protocol import Ack
from trainmedic.service.rules.playbooks import check

from tests.conftest import post_json, write_playbooks
from tests.support.receiver import Receiver

JOB = "llama-ft-01"
TARGET = keys.Target("job", JOB)
PUBLIC = "https://trainmedic.example.org"
EXPR_URL = "http://prometheus:9090/graph?g0.expr=training_loss+%3E+2&g0.tab=1"

PLAYBOOKS = """\
playbooks:
  - name: loss-ladder
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    actions: [{{scale_lr: {{factor: 0.5}}}}]
    verify: 15m
    escalate:
      - after: 10m
        actions: [{{scale_lr: {{factor: 0.5}}}}]
      - after: 20m
        actions: [{{save_checkpoint: {{}}}}, {{stop_training: {{}}}}]
    cooldown: 1h
    max_runs: {{count: 10, per: 24h}}
    notify: {notify}
  - name: hot
    matchers: ['alertname="Hot"']
    target: job
    actions: [{{scale_lr: {{factor: 0.5}}}}]
    verify: 1m
    notify: {notify}
  - name: one-run
    matchers: ['alertname="OneRun"']
    target: job
    actions: [{{scale_lr: {{factor: 0.5}}}}]
    escalate: [{{after: 2m, actions: [{{scale_lr: {{factor: 0.5}}}}]}}]
    max_runs: {{count: 1, per: 24h}}
    cooldown: 1h
    notify: {notify}
  - name: ask-first
    matchers: ['alertname="AskFirst"']
    target: job
    actions: [{{scale_lr: {{factor: 0.5}}}}]
    escalate: [{{after: 2m, actions: [{{stop_training: {{}}}}]}}]
    approval: true
    notify: {notify}
"""


@pytest.fixture
def hook() -> Any:
    receiver = Receiver()
    yield receiver
    receiver.close()


@pytest.fixture
def svc(make_app: Any, tmp_path: Path, hook: Receiver) -> Any:
    path = write_playbooks(tmp_path / "ladder.yaml", PLAYBOOKS.format(notify=hook.url))
    return make_app(playbooks=str(path), public_url=PUBLIC)


def utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


STARTS = utc(time.time() - 120)


def notify(http: Any, status: str, alertname: str = "TrainingLossSpike", ends: str | None = None,
           starts: str = STARTS, fingerprint: str = "f00d") -> Any:
    alert = {"status": status, "labels": {"alertname": alertname, "job_name": JOB, "severity": "critical"},
             "annotations": {"summary": "loss <3x> & rising"}, "startsAt": starts,
             "endsAt": ends or "0001-01-01T00:00:00Z", "generatorURL": EXPR_URL, "fingerprint": fingerprint}
    resp = post_json(http, "/webhook", {"version": "4", "status": status, "receiver": "trainmedic", "alerts": [alert]})
    assert resp.status_code == 200, resp.get_json()
    return resp.get_json()


def fire(http: Any, alertname: str = "TrainingLossSpike") -> str:
    [made] = notify(http, "firing", alertname)["remediations"]
    return str(made["id"])


def apply(r: Any, rid: str, status: str = "applied") -> float:
    """Claim and acknowledge every action of a record as a training process would; the time of the last ack."""
    box = Mailbox(r, TARGET)
    [entry] = [e for e in box.fetch() if e.command is not None and e.command.record_id == rid]
    assert box.claim(entry, "gpu-1:4242") == "ok"
    assert entry.command is not None
    box.ack([Ack(rid, a.index, a.action, status, {"step": 10}, "gpu-1:4242", reason=None if status == "applied"
                 else "boom") for a in entry.command.actions])
    return time.time()


def rec(r: Any, rid: str) -> dict:
    got = records.get(r, rid)
    assert got is not None
    return got


def reconciler(app: Any) -> Any:
    return app.extensions["trainmedic"].reconciler


def test_a_remediation_that_works_is_pending_then_effective_timed_from_the_last_ack_to_ends_at(
        r: Any, svc: Any) -> None:
    http = svc.test_client()
    rid = fire(http)
    assert rec(r, rid)["outcome"] is None  # nothing acknowledged yet
    acked = apply(r, rid)
    assert rec(r, rid)["outcome"] == {"status": "pending", "resolved_at": None, "time_to_resolve_s": None}
    reconciler(svc).tick()
    ends = utc(acked + 42.0)
    notify(http, "resolved", ends=ends)
    reconciler(svc).tick()
    outcome = rec(r, rid)["outcome"]
    assert outcome["status"] == "effective" and outcome["resolved_at"] == ends
    assert abs(outcome["time_to_resolve_s"] - 42.0) < 2.0  # the ack and `acked` differ by a stall at most
    assert [i["id"] for i in http.get("/history?outcome=effective").get_json()["items"]] == [rid]
    assert http.get("/history?outcome=pending").get_json()["items"] == []
    # GET /playbooks: counts over 30 days, the time to resolve, the notify URL as its host only.
    items = {p["name"]: p for p in http.get("/playbooks").get_json()["items"]}
    ladder = items["loss-ladder"]
    assert ladder["outcomes"] == {"effective": 1, "ineffective": 0, "pending": 0, "unknown": 0}
    assert abs(ladder["time_to_resolve_s"]["median"] - 42.0) < 2.0
    assert ladder["time_to_resolve_s"]["p90"] == ladder["time_to_resolve_s"]["median"]
    assert ladder["settings"]["notify"] == "127.0.0.1" and "services" not in str(ladder)
    assert ladder["settings"]["escalate"][1]["after_s"] == 1200
    assert items["hot"]["time_to_resolve_s"] == {"median": None, "p90": None}
    metrics = http.get("/metrics").get_data(as_text=True)
    assert 'trainmedic_remediation_outcomes_total{outcome="pending",playbook="loss-ladder"} 1.0' in metrics
    assert 'trainmedic_remediation_outcomes_total{outcome="effective",playbook="loss-ladder"} 1.0' in metrics
    assert 'trainmedic_time_to_resolve_seconds_bucket{le="60.0",playbook="loss-ladder"} 1.0' in metrics
    assert 'trainmedic_time_to_resolve_seconds_bucket{le="30.0",playbook="loss-ladder"} 0.0' in metrics
    # The alert resolved: the ladder is over, no stage ever runs, nobody is told anything.
    reconciler(svc).tick(time.time() + 3600)
    assert rec(r, rid)["escalation"]["next"] is None and r.hget(keys.record(rid), "ladder_end") == "resolved"


def test_without_alertmanager_still_firing_5_minutes_after_verify_is_ineffective_and_people_hear_once(
        r: Any, svc: Any, hook: Receiver) -> None:
    http = svc.test_client()
    rid = fire(http, "Hot")
    acked = apply(r, rid)
    reconciler(svc).tick(acked + 61)  # verify (1m) has passed, but without the API: wait 5 more minutes
    assert rec(r, rid)["outcome"]["status"] == "pending"
    reconciler(svc).tick(acked + 60 + 301)
    assert rec(r, rid)["outcome"] == {"status": "ineffective", "resolved_at": None, "time_to_resolve_s": None}
    [text] = hook.wait(1)
    assert hook.bodies == [{"text": text}]  # Slack's incoming-webhook shape, nothing else
    assert f"<{PUBLIC}/records/{rid}|hot on job:{JOB}>" in text
    assert "was ineffective" in text and "ended its escalation ladder unresolved" in text
    reconciler(svc).tick(acked + 60 + 400)
    time.sleep(0.3)
    assert len(hook.bodies) == 1, "each event of a record is notified once"
    assert http.get("/history?outcome=ineffective").get_json()["items"][0]["id"] == rid


def test_a_dispatched_remediation_that_applied_nothing_is_unknown_and_ends_its_ladder(
        r: Any, svc: Any, hook: Receiver) -> None:
    http = svc.test_client()
    rid = fire(http)
    acked = apply(r, rid, status="failed")
    got = rec(r, rid)
    assert got["status"] == "failed" and got["outcome"]["status"] == "unknown"
    reconciler(svc).tick(acked + 1)
    [text] = hook.wait(1)
    assert "failed: none of its actions was applied" in text and "unresolved" in text
    reconciler(svc).tick(acked + 3600)
    assert rec(r, rid)["escalation"]["next"] is None, "a stage that applied nothing ends the ladder"
    assert len(http.get("/history").get_json()["items"]) == 1


def test_a_record_whose_every_action_was_skipped_has_no_outcome_and_ends_its_ladder(
        r: Any, svc: Any, hook: Receiver) -> None:
    http = svc.test_client()
    rid = fire(http)
    acked = apply(r, rid, status="skipped")
    got = rec(r, rid)
    # As for any other skip: nothing was dispatched that could have worked, so there is nothing to judge.
    assert got["status"] == "skipped" and got["outcome"] is None
    reconciler(svc).tick(acked + 3600)
    got = rec(r, rid)
    assert got["outcome"] is None and got["escalation"]["next"] is None, "a stage that applied nothing ends it"
    assert http.get("/history?outcome=unknown").get_json()["items"] == []
    assert http.get("/playbooks").get_json()["items"][0]["outcomes"]["unknown"] == 0


def test_a_ladder_runs_each_stage_once_while_the_alert_fires_and_ends_unresolved(
        r: Any, svc: Any, hook: Receiver) -> None:
    http = svc.test_client()
    first = fire(http)
    acked = apply(r, first)
    reconciler(svc).tick(acked + 599)
    assert rec(r, first)["escalation"]["next"] is None  # 10 minutes have not passed
    # Two reconcilers (replicas) look at once: one stage is made.
    other = reconciler(svc).__class__(r, svc.extensions["trainmedic"].dispatcher,
                                      svc.extensions["trainmedic"].playbooks, reconciler(svc).settings)
    threads = [threading.Thread(target=x.tick, args=(acked + 601,)) for x in (reconciler(svc), other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stage1 = rec(r, first)["escalation"]["next"]
    assert stage1
    s1 = rec(r, stage1)
    assert s1["escalation"] == {"stage": 1, "parent": first, "next": None}
    assert s1["status"] == "dispatched" and s1["requested_by"] == "reconciler"
    assert [a["action"] for a in s1["actions"]] == ["scale_lr"] and s1["alert"]["fingerprint"] == "f00d"
    entry = next(e for e in Mailbox(r, TARGET).fetch() if e.command and e.command.record_id == stage1)
    assert entry.command is not None and entry.command.fence.endswith("|loss-ladder|1|firing")
    acked1 = apply(r, stage1)
    # Stage 0's verify passed meanwhile: ineffective (stage 1 is running, so the ladder goes on).
    reconciler(svc).tick(acked + 15 * 60 + 301)
    assert rec(r, first)["outcome"]["status"] == "ineffective"
    reconciler(svc).tick(acked1 + 20 * 60 + 1)
    stage2 = rec(r, stage1)["escalation"]["next"]
    s2 = rec(r, stage2)
    assert s2["escalation"]["stage"] == 2 and s2["escalation"]["parent"] == first
    assert [a["action"] for a in s2["actions"]] == ["save_checkpoint", "stop_training"]
    acked2 = apply(r, stage2)
    reconciler(svc).tick(acked2 + 15 * 60 + 301)
    assert rec(r, stage2)["outcome"]["status"] == "ineffective"
    assert r.hget(keys.record(first), "ladder_end") == "unresolved"
    reconciler(svc).tick(acked2 + 3 * 3600)
    items = http.get("/history?playbook=loss-ladder").get_json()["items"]
    assert sorted(i["escalation"]["stage"] for i in items) == [0, 1, 2], "each stage exactly once"
    texts = hook.wait(4)
    assert sum("ended its escalation ladder unresolved" in t for t in texts) == 1
    assert sum("was ineffective" in t for t in texts) == 3


def test_a_resolve_between_stages_means_the_next_stage_never_runs(r: Any, svc: Any, hook: Receiver) -> None:
    http = svc.test_client()
    first = fire(http)
    acked = apply(r, first)
    notify(http, "resolved", ends=utc(acked + 300))
    reconciler(svc).tick(acked + 601)
    got = rec(r, first)
    assert got["escalation"]["next"] is None and got["outcome"]["status"] == "effective"
    assert abs(got["outcome"]["time_to_resolve_s"] - 300) < 2.0
    assert hook.texts() == []


def test_stages_ignore_cooldown_but_count_against_the_budget(r: Any, svc: Any, hook: Receiver) -> None:
    http = svc.test_client()
    first = fire(http, "OneRun")
    acked = apply(r, first)
    reconciler(svc).tick(acked + 121)
    stage = rec(r, rec(r, first)["escalation"]["next"])
    # Not "cooldown" (the ladder's own stage 0 set it): the one run of the budget was spent by stage 0.
    assert (stage["status"], stage["reason"]) == ("skipped", "budget_exhausted")
    reconciler(svc).tick(acked + 122)
    assert r.hget(keys.record(first), "ladder_end") == "unresolved"
    assert any("unresolved" in t for t in hook.wait(1))


def test_approval_holds_each_stage_and_people_hear_of_each_hold(r: Any, svc: Any, hook: Receiver) -> None:
    http = svc.test_client()
    first = fire(http, "AskFirst")
    assert rec(r, first)["status"] == "pending_approval" and rec(r, first)["outcome"] is None
    reconciler(svc).tick()
    assert "is held for approval" in hook.wait(1)[0]
    resp = post_json(http, f"/remediations/{first}/approve", {"comment": "go"})
    assert resp.status_code == 200 and resp.get_json()["approved_by"] == "operator"
    acked = apply(r, first)
    reconciler(svc).tick(acked + 121)
    stage = rec(r, rec(r, first)["escalation"]["next"])
    assert stage["status"] == "pending_approval" and stage["escalation"]["stage"] == 1
    reconciler(svc).tick(acked + 122)
    texts = hook.wait(2)
    assert len(texts) == 2 and "(escalation stage 1)" in texts[1] and "held for approval" in texts[1]
    # Rejecting a held stage ends the ladder as a person's choice: no "unresolved" page.
    assert post_json(http, f"/remediations/{stage['id']}/reject", {}).status_code == 200
    reconciler(svc).tick(acked + 130)
    assert r.hget(keys.record(first), "ladder_end") == "rejected"
    time.sleep(0.2)
    assert len(hook.bodies) == 2


def test_a_new_service_picks_up_a_ladder_where_the_old_one_left_it(r: Any, svc: Any, make_app: Any,
                                                                   tmp_path: Path, hook: Receiver) -> None:
    first = fire(svc.test_client())
    acked = apply(r, first)
    reconciler(svc).tick(acked + 1)
    # The service restarts: a new app, nothing kept in memory; Redis holds the ladder.
    again = make_app(playbooks=str(tmp_path / "ladder.yaml"), public_url=PUBLIC)
    reconciler(again).tick(acked + 601)
    reconciler(svc).tick(acked + 602)
    reconciler(again).tick(acked + 603)
    items = again.test_client().get("/history").get_json()["items"]
    assert sorted(i["escalation"]["stage"] for i in items) == [0, 1]


def test_records_without_an_alert_to_answer_for_get_no_outcome(r: Any, svc: Any) -> None:
    resp = post_json(svc.test_client(), "/commands", {"target": f"job:{JOB}", "action": "scale_lr",
                                                      "params": {"factor": 0.5}})
    rid = resp.get_json()["id"]
    apply(r, rid)
    assert rec(r, rid)["outcome"] is None


LADDER_CHECK = """\
playbooks:
  - name: bad-ladder
    matchers: ['alertname="X"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    escalate:
      - after: 20s
        actions: [{power_limit: {fraction: 0.6}}]
      - after: 10m
        actions: [{restore_power_limit: {}}]
"""


def test_check_refuses_an_undo_in_a_ladder_and_warns_of_a_short_after(tmp_path: Path) -> None:
    path = write_playbooks(tmp_path / "x.yaml", LADDER_CHECK)
    _, problems = check([path])
    errors = [p for p in problems if ": warning: " not in p]
    warnings = [p for p in problems if ": warning: " in p]
    assert errors == [f"{path}:10: restore_power_limit undoes a remediation: it belongs in on_resolved, not in an "
                      "escalation stage"]
    assert len(warnings) == 1
    assert re.match(rf"{re.escape(str(path))}:7: warning: escalate\[0\]\.after is 20s", warnings[0])


def test_a_silence_playbook_without_alertmanager_refuses_to_start(make_app: Any, tmp_path: Path) -> None:
    text = ("playbooks:\n  - name: quiet\n    matchers: ['alertname=\"Q\"']\n    target: job\n"
            "    actions: [{empty_cache: {}}]\n    silence: true\n")
    path = write_playbooks(tmp_path / "s.yaml", text)
    with pytest.raises(ValueError, match="playbook quiet has silence: true, which needs TRAINMEDIC_ALERTMANAGER_URL"):
        make_app(playbooks=str(path))
    assert make_app(playbooks=str(path), alertmanager_urls=("http://127.0.0.1:9",)) is not None


def test_an_alertmanager_that_is_down_leaves_the_silence_unmade_and_says_so_on_the_record(
        r: Any, make_app: Any, tmp_path: Path) -> None:
    from trainmedic.service.embedded_redis import free_port

    text = ("playbooks:\n  - name: quiet\n    matchers: ['alertname=\"TrainingLossSpike\"']\n    target: job\n"
            "    actions: [{scale_lr: {factor: 0.5}}]\n    verify: 15m\n    silence: true\n")
    app = make_app(playbooks=str(write_playbooks(tmp_path / "s.yaml", text)),
                   alertmanager_urls=(f"http://127.0.0.1:{free_port()}",))  # nothing listens there
    http = app.test_client()
    rid = fire(http)
    acked = apply(r, rid)
    reconciler(app).tick(acked + 1)
    got = rec(r, rid)
    assert got["silence_id"] is None and got["status"] == "applied"  # the remediation itself went on
    assert got["silence_error"].startswith("the silence could not be made: ")
    reconciler(app).tick(acked + 2)
    assert rec(r, rid)["silence_error"] == got["silence_error"]  # not retried on every tick
    assert http.get(f"/records/{rid}").status_code == 200
    assert "the silence could not be made" in http.get(f"/records/{rid}").get_data(as_text=True)


def test_a_notice_escapes_alert_text_and_a_hook_that_keeps_failing_is_tried_three_times_then_given_up(
        caplog: Any) -> None:
    from trainmedic.service.decide.notify import Notice, Notifier

    notice = Notice("rid-1", "loss-spike", "job:x", "Loss<b>&</b>", 0, ("ineffective", "lost"), f"{PUBLIC}/r/rid-1")
    # Slack's markup is &, < and >: alert text shows literally and never reaches the link's own markup.
    assert notice.text.startswith(f"trainmedic: <{PUBLIC}/r/rid-1|loss-spike on job:x> for alert "
                                  "Loss&lt;b&gt;&amp;&lt;/b&gt; ")
    assert "was ineffective" in notice.text
    busy = Receiver(status=503)
    try:
        assert Notifier(None, timeout=2, retries=2).send(busy.url, notice) is False
        assert len(busy.bodies) == 3 and busy.bodies[0] == {"text": notice.text}
    finally:
        busy.close()
    assert any("not delivered: HTTP 503" in m and "/services/" not in m for m in caplog.messages)
