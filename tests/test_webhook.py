"""POST /webhook: every status code the README lists, auth, bad input, hostile labels."""
from __future__ import annotations

import copy
import json
from datetime import datetime

import pytest

from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire import keys
from trainmedic.service.store import record as records

from tests.conftest import AUTH, TOKEN, load_fixture, post_json
from tests.support.jobs import entry_command, episode


def mailbox(r, kind: str, name: str) -> list:
    return r.xrange(keys.mailbox(keys.Target(kind, name)))


def all_mailbox_entries(r) -> int:
    return sum(r.xlen(k) for k in r.scan_iter(match="trainmedic:*:mailbox"))


def test_a_firing_alert_is_recorded_and_dispatched(http, r) -> None:
    resp = post_json(http, "/webhook", load_fixture("firing_single.json"))
    assert resp.status_code == 200
    [rem] = resp.json["remediations"]
    assert rem["status"] == "dispatched" and rem["playbook"] == "loss-spike"
    [(_, fields)] = mailbox(r, "job", "llama-ft-01")
    cmd = entry_command(r, keys.Target("job", "llama-ft-01"), fields)[0]
    assert cmd.record_id == rem["id"]
    assert [a.action for a in cmd.actions] == ["rollback_checkpoint", "scale_lr"]
    assert cmd.actions[1].params == {"factor": 0.5, "min_lr": 1e-7}
    rec = http.get(f"/remediations/{rem['id']}").json
    assert rec["status"] == "dispatched" and rec["target"] == {"kind": "job", "name": "llama-ft-01"}
    assert rec["alert"]["fingerprint"] == "071ff15f8faead0f"
    assert [a["status"] for a in rec["actions"]] == ["pending", "pending"]


def test_a_record_is_what_was_decided_in_one_value_and_what_changes_beside_it(http, r) -> None:
    Mailbox(r, keys.Target("job", "llama-ft-01")).heartbeat({"kind": "job", "pid": 42, "step": 7})  # no reason
    [rem] = post_json(http, "/webhook", load_fixture("firing_single.json")).json["remediations"]
    stored = r.hgetall(keys.record(rem["id"]))
    # What was decided, its seal, and what a dispatched record has that changes later; nothing its id holds
    # (id, target, created_at), nothing empty (detail, context, reason), no second copy of the command.
    assert set(stored) == {"d", "seal", "status", "as", "exp", "sig", "v", "f"}
    assert stored["as"] == "PP" and stored["status"] == "dispatched"
    decided = json.loads(stored["d"])
    # Nor what holds the usual value (mode firing, requested by the webhook, no context, the episode's start as
    # the alert's startsAt to the second).
    assert set(decided) == {"p", "a", "s", "x"} and decided["p"] == "loss-spike" and decided["x"] == 3600
    assert decided["s"] == [["rollback_checkpoint", {}, {"o": True}], ["scale_lr", {"factor": 0.5, "min_lr": 1e-07}]]
    sent = load_fixture("firing_single.json")["alerts"][0]
    assert sent["startsAt"] == "2026-11-22T01:25:24.115697517Z"
    rec = records.load(r, rem["id"])
    assert rec is not None and rec.start == "2026-11-22T01:25:24Z"
    [(_, entry)] = mailbox(r, "job", "llama-ft-01")
    fence = f"{sent['fingerprint']}|2026-11-22T01:25:24Z|loss-spike|0|firing"
    assert entry_command(r, keys.Target("job", "llama-ft-01"), entry)[0].fence == fence == rec.fence
    shown = http.get(f"/remediations/{rem['id']}").json
    assert shown["id"] == rem["id"] and shown["target"] == {"kind": "job", "name": "llama-ft-01"}
    made = datetime.fromisoformat(shown["created_at"].replace("Z", "+00:00")).timestamp()
    assert abs(made - rec.created_ms / 1000) < 0.001 and shown["created_at"].endswith("Z")
    assert shown["reason"] is None and "detail" not in shown and shown["requested_by"] == "webhook"
    assert "on_resolved" not in shown
    # The alert leaves out Alertmanager's "not ended" time, truncated: false, a firing alert's status and the
    # alertname label.
    assert not {"ends_at", "truncated", "status"} & set(decided["a"])
    assert shown["alert"]["status"] == "firing"
    assert "alertname" not in decided["a"]["labels"]
    assert shown["alert"]["labels"] == sent["labels"] and shown["alert"]["ends_at"] == sent["endsAt"]
    assert shown["alert"]["truncated"] is False and shown["alert"]["alertname"] == sent["labels"]["alertname"]
    # A record an earlier version wrote (every decided value in a field of its own) reads exactly as it did.
    earlier = {"id": rem["id"], "target": json.dumps(shown["target"]), "created_at": shown["created_at"],
               "created_ms": rec.created_ms, "detail": "", "context": "{}", "alert": json.dumps(shown["alert"]),
               "mode": "firing", "requested_by": "webhook", "fence": fence, "expire_after": 3600,
               "start": "2026-11-22T01:25:24Z", "playbook": "loss-spike", "n": 2, "status": "dispatched",
               "verify_ms": stored["v"], "follow": "1", "expires_ms": stored["exp"],
               "a:0:spec": json.dumps({"action": "rollback_checkpoint", "params": {}, "optional": True}),
               "a:1:spec": json.dumps({"action": "scale_lr", "params": {"factor": 0.5, "min_lr": 1e-07}}),
               "a:0:status": "pending", "a:1:status": "pending"}
    r.delete(keys.record(rem["id"]))
    r.hset(keys.record(rem["id"]), mapping=earlier)
    assert http.get(f"/remediations/{rem['id']}").json == shown
    earlier_rec = records.load(r, rem["id"])
    assert earlier_rec is not None and earlier_rec.fence == fence


