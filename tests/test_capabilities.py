"""Out of the box and at decision time: the shipped playbooks never end red with a plain client and a plain
agent; a live target that cannot do a step gets it `unsupported` / `target_cannot` at once; a target nobody
runs is `no_live_target` on the record and the page (README: the shipped playbooks)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import redis

from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.service import history

from tests.conftest import load_fixture, post_json, write_playbooks
from tests.support.jobs import entry_command, wait_record
from tests.support.keyspaces import BOTH
from tests.support.loop import Loop
from tests.support.nvml import NvmlState

JOB = "llama-ft-01"
NODE = "gpu-node-01"


def fire(http: Any, alertname: str, fingerprint: str, status: str = "firing", **labels: str) -> list[dict]:
    body = load_fixture("firing_single.json")
    a = body["alerts"][0]
    a.update(status=status, fingerprint=fingerprint)
    a["labels"] = {"alertname": alertname, "severity": "critical", **labels}
    if status == "resolved":
        a["endsAt"] = "2026-11-22T09:00:00Z"
    body["status"] = status
    resp = post_json(http, "/webhook", body)
    assert resp.status_code == 200, resp.get_json()
    return resp.get_json()["remediations"]


def live(loop: Loop, r: redis.Redis, job: str = JOB) -> None:
    """Train until the job's first heartbeat is in Redis and the service counts the job live."""
    deadline = time.monotonic() + 10
    label = keys.Target("job", job).label
    while not (r.get(keys.heartbeat(keys.Target("job", job)))
               and float(r.zscore(keys.live("job"), label) or 0) > time.time() * 1000):
        assert time.monotonic() < deadline, "no heartbeat"
        loop.tick()


def done(rec: dict | None) -> bool:
    return rec is not None and rec["status"] not in ("dispatched", "pending_approval")


def test_the_shipped_playbooks_out_of_the_box_end_applied_or_skipped_never_red(
        app: Any, r: redis.Redis, redis_url: str, agents: Any, nvml_lib: Path, nvml_state: NvmlState,
        tmp_path: Path) -> None:
    http = app.test_client()
    loop = Loop(redis_url, JOB)  # a plain client: an optimizer, no handlers, no CUDA
    (tmp_path / "ckpts").mkdir()
    agent = agents(NODE, lib_dir=nvml_lib, state=nvml_state, allow_roots=[tmp_path / "ckpts"],
                   args=["--scheduler", "none"])
    agent.wait_ready(r)
    live(loop, r)
    made = []
    made += fire(http, "GPUTemperatureHigh", "a1", node=NODE, gpu_id="0")
    made += fire(http, "GPUMemoryUsageHigh", "a2", job_name=JOB)
    made += fire(http, "TrainingLossSpike", "a3", job_name=JOB)
    made += fire(http, "DiskSpaceLow", "a4", node=NODE, mountpoint="/")
    made += fire(http, "TrainingThroughputDrop", "a5", job_name=JOB)
    [held] = fire(http, "GPUXidError", "a6", node=NODE, xid_class="drain")
    assert held["status"] == "pending_approval"
    assert post_json(http, f"/remediations/{held['id']}/approve", {}).status_code == 200
    made.append(held)
    assert len(made) == 6
    got = {}
    def step() -> None:
        loop.tick()
        app.extensions["trainmedic"].reconciler.tick()  # checkpoint_jobs is carried out by the reconciler

    for m in made:
        rec = wait_record(r, m["id"], done, tick=step)
        got[rec["playbook"]] = rec
    statuses = {name: rec["status"] for name, rec in got.items()}
    assert statuses == {"gpu-temperature-high": "applied", "gpu-memory-high": "skipped", "loss-spike": "applied",
                        "disk-space-low": "applied", "throughput-drop": "skipped", "gpu-xid-error": "skipped"}, statuses
    steps = {name: [(a["action"], a["status"], a["reason"]) for a in rec["actions"]] for name, rec in got.items()}
    assert steps["loss-spike"] == [("rollback_checkpoint", "skipped", "unsupported"), ("scale_lr", "applied", None)]
    assert steps["gpu-memory-high"] == [("empty_cache", "skipped", "no_cuda"),
                                        ("reduce_batch_size", "skipped", "unsupported")]
    assert steps["gpu-xid-error"] == [("checkpoint_jobs", "skipped", "no_jobs"),
                                      ("drain_node", "skipped", "unsupported")]
    assert [s for _, s, _ in steps["throughput-drop"]] == ["skipped", "skipped"]
    [restore] = fire(http, "GPUTemperatureHigh", "a1", status="resolved", node=NODE, gpu_id="0")
    assert wait_record(r, restore["id"], done)["status"] == "applied"
    # The page says so too: no red badge anywhere.
    page = http.get("/").get_data(as_text=True)
    assert "st-failed" not in page and "st-partially_applied" not in page
    loop.rc.close()


PLAYBOOKS = """\
playbooks:
  - name: halve-and-save
    matchers: ['alertname="SaveMe"']
    target: job
    actions:
      - scale_lr: {factor: 0.5}
      - save_checkpoint: {}
  - name: save-only
    matchers: ['alertname="SaveOnly"']
    target: job
    actions: [{save_checkpoint: {}}]
"""


