"""checkpoint_jobs: a node record has every job with a live process on the node save a checkpoint (a record of
its own, linked to the node's) before its later steps go out, once each job acknowledged or `timeout` passed.

Real Redis, real training clients in this process (their node from TRAINMEDIC_NODE), the app's own reconciler.
The whole path with Slurm, node agents and training processes is tests/e2e/test_checkpoint_drain.py.
"""
from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.service.decide import checkpoints

from tests.conftest import OP_AUTH, load_fixture, post_json, write_playbooks
from tests.support.jobs import entry_command, wait_record
from tests.support.loop import Loop

NODE = "gpu-node-7"
PLAYBOOKS = """\
playbooks:
  - name: xid
    matchers: ['alertname="GPUXidError"']
    target: node
    approval: true
    actions:
      - checkpoint_jobs: {timeout: 3s}
      - drain_node: {reason: "XID"}
  - name: save-then-throttle
    matchers: ['alertname="SaveFirst"']
    target: node
    actions:
      - checkpoint_jobs: {}
      - power_limit: {fraction: 0.8}
"""


def fire(http: Any, alertname: str, fingerprint: str, node: str = NODE) -> dict:
    body = load_fixture("firing_single.json")
    body["alerts"][0].update(fingerprint=fingerprint)
    body["alerts"][0]["labels"] = {"alertname": alertname, "node": node}
    [made] = post_json(http, "/webhook", body).get_json()["remediations"]
    return dict(made)


def saver(loop: Loop) -> list[int]:
    """Register a save_checkpoint handler that notes the step it ran at."""
    saved: list[int] = []

    @loop.rc.handler("save_checkpoint")
    def save(params: dict) -> dict:
        saved.append(loop.t)
        return {"path": f"/ckpt/{loop.rc.job}/step-{loop.t}", "step": loop.t}
    return saved


@pytest.fixture
def on_node(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> Any:
    made: list[Loop] = []

    def start(job: str, node: str = NODE) -> Loop:
        monkeypatch.setenv("TRAINMEDIC_NODE", node)
        loop = Loop(redis_url, job)
        made.append(loop)
        return loop
    yield start
    for loop in made:
        loop.rc.close()


def ready(r: redis.Redis, loop: Loop) -> bool:
    """The job heartbeats, its heartbeat lists its save_checkpoint handler, and the service counts it live."""
    raw = r.get(keys.heartbeat(loop.rc.target))
    return (bool(raw) and "save_checkpoint" in json.loads(raw).get("actions", [])
            and float(r.zscore(keys.live("job"), loop.rc.target.label) or 0) > time.time() * 1000)


def live(r: redis.Redis, *loops: Loop) -> None:
    deadline = time.monotonic() + 10
    while not all(ready(r, lp) for lp in loops):
        assert time.monotonic() < deadline, "no heartbeat"
        for lp in loops:
            lp.tick()


def test_after_approval_each_job_on_the_node_saves_then_the_drain_is_sent(
        make_app: Any, r: redis.Redis, tmp_path: Path, on_node: Any) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "p.yaml", PLAYBOOKS)))
    http = app.test_client()
    a, b, other = on_node("job-a"), on_node("job-b"), on_node("job-elsewhere", node="gpu-node-8")
    saved = {lp.rc.job: saver(lp) for lp in (a, b, other)}
    live(r, a, b, other)
    assert json.loads(r.get(keys.heartbeat(a.rc.target)))["node"] == NODE
    held = fire(http, "GPUXidError", "x1")
    assert held["status"] == "pending_approval"
    app.extensions["trainmedic"].reconciler.tick()
    assert not r.keys("trainmedic:{job:*}:rec:*"), "nothing is checkpointed before the approval"

    assert post_json(http, f"/remediations/{held['id']}/approve", {}).status_code == 200
    app.extensions["trainmedic"].reconciler.tick()
    node_rec = records.get(r, held["id"])
    assert node_rec is not None and node_rec["actions"][0]["status"] == "pending"
    assert r.hget(keys.record(held["id"]), "cmd") is None, "the drain waits for the checkpoints"

    def step() -> None:
        a.tick()
        b.tick()
        other.tick()
        app.extensions["trainmedic"].reconciler.tick()

    rec = wait_record(r, held["id"], lambda x: x is not None and x["actions"][0]["status"] != "pending", tick=step)
    first = rec["actions"][0]
    assert first["status"] == "applied" and first["acked_by"] == "service"
    assert first["result"]["waited"] == "acknowledged"
    jobs = {j["job"]: j for j in first["result"]["jobs"]}
    assert set(jobs) == {"job-a", "job-b"} and all(j["status"] == "applied" for j in jobs.values())
    assert saved["job-elsewhere"] == [] and len(saved["job-a"]) == 1 and len(saved["job-b"]) == 1
    for job, j in jobs.items():
        child = records.get(r, j["id"])
        assert child is not None and child["target"] == {"kind": "job", "name": job}
        assert child["escalation"]["parent"] == held["id"]
        assert child["requested_by"] == node_rec["requested_by"]
        assert [x["action"] for x in child["actions"]] == ["save_checkpoint"]
    # The drain went out after the checkpoints: it waits in the node's mailbox for its agent.
    assert rec["actions"][1]["status"] == "pending" and r.hget(keys.record(held["id"]), "sig")
    [entry] = r.xrange(keys.mailbox(keys.Target("node", NODE)))
    assert [c.action for c in entry_command(r, keys.Target("node", NODE), entry[1])[0].actions] == ["drain_node"]