def test_a_cooldown_skip_and_its_episode_keep_only_what_they_need(http, r) -> None:
    body = load_fixture("firing_single.json")
    [first] = post_json(http, "/webhook", body).json["remediations"]
    body["alerts"][0]["fingerprint"] = "0123456789abcdef"  # another alert of the job, within the cooldown
    [skip] = post_json(http, "/webhook", body).json["remediations"]
    assert (skip["status"], skip["reason"]) == ("skipped", "cooldown")
    stored = r.hgetall(keys.record(skip["id"]))
    # A skip nobody follows gets no outcome (no verify time), nor anything only a dispatch or a hold needs; its
    # actions are all skipped: the record says so once (its status), not once an action.
    assert set(stored) == {"d", "seal", "status", "reason"}
    shown = http.get(f"/remediations/{skip['id']}").json
    assert shown["requested_by"] == "webhook" and shown["outcome"] is None
    assert [a["status"] for a in shown["actions"]] == ["skipped"] * len(shown["actions"])
    # The episode keeps its record's 26-character head (the target is its key's); a resend is a duplicate
    # (test_dispatch: its answer names the whole id).
    ep = episode(r, keys.Target("job", "llama-ft-01"), "loss-spike", "0123456789abcdef")
    assert ep == {"open": "2026-11-22T01:25:24Z", "rid": skip["id"][:26]}
    again = post_json(http, "/webhook", body).json
    assert again["duplicates"] == 1 and again["remediations"] == []
    assert r.hget(keys.record(first["id"]), "status") == "dispatched"


def test_it_does_not_repeat_on_resend(http, r) -> None:
    body = load_fixture("firing_single.json")
    for _ in range(5):
        assert post_json(http, "/webhook", body).status_code == 200
    assert len(mailbox(r, "job", "llama-ft-01")) == 1
    assert len(http.get("/history").json["items"]) == 1


def test_a_group_change_does_not_repeat_an_alert_already_handled(http, r) -> None:
    single = load_fixture("firing_single.json")
    post_json(http, "/webhook", single)
    grown = copy.deepcopy(single)
    other = copy.deepcopy(single["alerts"][0])
    other["labels"]["job_name"] = "other-job"
    other["fingerprint"] = "aaaaaaaaaaaaaaaa"
    grown["alerts"].append(other)
    resp = post_json(http, "/webhook", grown)
    assert resp.json["duplicates"] == 1 and len(resp.json["remediations"]) == 1
    assert len(mailbox(r, "job", "llama-ft-01")) == 1 and len(mailbox(r, "job", "other-job")) == 1