def test_a_live_target_that_cannot_do_a_step_has_it_unsupported_at_once_and_the_rest_still_goes(
        make_app: Any, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    http = make_app(playbooks=str(write_playbooks(tmp_path / "p.yaml", PLAYBOOKS))).test_client()
    loop = Loop(redis_url, JOB)
    live(loop, r)
    heartbeat = [t for t in http.get("/targets").get_json()["targets"] if t["name"] == JOB][0]
    assert heartbeat["actions"] == ["empty_cache", "scale_lr", "set_lr"]
    [made] = fire(http, "SaveMe", "b1", job_name=JOB)
    rec = records.get(r, made["id"])
    assert rec is not None and rec["status"] == "dispatched"
    save = rec["actions"][1]
    assert (save["status"], save["reason"]) == ("unsupported", "target_cannot") and save["acked_at"]
    assert "cannot apply save_checkpoint" in save["result"]["message"]
    # What the command holds (the client may have taken it already: rebuilt from the record, as it did).
    sent = entry_command(r, keys.Target("job", JOB), {"r": made["id"]})[0]
    assert [a.action for a in sent.actions] == ["scale_lr"]
    rec = wait_record(r, made["id"], done, tick=loop.tick)
    assert rec["status"] == "partially_applied" and rec["actions"][0]["status"] == "applied"
    # Nothing it can do: the record settles at once, nothing is sent.
    [only] = fire(http, "SaveOnly", "b2", job_name=JOB)
    assert only["status"] == "failed"
    assert records.get(r, only["id"])["outcome"] == {"status": "unknown", "resolved_at": None,  # type: ignore[index]
                                                     "time_to_resolve_s": None}
    assert r.xinfo_stream(keys.mailbox(keys.Target("job", JOB)))["entries-added"] == 1  # nothing more was sent
    loop.rc.close()


def test_a_target_nobody_runs_is_no_live_target_until_a_process_takes_the_command(
        make_app: Any, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    http = make_app(playbooks=str(write_playbooks(tmp_path / "p.yaml", PLAYBOOKS))).test_client()
    [made] = fire(http, "SaveMe", "c1", job_name="nobody-runs-me")
    assert (made["status"], made["reason"]) == ("dispatched", "no_live_target")
    rec = records.get(r, made["id"])
    assert rec is not None and [a["status"] for a in rec["actions"]] == ["pending", "pending"]
    page = http.get("/targets/job/nobody-runs-me").get_data(as_text=True)
    assert "no live target" in page
    assert json.loads(r.hget(keys.record(made["id"]), "d") or "{}")["s"][0][0] == "scale_lr"
    # A process of the job starts later: it takes the command; the record no longer says nobody is there.
    loop = Loop(redis_url, "nobody-runs-me")
    loop.rc.register("save_checkpoint", lambda params: {"path": "/tmp/x.pt"})
    rec = wait_record(r, made["id"], done, tick=loop.tick)
    assert rec["status"] == "applied" and rec["reason"] is None
    loop.rc.close()


def test_a_handler_registered_after_start_is_in_the_next_heartbeat_within_a_second(
        r: redis.Redis, redis_url: str) -> None:
    loop = Loop(redis_url, JOB, heartbeat_interval=30.0)  # the regular beat would be 30 s away
    t0 = time.monotonic()
    while not r.get(keys.heartbeat(keys.Target("job", JOB))):
        assert time.monotonic() - t0 < 10, "no heartbeat"
        loop.tick()
    loop.rc.register("save_checkpoint", lambda params: {"path": "/tmp/x.pt"})
    t0 = time.monotonic()
    while "save_checkpoint" not in json.loads(r.get(keys.heartbeat(keys.Target("job", JOB))) or "{}")["actions"]:
        assert time.monotonic() - t0 < 5, "the heartbeat did not list the new handler"
        loop.tick()
    loop.rc.close()


@BOTH
def test_decide_reads_the_heartbeat_itself_and_the_service_reads_it_only_when_the_command_must_change(
        make_app: Any, r: redis.Redis, tmp_path: Path) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "p.yaml", PLAYBOOKS)))
    http = app.test_client()
    dispatcher = app.extensions["trainmedic"].dispatcher
    read: list[str] = []  # the targets whose heartbeat the service read itself
    service_read = dispatcher.reach
    dispatcher.reach = lambda targets: (read.extend(sorted(t.name for t in targets)), service_read(targets))[1]
    beats = {"all-of-it": {"pid": 1, "actions": ["scale_lr", "save_checkpoint", "set_lr"]},
             "older-client": {"pid": 2}, "not-json": None, "cannot-save": {"pid": 3, "actions": ["scale_lr"]}}
    for job, beat in beats.items():
        r.set(keys.heartbeat(keys.Target("job", job)), "{not json" if beat is None else json.dumps(beat), ex=60)
    made = {job: fire(http, "SaveMe", f"h{len(job)}{job[:3]}", job_name=job)[0] for job in [*beats, "nobody"]}
    for job in ("all-of-it", "older-client", "not-json"):  # every step goes out; someone is there
        rec = records.get(r, made[job]["id"])
        assert rec is not None and (rec["status"], rec["reason"]) == ("dispatched", None), job
        assert [a["status"] for a in rec["actions"]] == ["pending", "pending"], job
        [(_, fields)] = r.xrange(keys.mailbox(keys.Target("job", job)))
        sent = entry_command(r, keys.Target("job", job), fields)[0]
        assert [a.action for a in sent.actions] == ["scale_lr", "save_checkpoint"], job
    assert (made["nobody"]["status"], made["nobody"]["reason"]) == ("dispatched", "no_live_target")
    cut = records.get(r, made["cannot-save"]["id"])
    assert cut is not None and cut["actions"][1]["reason"] == "target_cannot"
    [(_, fields)] = r.xrange(keys.mailbox(keys.Target("job", "cannot-save")))
    assert [a.action for a in entry_command(r, keys.Target("job", "cannot-save"), fields)[0].actions] == ["scale_lr"]
    history.catch_up(r)
    assert len(r.zrange(keys.HISTORY, 0, -1)) == 5  # the pairs decided twice are listed once
    # DECIDE read every heartbeat itself; the service read one only for the three whose command did not fit.
    assert sorted(read) == ["cannot-save", "not-json", "older-client"]
