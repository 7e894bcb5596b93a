"""Checkpoint before drain, with every part a real process: the service under gunicorn, Redis, a node agent on
the NVML stand-in running with --scheduler slurm against a real one-node Slurm, and training clients whose
heartbeats name the node (TRAINMEDIC_NODE), one job of them with two torch.distributed (gloo) ranks.

An XID alert on the node, approved, has each job on the node save a checkpoint (applied at the same step on
every rank) before `sinfo -R` shows the node drained; a job that does not answer holds the drain only until
the step's timeout.
"""
from __future__ import annotations

import html
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from tests.conftest import AUTH, OP_AUTH, ROOT, VERIFY_KEY
from tests.support.jobs import wait_until
from tests.support.nvml import AgentProcess, NvmlState
from tests.support.slurm import SlurmCluster
from tests.test_distributed import Ranks

NODE = "tmnode1"
OTHER = "tmnode2"  # a node no alert names: its job is left alone
REASON = "GPU hardware error (XID)"
QUICK_TIMEOUT = """\
playbooks:
  - name: gpu-xid-drain
    matchers: ['alertname="GPUXidError"', 'xid_class="drain"']
    target: node
    approval: true
    actions:
      - checkpoint_jobs: {timeout: 6s}
      - drain_node: {reason: "GPU hardware error (XID)"}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), node_name=NODE).start()
    yield c
    c.stop()


@pytest.fixture
def slurm(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster with an idle, undrained node before and after each test."""
    cluster.resume_by_hand()
    wait_until(lambda: cluster.node_state() == "IDLE", timeout=20, what="the node to be IDLE")
    yield cluster
    cluster.resume_by_hand()


@pytest.fixture
def agent(slurm: SlurmCluster, redis_url: str, r: redis.Redis, tmp_path: Path, nvml_lib: Path,
          nvml_state: NvmlState) -> Iterator[AgentProcess]:
    """The node's agent: the NVML stand-in for its GPUs, the real Slurm for drain_node."""
    a = AgentProcess(NODE, redis_url, tmp_path / "agent.log", lib_dir=nvml_lib, state=nvml_state,
                     env={"SLURM_CONF": str(slurm.conf)}, args=["--scheduler", "slurm", "--slurm-node", NODE])
    info = a.wait_ready(r)
    assert "drain_node" in info["actions"] and info["scheduler"] == "slurm"
    yield a
    a.stop()


class Job:
    """tests/e2e/ckpt_job.py as a subprocess on a node (TRAINMEDIC_NODE)."""

    def __init__(self, tmp: Path, name: str, node: str, redis_url: str, mode: str = "train"):
        self.name = name
        self.out = tmp / f"{name}.json"
        self.stop_file = tmp / f"stop-{name}"
        self.ckpt = tmp / "ckpt"
        self.ckpt.mkdir(exist_ok=True)
        self.log_path = tmp / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
        env.update(TRAINMEDIC_NODE=node, TRAINMEDIC_VERIFY_KEY=VERIFY_KEY, OMP_NUM_THREADS="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("ckpt_job.py")), name, redis_url, str(self.out),
                 str(self.stop_file), str(self.ckpt), mode], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def saves(self) -> list[dict]:
        return list(json.loads(self.out.read_text())["saves"]) if self.out.exists() else []

    def stop(self) -> None:
        self.stop_file.touch()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Jobs:
    """Training jobs started by a test (each stopped after it)."""

    def __init__(self, tmp: Path, redis_url: str):
        self.tmp, self.redis_url = tmp, redis_url
        self.started: list[Job | Ranks] = []

    def one(self, name: str, node: str = NODE, mode: str = "train") -> Job:
        """A one-process job on the node."""
        job = Job(self.tmp, name, node, self.redis_url, mode)
        self.started.append(job)
        return job

    def ranks(self, name: str, nodes: list[str], **cfg: Any) -> Ranks:
        """A job of len(nodes) gloo ranks (tests/rank_worker.py), rank i on nodes[i]."""
        rk = Ranks(self.tmp, len(nodes), self.redis_url, name, job=name, nodes=nodes, **cfg)
        self.started.append(rk)
        return rk

    def stop(self) -> None:
        for x in self.started:
            if isinstance(x, Job):
                x.stop()
            else:
                x.kill()


@pytest.fixture
def jobs(tmp_path: Path, redis_url: str) -> Iterator[Jobs]:
    made = Jobs(tmp_path, redis_url)
    yield made
    made.stop()


def heartbeat(r: redis.Redis, job: str) -> dict:
    raw = r.get(keys.heartbeat(keys.Target("job", job)))
    return dict(json.loads(raw)) if raw else {}


def ready(r: redis.Redis, job: str, nodes: list[str]) -> bool:
    """The job heartbeats with its save_checkpoint handler and names exactly these nodes."""
    hb = heartbeat(r, job)
    return "save_checkpoint" in hb.get("actions", []) and hb.get("nodes") == nodes and (hb.get("step") or 0) > 0


