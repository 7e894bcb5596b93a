"""drain_node / resume_node against a real one-node Slurm (munged, slurmctld, slurmd), and job names from Slurm.

No mocks: every test drives Debian's Slurm 22.05 daemons that tests/support/slurm.py starts once per module.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from trainmedic.client.agent.slurm import REASON_MAX, DictMemory, SlurmNode
from trainmedic.client.receiver.applier import ActionFailed, ActionSkipped
from trainmedic.client.trainer.identity import job_name

from tests.support.slurm import SlurmCluster, free_port

NODE = "tmnode1"


def rid(n: int) -> str:
    """A record id as the service makes them: 26 time-sortable characters ~ kind ~ target."""
    return f"01J{n:023d}~node~{NODE}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), node_name=NODE).start()
    print(f"\nslurm up in {c.bringup_s:.2f}s")
    yield c
    c.stop()
    print(f"\nslurm down in {c.teardown_s:.2f}s")


@pytest.fixture
def slurm(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster with an idle node and no jobs, before and after each test."""
    _reset(cluster)
    yield cluster
    _reset(cluster)


def _reset(c: SlurmCluster) -> None:
    c.cancel_all()
    c.resume_by_hand()
    wait_for(lambda: c.node_state() == "IDLE", "the node to be IDLE", c)


def wait_for(cond, what: str, c: SlurmCluster, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"waited {timeout:.0f}s for {what}; node is {c.node_state()} ({c.reason()!r})")


@pytest.fixture
def node(slurm: SlurmCluster) -> SlurmNode:
    return SlurmNode(NODE, env=slurm.env)


# -- state


def test_cluster_comes_up_quickly_with_an_idle_node(cluster: SlurmCluster) -> None:
    assert cluster.bringup_s is not None and cluster.bringup_s < 15
    assert cluster.node_state() == "IDLE"


def test_state_reads_sinfo_json(node: SlurmNode) -> None:
    assert node.state() == {"node": NODE, "state": "IDLE", "flags": [], "reason": None, "reason_set_by": None}


# -- drain and resume


def test_drain_keeps_new_jobs_pending_and_resume_lets_them_run(slurm: SlurmCluster, node: SlurmNode) -> None:
    memory = DictMemory()
    result = node.drain(rid(1), "GPU 3 is too hot", memory)

    assert result["before"]["state"] == "IDLE" and "DRAIN" not in result["before"]["flags"]
    assert "DRAIN" in result["after"]["flags"]
    assert result["after"]["reason"] == f"trainmedic {rid(1)}: GPU 3 is too hot"
    assert memory.ours(NODE) == rid(1)
    # What people see: sinfo -R lists the node with trainmedic's reason and the record id.
    listing = slurm.run("sinfo", "-R", "-h", "-o", "%E|%N").stdout
    assert f"trainmedic {rid(1)}: GPU 3 is too hot|{NODE}" in listing.splitlines()
    assert slurm.node_state() == "IDLE+DRAIN"

    job = slurm.submit("sleep 1\necho ran\n", "waits-for-resume")
    time.sleep(2.0)  # an idle, undrained node starts it within a fraction of a second
    assert slurm.job_state(job) == "PENDING"

    result = node.resume(memory)
    assert "DRAIN" in result["before"]["flags"] and result["record_id"] == rid(1)
    assert "DRAIN" not in result["after"]["flags"]
    assert memory.ours(NODE) is None
    assert slurm.wait_job(job, ("RUNNING", "COMPLETED")) in ("RUNNING", "COMPLETED")
    assert slurm.wait_job(job, ("COMPLETED",)) == "COMPLETED"
    assert slurm.job_output(job) == "ran\n"
    wait_for(lambda: slurm.node_state() == "IDLE", "the node to be IDLE again", slurm)
    assert slurm.reason() == ""


def test_drain_of_a_busy_node_lets_its_running_job_finish(slurm: SlurmCluster, node: SlurmNode) -> None:
    job = slurm.submit("sleep 2\necho finished\n", "running-before-drain", f"--cpus-per-task={slurm.cpus}")
    slurm.wait_job(job, ("RUNNING",))
    memory = DictMemory()

    result = node.drain(rid(2), "ECC errors", memory)

    assert result["before"]["state"] in ("ALLOCATED", "MIXED")
    assert "DRAIN" in result["after"]["flags"]
    assert slurm.node_state() in ("ALLOCATED+DRAIN", "MIXED+DRAIN")  # DRAINING: the job goes on
    assert slurm.wait_job(job, ("COMPLETED",)) == "COMPLETED"
    assert slurm.job_output(job) == "finished\n"
    wait_for(lambda: slurm.node_state() == "IDLE+DRAIN", "the node to be DRAINED", slurm)
    node.resume(memory)