def test_each_grouped_alert_goes_to_its_own_node(http, r) -> None:
    resp = post_json(http, "/webhook", load_fixture("firing_group.json"))
    assert {x["status"] for x in resp.json["remediations"]} == {"dispatched"}
    [(_, a)] = mailbox(r, "node", "gpu-node-01")
    [(_, b)] = mailbox(r, "node", "gpu-node-02")
    assert entry_command(r, keys.Target("node", "gpu-node-01"), a)[0].context == {"gpu_id": "0"}
    assert entry_command(r, keys.Target("node", "gpu-node-02"), b)[0].context == {"gpu_id": "3"}


def test_a_resolved_alert_runs_only_on_resolved(http, r) -> None:
    post_json(http, "/webhook", load_fixture("firing_group.json"))
    resolved = load_fixture("firing_group.json")
    resolved["status"] = "resolved"
    for a in resolved["alerts"]:
        a["status"] = "resolved"
        a["startsAt"] = a["startsAt"][:19] + "Z"  # resolved text differs; the episode is the same
    resp = post_json(http, "/webhook", resolved)
    assert [x["status"] for x in resp.json["remediations"]] == ["dispatched", "dispatched"]
    entries = mailbox(r, "node", "gpu-node-01")
    assert [a.action for a in entry_command(r, keys.Target("node", "gpu-node-01"), entries[-1][1])[0].actions] == [
        "restore_power_limit"]
    # A second resolved notification (an HA peer) runs nothing more.
    assert post_json(http, "/webhook", resolved).json["remediations"] == []
    assert len(mailbox(r, "node", "gpu-node-01")) == 2


def test_a_resolved_alert_without_on_resolved_actions_dispatches_nothing(http, r) -> None:
    post_json(http, "/webhook", load_fixture("firing_single.json"))
    resp = post_json(http, "/webhook", load_fixture("resolved.json"))
    assert resp.status_code == 200 and resp.json["remediations"] == []
    assert len(mailbox(r, "job", "llama-ft-01")) == 1


def test_a_new_episode_after_resolution_runs_again(http, r) -> None:
    post_json(http, "/webhook", load_fixture("firing_group.json"))
    resolved = load_fixture("firing_group.json")
    for a in resolved["alerts"]:
        a["status"] = "resolved"
    post_json(http, "/webhook", resolved)
    again = load_fixture("firing_group.json")
    again["alerts"] = again["alerts"][:1]
    again["alerts"][0]["startsAt"] = "2026-11-22T03:00:00.5Z"
    # The shipped GPU playbook has a 10 minute cooldown: the new episode is decided, and held back by it.
    [rem] = post_json(http, "/webhook", again).json["remediations"]
    assert rem["status"] == "skipped" and rem["reason"] == "cooldown"


def test_an_alert_no_playbook_matches_is_accepted_and_ignored(http, r) -> None:
    body = load_fixture("firing_single.json")
    body["alerts"][0]["labels"]["alertname"] = "SomethingElse"
    resp = post_json(http, "/webhook", body)
    assert resp.status_code == 200 and resp.json["remediations"] == []
    assert all_mailbox_entries(r) == 0


def test_a_playbook_without_actions_is_recorded_for_review(make_app, r, tmp_path) -> None:
    path = tmp_path / "review.yaml"
    path.write_text("playbooks:\n  - name: review\n    matchers: ['alertname=\"TrainingThroughputDrop\"']\n"
                    "    target: job\n    actions: []\n")
    body = load_fixture("firing_single.json")
    body["alerts"][0]["labels"]["alertname"] = "TrainingThroughputDrop"
    [rem] = post_json(make_app(playbooks=str(path)).test_client(), "/webhook", body).json["remediations"]
    assert rem["status"] == "skipped" and rem["reason"] == "no_actions"
    assert all_mailbox_entries(r) == 0


# -- auth
def test_a_missing_token_is_401(http, r) -> None:
    resp = post_json(http, "/webhook", load_fixture("firing_single.json"), headers={})
    assert resp.status_code == 401 and "Bearer" in resp.json["error"]
    assert all_mailbox_entries(r) == 0


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}x", "Bearer ", f"Basic {TOKEN}", TOKEN, "Bearer s3cret"])
def test_a_wrong_token_is_401(http, r, header: str) -> None:
    resp = post_json(http, "/webhook", load_fixture("firing_single.json"), headers={"Authorization": header})
    assert resp.status_code == 401
    assert all_mailbox_entries(r) == 0