def xid_alert(fingerprint: str) -> dict:
    alert = {"status": "firing", "labels": {"alertname": "GPUXidError", "xid_class": "drain", "node": NODE,
                                            "gpu": "0", "severity": "critical"},
             "annotations": {"summary": "GPU 0 reported XID 79 (fell off the bus)"},
             "startsAt": "2026-11-22T03:00:00Z", "endsAt": "0001-01-01T00:00:00Z", "fingerprint": fingerprint}
    return {"version": "4", "status": "firing", "receiver": "trainmedic", "groupKey": "{}:{}", "alerts": [alert]}


def drained(slurm: SlurmCluster) -> bool:
    """Whether `sinfo -R` lists the node (a drained node, with its reason)."""
    rows = slurm.run("sinfo", "-R", "-h", "-o", "%E|%N").stdout.splitlines()
    return any(row.endswith(f"|{NODE}") for row in rows)


def stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def fire_and_approve(url: str) -> str:
    [held] = requests.post(f"{url}/webhook", json=xid_alert("00000000000c4e71"), headers=AUTH,
                           timeout=10).json()["remediations"]
    assert held["status"] == "pending_approval", held
    resp = requests.post(f"{url}/remediations/{held['id']}/approve", json={"comment": "XID 79"}, headers=OP_AUTH,
                         timeout=10)
    assert resp.status_code == 200, resp.text
    return str(held["id"])


def watch_until_drained(r: redis.Redis, slurm: SlurmCluster, rid: str, timeout: float) -> list[dict]:
    """Sample {at: the time, down: is the node drained, jobs: each planned job record's status} until the node
    record is settled."""
    samples: list[dict] = []
    deadline = time.monotonic() + timeout
    while True:
        plan = json.loads(r.hget(keys.record(rid), "ckpt") or "{}")
        # Slurm first, then the records: a drain seen before a record was read as settled is a drain before it.
        at, down = time.time(), drained(slurm)
        statuses = {job: r.hget(keys.record(cid), "status") for job, cid in plan.get("jobs", [])}
        samples.append({"at": at, "down": down, "jobs": statuses})
        if r.hget(keys.record(rid), "status") not in ("dispatched", "pending_approval"):
            return samples
        assert time.monotonic() < deadline, f"the node record did not settle in {timeout}s: {records.get(r, rid)}"
        time.sleep(0.1)


def test_an_approved_xid_alert_checkpoints_every_job_on_the_node_before_slurm_drains_it(
        slurm: SlurmCluster, agent: AgentProcess, gunicorn: Any, jobs: Jobs, r: redis.Redis, tmp_path: Path) -> None:
    service = gunicorn(workers=2)  # the shipped playbooks: the XID playbook checkpoints, then drains
    single = jobs.one("llm-pretrain", NODE)
    ddp = jobs.ranks("llm-ddp", [NODE, NODE], expect=1, max_steps=1_000_000, step_sleep=0.02,
                     ckpt_dir=str(single.ckpt))
    elsewhere = jobs.one("llm-elsewhere", OTHER)
    wait_until(lambda: ready(r, "llm-pretrain", [NODE]) and ready(r, "llm-ddp", [NODE])
               and ready(r, "llm-elsewhere", [OTHER]), timeout=120, tick=lambda: time.sleep(0.2),
               what="the three jobs' heartbeats")
    assert heartbeat(r, "llm-ddp")["ranks"] == 2
    targets = requests.get(f"{service.url}/targets", headers=OP_AUTH, timeout=10).json()["targets"]
    assert {t["name"]: t.get("node") for t in targets if t["kind"] == "job"} == {
        "llm-pretrain": NODE, "llm-ddp": NODE, "llm-elsewhere": OTHER}  # what GET /targets shows of each process

    rid = fire_and_approve(service.url)
    samples = watch_until_drained(r, slurm, rid, timeout=90)

    # Only then: while any job's checkpoint was not applied, sinfo -R did not list the node; in the end it does.
    assert samples[-1]["down"] and slurm.reason() == f"trainmedic {rid}: {REASON}"
    assert any(not s["down"] and s["jobs"] and set(s["jobs"].values()) != {"applied"} for s in samples), \
        "the wait for the checkpoints was never seen"
    for s in samples:
        if s["down"]:
            assert set(s["jobs"]) == {"llm-pretrain", "llm-ddp"} and set(s["jobs"].values()) == {"applied"}, samples

    node_rec = records.get(r, rid)
    assert node_rec is not None and node_rec["status"] == "applied", node_rec
    ckpt, drain = node_rec["actions"]
    assert (ckpt["action"], ckpt["status"], drain["action"], drain["status"]) == (
        "checkpoint_jobs", "applied", "drain_node", "applied")
    assert ckpt["result"]["waited"] == "acknowledged"
    by_job = {j["job"]: j for j in ckpt["result"]["jobs"]}
    assert set(by_job) == {"llm-pretrain", "llm-ddp"}  # the job on another node is not asked
    assert drain["result"]["before"]["flags"] == [] and "DRAIN" in drain["result"]["after"]["flags"]

    # The records link each other: the node's step names each job's record, and each names the node's.
    for job, row in by_job.items():
        child = records.get(r, row["id"])
        assert child is not None and child["status"] == "applied" and row["status"] == "applied"
        assert child["target"] == {"kind": "job", "name": job}
        assert child["escalation"]["parent"] == rid and child["escalation"]["stage"] == 0
        assert child["approved_by"] is None and child["requested_by"] == node_rec["requested_by"]
        assert stamp(child["actions"][0]["acked_at"]) <= stamp(drain["acked_at"])

    # Each job saved one checkpoint; the two ranks applied theirs at the same step, and each wrote its file.
    [saved] = wait_until(single.saves, timeout=10, what="llm-pretrain's checkpoint")
    assert Path(saved["path"]).is_file()
    assert by_job["llm-pretrain"]["id"] and records.get(r, by_job["llm-pretrain"]["id"])["actions"][0]["result"][
        "step"] == saved["step"]
    results = ddp.wait(timeout=60)
    steps = [[(a["action"], a["step"]) for a in res["applied"]] for res in results]
    assert steps[0] == steps[1] and [a for a, _ in steps[0]] == ["save_checkpoint"], steps
    paths = [res["applied"][0]["result"]["path"] for res in results]
    assert all(Path(p).is_file() for p in paths) and len(set(paths)) == 2
    ddp_rec = records.get(r, by_job["llm-ddp"]["id"])
    assert ddp_rec is not None and ddp_rec["actions"][0]["result"]["saved_at"] == steps[0][0][1]
    elsewhere.stop()
    assert elsewhere.saves() == []
    assert not r.keys("trainmedic:{job:llm-elsewhere}:rec:*")

    # The pages link them too, and say in words how the wait ended.
    page = html.unescape(requests.get(f"{service.url}/records/{rid}", headers=OP_AUTH, timeout=10).text)
    for row in by_job.values():
        assert f'href="/records/{row["id"]}"' in page
    assert "every job on the node acknowledged its checkpoint" in page
    child_page = html.unescape(requests.get(f"{service.url}/records/{by_job['llm-ddp']['id']}", headers=OP_AUTH,
                                            timeout=10).text)
    assert f'href="/records/{rid}"' in child_page and "checkpoint for" in child_page