def test_drain_again_by_the_same_record_reports_it_once_more(slurm: SlurmCluster, node: SlurmNode) -> None:
    memory = DictMemory()
    node.drain(rid(3), "first", memory)
    again = node.drain(rid(3), "first", memory)
    assert again["already"] is True and "DRAIN" in again["after"]["flags"]
    # Another trainmedic record does not take over a drain it did not make.
    with pytest.raises(ActionSkipped) as exc:
        node.drain(rid(4), "second", memory)
    assert exc.value.reason == "already_drained"
    assert rid(3) in exc.value.result["message"]
    assert slurm.reason() == f"trainmedic {rid(3)}: first"
    assert memory.ours(NODE) == rid(3)


def test_a_node_drained_by_hand_is_left_as_it_is(slurm: SlurmCluster, node: SlurmNode) -> None:
    slurm.drain_by_hand("replacing DIMM 4 (ticket OPS-17)")
    memory = DictMemory()

    with pytest.raises(ActionSkipped) as exc:
        node.resume(memory)
    assert exc.value.reason == "not_ours"
    assert "replacing DIMM 4" in exc.value.result["message"]
    assert exc.value.result["before"]["reason"] == "replacing DIMM 4 (ticket OPS-17)"

    with pytest.raises(ActionSkipped) as exc:
        node.drain(rid(5), "GPU too hot", memory)
    assert exc.value.reason == "already_drained"
    assert "DRAIN" in exc.value.result["before"]["flags"]

    assert slurm.node_state() == "IDLE+DRAIN"
    assert slurm.reason() == "replacing DIMM 4 (ticket OPS-17)"
    assert memory.ours(NODE) is None


def test_a_drain_people_took_over_is_not_resumed(slurm: SlurmCluster, node: SlurmNode) -> None:
    """trainmedic drained the node, then an operator drained it again with their own reason: theirs now."""
    memory = DictMemory()
    node.drain(rid(6), "GPU too hot", memory)
    slurm.drain_by_hand("keep drained: fan broken")

    with pytest.raises(ActionSkipped) as exc:
        node.resume(memory)

    assert exc.value.reason == "not_ours"
    assert slurm.node_state() == "IDLE+DRAIN"
    assert slurm.reason() == "keep drained: fan broken"
    assert memory.ours(NODE) is None


def test_resume_of_a_node_that_is_not_drained_is_skipped(slurm: SlurmCluster, node: SlurmNode) -> None:
    memory = DictMemory({NODE: rid(7)})  # remembered, but someone resumed the node meanwhile
    with pytest.raises(ActionSkipped) as exc:
        node.resume(memory)
    assert exc.value.reason == "not_drained"
    assert "not drained" in exc.value.result["message"]
    assert memory.ours(NODE) is None
    assert slurm.node_state() == "IDLE"


def test_dry_run_changes_nothing(slurm: SlurmCluster, node: SlurmNode) -> None:
    memory = DictMemory()
    with pytest.raises(ActionSkipped) as exc:
        node.drain(rid(8), "would drain", memory, dry_run=True)
    skipped = exc.value.result
    assert exc.value.reason == "dry_run"
    assert skipped["argv"] == ["scontrol", "update", f"NodeName={NODE}", "State=DRAIN",
                               f'Reason="trainmedic {rid(8)}: would drain"']
    assert "DRAIN" in skipped["would_be"]["flags"]
    time.sleep(0.3)
    assert slurm.node_state() == "IDLE" and slurm.reason() == ""
    assert memory.ours(NODE) is None

    node.drain(rid(8), "really", memory)
    with pytest.raises(ActionSkipped) as exc:
        node.resume(memory, dry_run=True)
    assert exc.value.reason == "dry_run"
    assert exc.value.result["argv"] == ["scontrol", "update", f"NodeName={NODE}", "State=RESUME"]
    time.sleep(0.3)
    assert slurm.node_state() == "IDLE+DRAIN"
    assert memory.ours(NODE) == rid(8)
    node.resume(memory)


