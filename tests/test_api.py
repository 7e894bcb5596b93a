"""Manual triggers, probes and live targets."""
from __future__ import annotations

import re
import time

from trainmedic.client.wire import keys
from trainmedic.client.receiver.mailbox import Mailbox

from tests.support.jobs import wait_until
from tests.conftest import ROOT, post_json


def test_a_manual_trigger_creates_a_record(http, r) -> None:
    resp = post_json(http, "/remediations", {"playbook": "loss-spike", "labels": {"job_name": "llama-ft-01"}})
    assert resp.status_code == 201
    rec = resp.json
    assert rec["status"] == "dispatched" and rec["target"]["name"] == "llama-ft-01"
    assert rec["alert"]["alertname"] == "manual:loss-spike"
    assert r.xlen(keys.mailbox(keys.Target("job", "llama-ft-01"))) == 1


def test_an_ad_hoc_command_names_its_alert_manual(http, r) -> None:
    resp = post_json(http, "/commands", {"target": "job:llama-ft-01", "action": "set_lr", "params": {"lr": 0.01}})
    assert resp.status_code == 201
    assert (resp.json["playbook"], resp.json["alert"]["alertname"]) == ("manual", "manual")


def test_a_manual_trigger_obeys_the_cooldown(http, r) -> None:
    body = {"playbook": "loss-spike", "labels": {"job_name": "llama-ft-01"}}
    post_json(http, "/remediations", body)
    second = post_json(http, "/remediations", body).json
    assert second["status"] == "skipped" and second["reason"] == "cooldown"


def test_manual_trigger_errors(http, r) -> None:
    assert post_json(http, "/remediations", {"playbook": "nope", "labels": {}}).status_code == 404
    assert post_json(http, "/remediations", {"labels": {}}).status_code == 400
    assert post_json(http, "/remediations", {"playbook": "loss-spike", "labels": {"a": 1}}).status_code == 400
    assert post_json(http, "/remediations", {"playbook": "loss-spike", "extra": 1}).status_code == 400
    assert post_json(http, "/remediations", {"playbook": "loss-spike"}, headers={}).status_code == 401
    assert r.zcard(keys.HISTORY) == 0


def test_a_manual_trigger_without_a_target_label_is_recorded_as_no_target(http, r) -> None:
    rec = post_json(http, "/remediations", {"playbook": "loss-spike", "labels": {}}).json
    assert rec["status"] == "skipped" and rec["reason"] == "no_target"


def test_probes(http, r) -> None:
    assert http.get("/healthz").json == {"status": "ok"}
    ready = http.get("/readyz")
    shipped = len(re.findall(r"^  - name: ", (ROOT / "playbooks" / "default.yaml").read_text(), re.M))
    assert ready.status_code == 200 and ready.json["playbooks"] == shipped == 10


def test_live_targets_are_listed_from_heartbeats(http, r) -> None:
    Mailbox(r, keys.Target("job", "llama-ft-01")).heartbeat({"kind": "job", "pid": 42, "step": 7}, announce=True)
    r.zadd(keys.TARGETS, {"job:gone": time.time() - 3600})
    [t] = wait_until(lambda: http.get("/targets").json["targets"], what="the job on /targets")
    assert t["name"] == "llama-ft-01" and t["pid"] == 42 and t["step"] == 7 and t["age_seconds"] < 5