def test_a_job_that_does_not_answer_holds_the_drain_only_until_the_timeout(
        slurm: SlurmCluster, agent: AgentProcess, gunicorn: Any, jobs: Jobs, r: redis.Redis, tmp_path: Path) -> None:
    playbooks = tmp_path / "xid.yaml"
    playbooks.write_text(QUICK_TIMEOUT)
    service = gunicorn(workers=2, TRAINMEDIC_PLAYBOOKS=str(playbooks))
    quick = jobs.one("llm-quick", NODE)
    hung = jobs.one("llm-hung", NODE, mode="hang")
    wait_until(lambda: ready(r, "llm-quick", [NODE]) and ready(r, "llm-hung", [NODE]), timeout=60,
               tick=lambda: time.sleep(0.2), what="the two jobs' heartbeats")

    t0 = time.monotonic()
    rid = fire_and_approve(service.url)
    samples = watch_until_drained(r, slurm, rid, timeout=60)
    waited = time.monotonic() - t0

    rec = records.get(r, rid)
    assert rec is not None and rec["status"] == "applied", rec
    ckpt, drain = rec["actions"]
    assert ckpt["result"]["waited"] == "timeout" and "timeout passed" in ckpt["result"]["message"]
    assert {j["job"]: j["status"] for j in ckpt["result"]["jobs"]} == {"llm-quick": "applied",
                                                                       "llm-hung": "dispatched"}
    assert ckpt["result"]["waited_s"] >= 6 and waited >= 6
    deadline = json.loads(r.hget(keys.record(rid), "ckpt"))["deadline_ms"] / 1000
    assert samples[-1]["down"] and all(s["at"] >= deadline for s in samples if s["down"]), (deadline, samples)
    assert any(not s["down"] and s["jobs"].get("llm-quick") == "applied" for s in samples), \
        "the node was drained as soon as the quick job saved"
    # The drain went ahead although a job never answered: sinfo -R lists the node with the record's reason.
    assert drain["status"] == "applied" and drained(slurm)
    assert slurm.reason() == f"trainmedic {rid}: {REASON}"
    assert len(quick.saves()) == 1 and hung.saves() == []
    assert heartbeat(r, "llm-hung"), "the hung job still heartbeats: it did not answer, it did not go"
    page = html.unescape(requests.get(f"{service.url}/records/{rid}", headers=OP_AUTH, timeout=10).text)
    assert "the timeout passed before every job acknowledged" in page