def test_without_a_token_only_loopback_may_write(make_app, r) -> None:
    http = make_app(webhook_token=None).test_client()
    body = json.dumps(load_fixture("firing_single.json"))
    far = http.post("/webhook", data=body, content_type="application/json",
                    environ_base={"REMOTE_ADDR": "10.1.2.3"})
    assert far.status_code == 403 and all_mailbox_entries(r) == 0
    near = http.post("/webhook", data=body, content_type="application/json",
                     environ_base={"REMOTE_ADDR": "127.0.0.1"})
    assert near.status_code == 200


# -- bad input: contract status, never a 5xx, nothing dispatched
def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


BAD_BODIES = [
    ("invalid json", b"{not json", "application/json", 400),
    ("empty body", b"", "application/json", 400),
    ("a list", b"[]", "application/json", 400),
    ("a string", b'"hi"', "application/json", 400),
    ("alerts is an object", b'{"version":"4","alerts":{}}', "application/json", 400),
    ("alert is a number", b'{"version":"4","alerts":[1]}', "application/json", 400),
    ("labels not strings",
     b'{"alerts":[{"status":"firing","labels":{"alertname":1},"startsAt":"2026-01-01T00:00:00Z"}]}',
     "application/json", 400),
    ("labels nested",
     b'{"alerts":[{"status":"firing","labels":{"alertname":{"a":"b"}},"startsAt":"2026-01-01T00:00:00Z"}]}',
     "application/json", 400),
    ("missing status", b'{"alerts":[{"labels":{"alertname":"X"},"startsAt":"2026-01-01T00:00:00Z"}]}',
     "application/json", 400),
    ("missing startsAt", b'{"alerts":[{"status":"firing","labels":{"alertname":"X"}}]}', "application/json", 400),
    ("wrong version", b'{"version":"5","alerts":[]}', "application/json", 400),
    ("deep nesting", _deep(100_000), "application/json", 400),
    ("deep nesting in labels", b'{"alerts":[{"labels":' + _deep(5000) + b'}]}', "application/json", 400),
    ("invalid utf-8", b'{"alerts":[{"labels":{"alertname":"\xff\xfe"}}]}', "application/json", 400),
    ("form content type", b'{"alerts":[]}', "application/x-www-form-urlencoded", 415),
    ("text content type", b'{"alerts":[]}', "text/plain", 415),
    ("oversized", b'{"pad":"' + b"x" * (1024 * 1024 + 10) + b'"}', "application/json", 413),
]


@pytest.mark.parametrize("name, body, ctype, status", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_bodies_get_their_contract_status(http, r, name: str, body: bytes, ctype: str, status: int) -> None:
    resp = http.post("/webhook", data=body, content_type=ctype, headers=AUTH)
    assert resp.status_code == status, resp.json
    assert isinstance(resp.json["error"], str) and "\n" not in resp.json["error"]
    assert all_mailbox_entries(r) == 0 and r.zcard(keys.HISTORY) == 0


HOSTILE = ["x; rm -rf /", "$(reboot)", "`id`", "../../etc/passwd", "..", "a\nb", "a" * 5000, "a b", "|cat",
           "job\x00name", "ü-job"]


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_target_labels_are_recorded_as_bad_label_and_never_dispatched(http, r, value: str) -> None:
    body = load_fixture("firing_single.json")
    body["alerts"][0]["labels"]["job_name"] = value
    resp = post_json(http, "/webhook", body)
    assert resp.status_code == 200
    [rem] = resp.json["remediations"]
    assert rem["status"] == "skipped" and rem["reason"] == "bad_label"
    rec = http.get(f"/remediations/{rem['id']}").json
    assert rec["alert"]["labels"]["job_name"] == value  # kept for review, as sent
    assert rec["target"]["name"] is None and all(a["status"] == "skipped" for a in rec["actions"])
    assert all_mailbox_entries(r) == 0


def test_a_hostile_gpu_label_on_a_node_alert_is_a_bad_label(http, r) -> None:
    body = load_fixture("firing_group.json")
    body["alerts"][0]["labels"]["gpu_id"] = "0 --help"
    rems = post_json(http, "/webhook", body).json["remediations"]
    assert [x["reason"] for x in rems] == ["bad_label", "no_live_target"]  # no agent runs on that node here
    assert all_mailbox_entries(r) == 1


def test_unknown_routes_and_methods_answer_json(http) -> None:
    assert http.get("/nope").status_code == 404 and http.get("/nope").json["error"]
    assert http.get("/webhook").status_code == 405