def test_a_job_that_does_not_answer_holds_the_drain_only_until_the_timeout(
        make_app: Any, r: redis.Redis, tmp_path: Path, on_node: Any) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "p.yaml", PLAYBOOKS)))
    http = app.test_client()
    quick, stuck = on_node("job-quick"), on_node("job-stuck")
    saver(quick)
    saver(stuck)
    live(r, quick, stuck)
    held = fire(http, "GPUXidError", "x2")
    post_json(http, f"/remediations/{held['id']}/approve", {})
    t0 = time.monotonic()

    def step() -> None:
        quick.tick()  # job-stuck's loop never polls again: its heartbeat goes on, its step does not
        app.extensions["trainmedic"].reconciler.tick()
        time.sleep(0.05)

    rec = wait_record(r, held["id"], lambda x: x is not None and x["actions"][0]["status"] != "pending",
                      tick=step, timeout=20)
    assert time.monotonic() - t0 >= 2.5
    result = rec["actions"][0]["result"]
    assert result["waited"] == "timeout" and "timeout passed" in result["message"]
    assert {j["job"]: j["status"] for j in result["jobs"]} == {"job-quick": "applied", "job-stuck": "dispatched"}
    assert rec["actions"][0]["status"] == "applied"
    assert r.hget(keys.record(held["id"]), "sig"), "the drain went ahead"


def test_no_job_on_the_node_skips_the_step_and_a_restarted_reconciler_keeps_one_plan(
        make_app: Any, r: redis.Redis, tmp_path: Path, on_node: Any) -> None:
    path = str(write_playbooks(tmp_path / "p.yaml", PLAYBOOKS))
    app = make_app(playbooks=path)
    http = app.test_client()
    made = fire(http, "SaveFirst", "s1", node="gpu-node-9")
    app.extensions["trainmedic"].reconciler.tick()
    rec = records.get(r, made["id"])
    assert rec is not None
    assert (rec["actions"][0]["status"], rec["actions"][0]["reason"]) == ("skipped", "no_jobs")
    assert rec["actions"][1]["status"] == "pending"

    job = on_node("job-c", node="gpu-node-9")
    saver(job)
    live(r, job)
    made = fire(http, "SaveFirst", "s2", node="gpu-node-9")
    app.extensions["trainmedic"].reconciler.tick()
    plan = json.loads(r.hget(keys.record(made["id"]), "ckpt"))
    # Another replica (or this one restarted) carries on with the same plan and makes no second record.
    other = make_app(playbooks=path)
    other.extensions["trainmedic"].reconciler.tick()
    assert json.loads(r.hget(keys.record(made["id"]), "ckpt")) == plan
    assert len(r.keys("trainmedic:{job:job-c}:rec:*")) == 1

    def step() -> None:
        job.tick()
        other.extensions["trainmedic"].reconciler.tick()

    rec = wait_record(r, made["id"], lambda x: x is not None and x["actions"][0]["status"] != "pending", tick=step)
    assert rec["actions"][0]["result"]["jobs"][0]["id"] == plan["jobs"][0][1]
    assert rec["actions"][0]["status"] == "applied"


def page(http: Any, rid: str) -> str:
    resp = http.get(f"/records/{rid}", headers=OP_AUTH)
    assert resp.status_code == 200
    return html.unescape(resp.get_data(as_text=True))  # the text as a person reads it