def test_a_hostile_reason_is_one_capped_line_in_slurm(slurm: SlurmCluster, node: SlurmNode) -> None:
    hostile = ('line one\nState=RESUME Reason="x"\r\n\t$(reboot); `id` \x1b[31mred\x00\u2028' + "A" * 10_000
               + 'he said "stop"')
    memory = DictMemory()
    result = node.drain(rid(9), hostile, memory)

    stored = slurm.reason()
    prefix = f"trainmedic {rid(9)}: "
    assert stored == result["slurm_reason"] == result["after"]["reason"]
    assert stored.startswith(prefix + 'line one State=RESUME Reason="x" $(reboot); `id` [31mred A')
    assert len(stored) == len(prefix) + REASON_MAX
    assert all(ch.isprintable() for ch in stored)
    assert slurm.node_state() == "IDLE+DRAIN"  # the newline did not smuggle in a State=RESUME
    node.resume(memory)


def test_a_reason_ending_in_a_quote_keeps_it(slurm: SlurmCluster, node: SlurmNode) -> None:
    memory = DictMemory()
    node.drain(rid(10), 'ops said "drain"', memory)
    assert slurm.reason() == f'trainmedic {rid(10)}: ops said "drain"'
    assert node.resume(memory)["record_id"] == rid(10)


def test_an_empty_reason_still_names_the_record(slurm: SlurmCluster, node: SlurmNode) -> None:
    memory = DictMemory()
    node.drain(rid(11), None, memory)
    assert slurm.reason() == f"trainmedic {rid(11)}"
    node.resume(memory)
    assert slurm.node_state() in ("IDLE", "IDLE+NOT_RESPONDING")


# -- requeue the node's jobs


def start_now(slurm: SlurmCluster, job: int) -> None:
    """Slurm holds a requeued job back about two minutes (its BeginTime); a person's resume does not wait."""
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")


def test_requeue_sends_running_jobs_back_to_pending_while_drained_and_they_run_again_once_resumed(
        slurm: SlurmCluster, node: SlurmNode) -> None:
    # Each run prints Slurm's restart count: 0 the first time, 1 once requeued.
    job = slurm.submit('echo "run $SLURM_RESTART_COUNT"\nsleep 4\necho done\n', "requeued",
                       f"--cpus-per-task={slurm.cpus}")
    slurm.wait_job(job, ("RUNNING",))
    memory = DictMemory()
    node.drain(rid(20), "straggler", memory)

    result = node.requeue()

    assert result["node"] == NODE and result["requeued"] == 1
    assert result["jobs"] == [{"job_id": str(job), "requeued": True, "state": "PENDING"}]
    time.sleep(2.0)
    assert slurm.job_state(job) == "PENDING"  # not on the drained node
    node.resume(memory)
    start_now(slurm, job)
    assert slurm.wait_job(job, ("COMPLETED",), timeout=60) == "COMPLETED"
    assert "run 1\ndone\n" in slurm.job_output(job)


def test_a_job_slurm_will_not_requeue_is_listed_with_its_reason_and_the_others_go_on(
        slurm: SlurmCluster, node: SlurmNode) -> None:
    kept = slurm.submit("sleep 30\n", "no-requeue", "--no-requeue", "--cpus-per-task=1")
    moved = slurm.submit("sleep 30\n", "requeue-me", "--cpus-per-task=1")
    slurm.wait_job(kept, ("RUNNING",))
    slurm.wait_job(moved, ("RUNNING",))

    result = node.requeue()

    by_id = {j["job_id"]: j for j in result["jobs"]}
    assert set(by_id) == {str(kept), str(moved)} and result["requeued"] == 1
    assert by_id[str(moved)] == {"job_id": str(moved), "requeued": True, "state": "PENDING"}
    assert by_id[str(kept)]["requeued"] is False and by_id[str(kept)]["state"] == "RUNNING"
    assert by_id[str(kept)]["reason"] == f"Requested operation is presently disabled for job {kept}"


def test_requeue_fails_when_slurm_requeues_none(slurm: SlurmCluster, node: SlurmNode) -> None:
    job = slurm.submit("sleep 30\n", "no-requeue", "--no-requeue")
    slurm.wait_job(job, ("RUNNING",))

    with pytest.raises(ActionFailed) as exc:
        node.requeue()

    assert exc.value.message == (f"Slurm requeued none of the 1 job(s) on node {NODE} ({job}: Requested operation "
                                 f"is presently disabled for job {job}).")
    assert exc.value.result["jobs"] == [{"job_id": str(job), "requeued": False, "state": "RUNNING",
                                         "reason": f"Requested operation is presently disabled for job {job}"}]
    assert slurm.job_state(job) == "RUNNING"


def test_requeue_of_a_node_without_jobs_is_skipped(slurm: SlurmCluster, node: SlurmNode) -> None:
    pending = slurm.submit("sleep 1\n", "pending", "--begin=now+1hour")  # not on the node: left alone
    with pytest.raises(ActionSkipped) as exc:
        node.requeue()
    assert exc.value.reason == "no_jobs" and exc.value.result["jobs"] == []
    assert slurm.job_state(pending) == "PENDING"


def test_requeue_in_a_dry_run_changes_nothing(slurm: SlurmCluster, node: SlurmNode) -> None:
    job = slurm.submit("sleep 30\n", "stays")
    slurm.wait_job(job, ("RUNNING",))
    with pytest.raises(ActionSkipped) as exc:
        node.requeue(dry_run=True)
    assert exc.value.reason == "dry_run" and exc.value.result["jobs"] == [{"job_id": str(job), "requeued": False}]
    time.sleep(1.0)
    assert slurm.job_state(job) == "RUNNING"


# -- failures: one sentence each


def _one_sentence(exc: ActionFailed) -> str:
    text = exc.message
    assert "\n" not in text and text.endswith(".") and text[0].isupper()
    return text


def test_a_node_slurm_does_not_know_fails_in_one_sentence(slurm: SlurmCluster) -> None:
    memory = DictMemory()
    with pytest.raises(ActionFailed) as exc:
        SlurmNode("gpu-node-99", env=slurm.env).drain(rid(12), "hot", memory)
    assert _one_sentence(exc.value) == "Slurm knows no node named gpu-node-99 (set the agent's --slurm-node)."
    assert memory.ours("gpu-node-99") is None
    assert slurm.node_state() == "IDLE"


def test_scontrol_missing_fails_in_one_sentence(slurm: SlurmCluster) -> None:
    memory = DictMemory()
    node = SlurmNode(NODE, scontrol="/nonexistent/scontrol", env=slurm.env)
    with pytest.raises(ActionFailed) as exc:
        node.drain(rid(13), "hot", memory)
    assert "/nonexistent/scontrol is not installed" in _one_sentence(exc.value)
    assert exc.value.result["returncode"] is None
    assert memory.ours(NODE) is None  # remembered only while the drain could have happened
    assert slurm.node_state() == "IDLE"


def test_a_failing_sinfo_gives_its_exit_status_and_first_stderr_line(slurm: SlurmCluster, tmp_path) -> None:
    broken = tmp_path / "slurm.conf"
    broken.write_text(slurm.conf.read_text() + "NoSuchSetting=1\n")
    with pytest.raises(ActionFailed) as exc:
        SlurmNode(NODE, env={**slurm.env, "SLURM_CONF": str(broken)}).drain(rid(15), "hot", DictMemory())
    text = _one_sentence(exc.value)
    assert text == ("Could not read the node's state: sinfo --json exited with status 1: "
                    "sinfo: error: _parse_next_key: Parsing error at unrecognized key: NoSuchSetting.")
    assert exc.value.result["returncode"] == 1
    assert exc.value.result["stderr"] == ("sinfo: error: _parse_next_key: Parsing error at unrecognized key: "
                                          "NoSuchSetting")


def test_requeue_on_a_node_slurm_does_not_know_fails_in_one_sentence(slurm: SlurmCluster) -> None:
    with pytest.raises(ActionFailed) as exc:
        SlurmNode("tmnode9", env=slurm.env).requeue()
    assert _one_sentence(exc.value) == ("Could not list the node's jobs: squeue -h exited with status 1: "
                                        "squeue: error: Invalid node name tmnode9.")


def test_a_controller_that_cannot_be_reached_fails_in_one_sentence(slurm: SlurmCluster, tmp_path) -> None:
    elsewhere = tmp_path / "slurm.conf"  # the same cluster, but slurmctld "moved" to a port where nothing listens
    lines = [line for line in slurm.conf.read_text().splitlines() if not line.startswith("SlurmctldPort=")]
    elsewhere.write_text("\n".join([*lines, f"SlurmctldPort={free_port()}", "MessageTimeout=2", ""]))
    with pytest.raises(ActionFailed) as exc:
        SlurmNode(NODE, env={**slurm.env, "SLURM_CONF": str(elsewhere)}).resume(DictMemory())
    assert _one_sentence(exc.value) == ("Could not read the node's state: sinfo --json got no answer from slurmctld "
                                        "(Unspecified error, errno -1; is slurmctld up and reachable?).")