def test_the_record_pages_link_the_node_and_its_jobs_and_say_how_the_wait_ended(
        make_app: Any, r: redis.Redis, tmp_path: Path, on_node: Any) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "p.yaml", PLAYBOOKS)))
    http = app.test_client()
    a, b = on_node("job-a"), on_node("job-b")
    saver(a)
    saver(b)
    live(r, a, b)
    held = fire(http, "GPUXidError", "p1")
    before = page(http, held["id"])
    assert "Once approved, each job with a live process on the node saves a checkpoint" in before
    post_json(http, f"/remediations/{held['id']}/approve", {})
    app.extensions["trainmedic"].reconciler.tick()

    # Waiting: the page names each planned job record, and until when the node's next actions wait.
    plan = dict(json.loads(r.hget(keys.record(held["id"]), "ckpt")))
    waiting = page(http, held["id"])
    assert "Waiting: the node's next actions go out once every job below acknowledged" in waiting
    for job, cid in plan["jobs"]:
        assert f'<a href="/records/{cid}">checkpoint of job {job}</a>' in waiting

    def step() -> None:
        a.tick()
        b.tick()
        app.extensions["trainmedic"].reconciler.tick()

    rec = wait_record(r, held["id"], lambda x: x is not None and x["actions"][0]["status"] != "pending", tick=step)
    done = page(http, held["id"])
    assert ("The node's next actions went out once every job on the node acknowledged its checkpoint."
            in done) and "Waiting:" not in done
    for j in rec["actions"][0]["result"]["jobs"]:
        assert f'<a href="/records/{j["id"]}">checkpoint of job {j["job"]}</a>' in done
        child = page(http, j["id"])
        # A job's record links back to the node's record, and is not drawn as a stage of the node's ladder.
        assert f'<tr><td>checkpoint for</td><td><a href="/records/{held["id"]}">the node\'s remediation</a>' in child
        assert 'id="ladder"' not in child and 'id="checkpoints"' not in child


def test_the_page_says_when_the_timeout_ended_the_wait_and_when_no_job_was_on_the_node(
        make_app: Any, r: redis.Redis, tmp_path: Path, on_node: Any) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "p.yaml", PLAYBOOKS)))
    http = app.test_client()
    empty = fire(http, "SaveFirst", "p2", node="gpu-node-9")
    app.extensions["trainmedic"].reconciler.tick()
    assert "No job had a live process on the node: the node's next actions went out at once." in page(
        http, empty["id"])

    stuck = on_node("job-stuck")
    saver(stuck)
    live(r, stuck)
    held = fire(http, "GPUXidError", "p3")
    post_json(http, f"/remediations/{held['id']}/approve", {})

    def step() -> None:
        app.extensions["trainmedic"].reconciler.tick()
        time.sleep(0.1)

    wait_record(r, held["id"], lambda x: x is not None and x["actions"][0]["status"] != "pending", tick=step,
                timeout=20)
    text = page(http, held["id"])
    assert ("The node's next actions went out when the timeout passed before every job acknowledged its "
            "checkpoint.") in text
    assert "checkpoint of job job-stuck</a>" in text and "st-dispatched" in text


def test_a_job_with_ranks_on_two_nodes_is_found_on_either_and_checkpoints_once_at_one_step(
        make_app: Any, r: redis.Redis, tmp_path: Path, redis_url: str) -> None:
    from tests.test_distributed import Ranks

    app = make_app(playbooks=str(write_playbooks(tmp_path / "p.yaml", PLAYBOOKS)))
    http = app.test_client()
    job, nodes = "ddp-two-nodes", ["gpu-node-a", "gpu-node-b"]
    rk = Ranks(tmp_path, 2, redis_url, "two-nodes", job=job, nodes=nodes, expect=1, max_steps=1_000_000,
               step_sleep=0.02)
    try:
        beat = keys.heartbeat(keys.Target("job", job))
        # Rank 0 gathers every rank's node at the first collective and reports them all in its heartbeat.
        until = time.monotonic() + 90
        while not (r.get(beat) and json.loads(r.get(beat) or "{}").get("nodes") == nodes):
            assert time.monotonic() < until, f"no heartbeat naming both nodes: {r.get(beat)}"
            time.sleep(0.1)
        info = json.loads(r.get(beat) or "{}")
        assert info["node"] == "gpu-node-a" and info["ranks"] == 2
        assert checkpoints.on_node(r.get(beat), "gpu-node-a") and checkpoints.on_node(r.get(beat), "gpu-node-b")

        # An alert on rank 1's node, which is not the heartbeating process's own node, still finds the job.
        made = fire(http, "SaveFirst", "n2", node="gpu-node-b")

        def step() -> None:
            app.extensions["trainmedic"].reconciler.tick()
            time.sleep(0.05)

        rec = wait_record(r, made["id"], lambda x: x is not None and x["actions"][0]["status"] != "pending",
                          tick=step, timeout=60)
        result = rec["actions"][0]["result"]
        assert rec["actions"][0]["status"] == "applied" and result["waited"] == "acknowledged"
        [row] = result["jobs"]
        assert row["job"] == job and row["status"] == "applied"
        assert len(r.keys(f"trainmedic:{{job:{job}}}:rec:*")) == 1, "one checkpoint for the job, not one per rank"
        results = rk.wait(timeout=60)
    finally:
        rk.kill()
    saves = [[(a["record_id"], a["action"], a["step"]) for a in res["applied"]] for res in results]
    assert saves[0] == saves[1] == [(row["id"], "save_checkpoint", saves[0][0][2])], saves
    child = records.get(r, row["id"])
    assert child is not None and child["actions"][0]["result"]["saved_at"] == saves[0][0][2]