def test_json_that_is_not_node_json_fails_in_one_sentence(slurm: SlurmCluster) -> None:
    # squeue --json is real Slurm JSON, of jobs: not what the node's state is read from.
    with pytest.raises(ActionFailed) as exc:
        SlurmNode(NODE, sinfo="squeue", env=slurm.env).state()
    assert _one_sentence(exc.value) == ("Could not read the node's state: squeue --json printed something that "
                                        "is not Slurm's node JSON.")


def test_a_controller_that_does_not_answer_times_out(slurm: SlurmCluster) -> None:
    pid = slurm.pids["slurmctld"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(ActionFailed) as exc:
            SlurmNode(NODE, env=slurm.env, timeout=1.0).drain(rid(14), "hot", DictMemory())
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(pid, signal.SIGCONT)
    assert _one_sentence(exc.value) == ("Could not read the node's state: sinfo --json did not answer within 1 "
                                        "seconds (is slurmctld up and reachable?).")


def test_bad_names_are_refused_before_any_command(slurm: SlurmCluster) -> None:
    with pytest.raises(ValueError):
        SlurmNode("node1 State=RESUME")
    with pytest.raises(ActionFailed) as exc:
        SlurmNode(NODE, env=slurm.env).drain("x Reason=evil", "hot", DictMemory())
    assert "is not a trainmedic record id" in _one_sentence(exc.value)
    assert slurm.node_state() == "IDLE"


# -- the training client's job name


IDENTITY = ("unset TRAINMEDIC_JOB\n"
            f"exec {sys.executable} -c 'import os; from trainmedic.client.trainer.identity import job_name; "
            "print(job_name(None, os.environ))'\n")


@pytest.mark.parametrize("name, expected", [("llama-ft-01", "{name}"), ("bad name!", "slurm-{job}")])
def test_a_slurm_job_knows_its_name(slurm: SlurmCluster, name: str, expected: str) -> None:
    job = slurm.submit(IDENTITY, name)
    assert slurm.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED", slurm.job_output(job)
    assert slurm.job_output(job) == expected.format(name=name, job=job) + "\n"


def test_job_name_precedence() -> None:
    slurm_env = {"SLURM_JOB_NAME": "from-slurm", "SLURM_JOB_ID": "4242"}
    assert job_name("given", {"TRAINMEDIC_JOB": "env", **slurm_env}) == "given"
    assert job_name(None, {"TRAINMEDIC_JOB": "env", **slurm_env}) == "env"
    assert job_name("", {"TRAINMEDIC_JOB": "", **slurm_env}) == "from-slurm"
    assert job_name(None, slurm_env) == "from-slurm"
    assert job_name(None, {"SLURM_JOB_NAME": "a:b@c_d.e-f", "SLURM_JOB_ID": "1"}) == "a:b@c_d.e-f"
    for bad in ("bad name!", "..", ".", "x" * 129, "sbatch\n", "", "naïve"):
        assert job_name(None, {"SLURM_JOB_NAME": bad, "SLURM_JOB_ID": "4242"}) == "slurm-4242"
    assert job_name(None, {"SLURM_JOB_ID": "17"}) == "slurm-17"


def test_job_name_refuses_what_it_cannot_use() -> None:
    for environ in ({}, {"SLURM_JOB_NAME": "bad name!"}, {"SLURM_JOB_ID": "12a"}, {"SLURM_JOB_ID": "-1"}):
        with pytest.raises(ValueError) as exc:
            job_name(None, environ)
        assert "TRAINMEDIC_JOB" in str(exc.value) and "\n" not in str(exc.value)
    # A name given on purpose is never swapped for another one.
    for job, environ in (("bad name", {"SLURM_JOB_NAME": "ok"}), (None, {"TRAINMEDIC_JOB": "..", "SLURM_JOB_ID": "1"})):
        with pytest.raises(ValueError) as exc:
            job_name(job, environ)
        assert "is not valid" in str(exc.value)


def test_the_client_package_never_imports_the_service() -> None:
    code = ("import sys, trainmedic.client.agent.slurm, trainmedic.client.trainer.identity; "
            "print(sorted(m for m in sys.modules if m.startswith('trainmedic.service')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


# -- through the service: a webhook, a person's approval, a real node agent with --scheduler slurm


@pytest.fixture
def slurm_agent(slurm: SlurmCluster, redis_url: str, r: Any, tmp_path: Path) -> Iterator[Any]:
    """A node agent for the Slurm node, named as the alerts name it (its --node is the Slurm name too)."""
    from tests.support.nvml import AgentProcess

    agent = AgentProcess(NODE, redis_url, tmp_path / "agent.log", env={"SLURM_CONF": str(slurm.conf)},
                         args=["--scheduler", "slurm", "--slurm-node", NODE])
    info = agent.wait_ready(r)
    assert {"drain_node", "resume_node", "requeue_jobs"} <= set(info["actions"]) and info["scheduler"] == "slurm"
    yield agent
    agent.stop()


def xid(status: str) -> dict:
    alert = {"status": status, "labels": {"alertname": "GPUXidError", "node": NODE, "gpu_id": "0",
                                          "xid_class": "drain", "severity": "critical"},
             "annotations": {"summary": "GPU 0 reported hardware error XID 79"},
             "startsAt": "2026-11-22T03:00:00.25Z" if status == "firing" else "2026-11-22T03:00:00Z",
             "fingerprint": "000000000000d7a1"}
    return {"version": "4", "status": status, "alerts": [alert]}


def wait_ticking(app: Any, r: Any, rid: str) -> dict:
    """The record once settled, ticking the app's reconciler meanwhile (it carries out checkpoint_jobs)."""
    from tests.support import jobs

    def settled(rec: dict | None) -> bool:
        return rec is not None and rec["status"] not in ("dispatched", "pending_approval")

    return jobs.wait_record(r, rid, settled, timeout=30, tick=lambda: (app.extensions["trainmedic"].reconciler.tick(),
                                                                       time.sleep(0.1)))


def test_a_gpu_error_drains_the_node_through_the_service_and_its_resolve_resumes_it(
        slurm: SlurmCluster, slurm_agent: Any, app: Any, http: Any, r: Any) -> None:
    from tests.conftest import post_json
    from tests.support.nvml import wait_record

    [held] = post_json(http, "/webhook", xid("firing")).get_json()["remediations"]
    assert held["status"] == "pending_approval"  # the shipped playbook waits for a person
    assert slurm.node_state() == "IDLE"
    assert post_json(http, f"/remediations/{held['id']}/approve", {"comment": "XID 79, drain"}).status_code == 200
    rec = wait_ticking(app, r, held["id"])
    # The shipped playbook checkpoints the node's jobs first (none run here), then drains.
    [act] = [a for a in rec["actions"] if a["action"] == "drain_node"]
    assert rec["status"] == "applied", rec
    assert act["result"]["before"]["flags"] == [] and "DRAIN" in act["result"]["after"]["flags"]
    assert slurm.reason() == f"trainmedic {held['id']}: GPU hardware error (XID)"
    reasons = slurm.run("sinfo", "-R", "-h", "-o", "%E|%N").stdout
    assert f"trainmedic {held['id']}: GPU hardware error (XID)|{NODE}" in reasons
    job = slurm.submit("#!/bin/sh\nsleep 1\n", "after-the-drain")
    time.sleep(2)
    assert slurm.job_state(job) == "PENDING"  # no new job starts on a drained node

    [undo] = post_json(http, "/webhook", xid("resolved")).get_json()["remediations"]
    rec = wait_record(r, undo["id"], timeout=30)
    assert rec["status"] == "applied" and rec["actions"][0]["action"] == "resume_node"
    # The node takes the job (at the controller's next scheduling pass at the latest: once a minute).
    assert slurm.wait_job(job, ("COMPLETED",), timeout=90) == "COMPLETED"
    assert slurm.reason() == ""


def straggler(job: str) -> dict:
    """The training client's TrainingStraggler for a slow rank on NODE, as Alertmanager sends it on."""
    alert = {"status": "firing", "labels": {"alertname": "TrainingStraggler", "job_name": job, "node": NODE,
                                            "rank": "1", "severity": "warning", "source": "trainmedic"},
             "annotations": {"summary": f"rank 1 of {job} is slow"}, "startsAt": "2026-11-22T04:00:00Z",
             "fingerprint": "00000000000051a9"}
    return {"version": "4", "status": "firing", "alerts": [alert]}


def test_an_approved_straggler_checkpoints_the_nodes_job_drains_the_node_and_requeues_the_job(
        slurm: SlurmCluster, slurm_agent: Any, app: Any, http: Any, r: Any, redis_url: str, tmp_path: Path) -> None:
    from tests.conftest import post_json

    # A real training loop as a Slurm job on the node: its client names its node from SLURMD_NODENAME.
    out, stop, ckpts = tmp_path / "job.json", tmp_path / "stop", tmp_path / "ckpts"
    ckpts.mkdir()
    worker = Path(__file__).resolve().parent / "e2e" / "ckpt_job.py"
    script = (f"#!/bin/sh\nunset TRAINMEDIC_NODE\n"
              f"exec {sys.executable} {worker} slow-llama {redis_url} {out} {stop} {ckpts} train\n")
    job = slurm.submit(script, "slow-llama", "--cpus-per-task=1")
    slurm.wait_job(job, ("RUNNING",))

    def on_node() -> bool:
        return any(t["kind"] == "job" and t["name"] == "slow-llama" and t.get("node") == NODE
                   for t in http.get("/targets").get_json()["targets"])

    deadline = time.monotonic() + 60
    while not on_node():
        assert time.monotonic() < deadline and slurm.job_state(job) == "RUNNING", slurm.job_output(job)
        time.sleep(0.2)

    [held] = post_json(http, "/webhook", straggler("slow-llama")).get_json()["remediations"]
    assert (held["playbook"], held["status"]) == ("straggler", "pending_approval")
    assert held["id"].endswith(f"~node~{NODE}")
    time.sleep(1.0)
    assert slurm.node_state() in ("MIXED", "ALLOCATED") and slurm.job_state(job) == "RUNNING"  # nothing yet
    assert post_json(http, f"/remediations/{held['id']}/approve", {"comment": "rank 1 is slow"}).status_code == 200
    rec = wait_ticking(app, r, held["id"])

    assert rec["status"] == "applied", rec
    ckpt, drain, requeue = rec["actions"]
    assert [a["action"] for a in (ckpt, drain, requeue)] == ["checkpoint_jobs", "drain_node", "requeue_jobs"]
    assert [(j["job"], j["status"]) for j in ckpt["result"]["jobs"]] == [("slow-llama", "applied")]
    saves = json.loads(out.read_text())["saves"]
    assert len(saves) == 1 and Path(saves[0]["path"]).is_file()  # saved before the job was requeued
    assert drain["status"] == "applied" and "DRAIN" in drain["result"]["after"]["flags"]
    assert f"trainmedic {held['id']}: straggler|{NODE}" in slurm.run("sinfo", "-R", "-h", "-o", "%E|%N").stdout
    assert requeue["status"] == "applied"
    assert requeue["result"]["jobs"] == [{"job_id": str(job), "requeued": True, "state": "PENDING"}]
    time.sleep(2.0)
    assert slurm.job_state(job) == "PENDING" and "DRAIN" in slurm.node_state()  # it waits for another node
    stop.write_text("")


def test_a_node_someone_drained_by_hand_stays_drained(slurm: SlurmCluster, slurm_agent: Any, app: Any, http: Any,
                                                      r: Any) -> None:
    from tests.conftest import post_json
    from tests.support.nvml import wait_record

    slurm.drain_by_hand("replacing DIMM 4 (ticket OPS-17)")
    [held] = post_json(http, "/webhook", xid("firing")).get_json()["remediations"]
    assert post_json(http, f"/remediations/{held['id']}/approve", {}).status_code == 200
    rec = wait_ticking(app, r, held["id"])
    assert (rec["status"], rec["actions"][-1]["reason"]) == ("skipped", "already_drained")
    [undo] = post_json(http, "/webhook", xid("resolved")).get_json()["remediations"]
    rec = wait_record(r, undo["id"], timeout=30)
    assert (rec["status"], rec["actions"][0]["reason"]) == ("skipped", "not_ours")
    assert slurm.reason() == "replacing DIMM 4 (ticket OPS-17)" and "DRAIN" in slurm.node_state()


def test_an_sbatch_job_whose_client_names_itself_from_slurm_shows_up_under_that_name(
        slurm: SlurmCluster, http: Any, redis_url: str) -> None:
    script = ("#!/bin/sh\nunset TRAINMEDIC_JOB\n"
              f"exec {sys.executable} -c 'import time; from trainmedic.client import RemediationClient; "
              "rc = RemediationClient(heartbeat_interval=0.2); time.sleep(6); rc.close()'\n")
    job = slurm.submit(script, "llama-ft-slurm", f"--export=ALL,TRAINMEDIC_REDIS_URL={redis_url}")

    def listed() -> bool:
        return any(t["kind"] == "job" and t["name"] == "llama-ft-slurm"
                   for t in http.get("/targets").get_json()["targets"])

    deadline = time.monotonic() + 20
    while not listed():
        assert time.monotonic() < deadline, slurm.job_output(job)
        time.sleep(0.2)
    assert slurm.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED", slurm.job_output(job)


# -- which scheduler an agent uses when it is not told: Slurm only when its controller answers


def unreachable_controller(slurm: SlurmCluster, where: Path) -> Path:
    """The cluster's slurm.conf, with slurmctld "moved" to a port where nothing listens."""
    lines = [line for line in slurm.conf.read_text().splitlines() if not line.startswith("SlurmctldPort=")]
    where.write_text("\n".join([*lines, f"SlurmctldPort={free_port()}", "MessageTimeout=2", ""]))
    return where


def test_an_agent_with_scontrol_but_no_controller_has_no_scheduler_and_says_why(
        slurm: SlurmCluster, app: Any, http: Any, r: Any, redis_url: str, tmp_path: Path) -> None:
    from tests.conftest import post_json
    from tests.support.nvml import AgentProcess, wait_record

    conf = unreachable_controller(slurm, tmp_path / "slurm.conf")
    agent = AgentProcess(NODE, redis_url, tmp_path / "agent.log", env={"SLURM_CONF": str(conf)})
    try:
        info = agent.wait_ready(r)
        assert info["scheduler"] == "none" and not {"drain_node", "resume_node", "requeue_jobs"} & set(info["actions"])
        reason = info["scheduler_reason"]
        assert reason.startswith("scontrol ping: Slurmctld(primary) at ") and reason.endswith(" is DOWN"), reason
        [listed] = [t for t in http.get("/targets").get_json()["targets"] if t["name"] == NODE]
        assert (listed["scheduler"], listed["scheduler_reason"]) == ("none", info["scheduler_reason"])
        assert "scheduler: none (scontrol ping: " in agent.log()
        # The approved XID record drains nothing and fails nothing: its optional drain is skipped.
        [held] = post_json(http, "/webhook", xid("firing")).get_json()["remediations"]
        assert post_json(http, f"/remediations/{held['id']}/approve", {}).status_code == 200
        rec = wait_ticking(app, r, held["id"])
        assert [(a["action"], a["status"], a["reason"]) for a in rec["actions"]] == [
            ("checkpoint_jobs", "skipped", "no_jobs"), ("drain_node", "skipped", "unsupported")]
        assert rec["status"] == "skipped"
        [undo] = post_json(http, "/webhook", xid("resolved")).get_json()["remediations"]
        rec = wait_record(r, undo["id"], timeout=30)
        assert [(a["action"], a["status"], a["reason"]) for a in rec["actions"]] == [
            ("resume_node", "skipped", "unsupported")]
        assert slurm.node_state() == "IDLE"
    finally:
        agent.stop()


def test_an_agent_whose_slurm_controller_answers_drains_through_it_unasked(
        slurm: SlurmCluster, r: Any, redis_url: str, tmp_path: Path) -> None:
    from tests.support.nvml import AgentProcess

    agent = AgentProcess(NODE, redis_url, tmp_path / "agent.log", env={"SLURM_CONF": str(slurm.conf)})
    try:
        info = agent.wait_ready(r)
        assert info["scheduler"] == "slurm" and "scheduler_reason" not in info
        assert {"drain_node", "resume_node", "requeue_jobs"} <= set(info["actions"])
    finally:
        agent.stop()


def test_an_agent_told_no_scheduler_says_so(slurm: SlurmCluster, r: Any, redis_url: str, tmp_path: Path) -> None:
    from tests.support.nvml import AgentProcess

    agent = AgentProcess(NODE, redis_url, tmp_path / "agent.log", env={"SLURM_CONF": str(slurm.conf)},
                         args=["--scheduler", "none"])
    try:
        info = agent.wait_ready(r)
        assert (info["scheduler"], info["scheduler_reason"]) == ("none", "--scheduler none")
        assert "drain_node" not in info["actions"]
    finally:
        agent.stop()
