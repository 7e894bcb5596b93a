"""The built-in rollback_checkpoint of both callbacks, under a real loss spike and the shipped loss-spike playbook.

Each run is tests/rollback_worker.py in real processes (one, or two gloo ranks): a tiny GPT-2 under the Transformers
Trainer or a tiny Lightning model, checkpoints every 10 steps, a spike at step 45. The test sends scale_lr 0.8
before checkpoint 40 and scale_lr 0.9 after it, then fires TrainingLossSpike (startsAt: the spike) through the
webhook at step 52, after checkpoint 50 has saved the spoiled weights: the rollback must pick checkpoint 40.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
import redis

from trainmedic.client.trainer.state import AppliedState
from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import Ack, ActionCall, Command, rfc3339
from trainmedic.service.embedded_redis import free_port
from tests.conftest import ROOT, post_json
from tests.support.jobs import send, settled, wait_record, wait_until

STEPS, SAVE_EVERY, SPIKE_AT = 90, 10, 45
HOLD, SLOW = "hold", "slow"


def start(framework: str, world: int, tmp: Path, redis_url: str, job: str, gates: dict[int, str],
          spike_at: int = SPIKE_AT, steps: int = STEPS, **extra: Any) -> list[subprocess.Popen]:
    """Start the ranks of tests/rollback_worker.py (extra: more of its config, such as resume_from)."""
    cfg = {"framework": framework, "job": job, "redis_url": redis_url, "dir": str(tmp), "steps": steps,
           "save_every": SAVE_EVERY, "spike_at": spike_at, "gates": {str(k): v for k, v in gates.items()}, **extra}
    port, procs = free_port(), []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        mine = json.dumps({**cfg, "out": str(tmp / f"rank{rank}.json")})
        with open(tmp / f"rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.rollback_worker", mine], cwd=ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT))
    return procs


def run(framework: str, world: int, tmp: Path, redis_url: str, job: str, gates: dict[int, str],
        on_gate: dict[int, Callable[[dict], None]], spike_at: int = SPIKE_AT, steps: int = STEPS,
        **extra: Any) -> list[dict]:
    """Start the ranks, call on_gate[step](gate info) as rank 0 reaches each gate, return what each rank saw."""
    procs = start(framework, world, tmp, redis_url, job, gates, spike_at, steps, **extra)
    logs = lambda: "\n".join((tmp / f"rank{i}.log").read_text()[-3000:] for i in range(world))  # noqa: E731
    done: set[int] = set()
    deadline = time.monotonic() + 240
    try:
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, logs()
            for step, act in on_gate.items():
                gate = tmp / f"gate-{step}.json"
                if step not in done and gate.exists():
                    done.add(step)
                    act(json.loads(gate.read_text()))
            if any(p.poll() not in (None, 0) for p in procs):
                raise AssertionError(logs())
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), logs()
    assert done == set(on_gate), (done, logs())
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(world)]


def spike_alert(job: str, t_spike: float) -> dict:
    """Alertmanager's webhook body for TrainingLossSpike on this job, begun at the spike."""
    labels = {"alertname": "TrainingLossSpike", "job_name": job, "severity": "critical"}
    alert = {"status": "firing", "labels": labels, "annotations": {"summary": "Training loss spike detected"},
             "startsAt": rfc3339(t_spike), "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "",
             "fingerprint": hashlib.sha256(job.encode()).hexdigest()[:16]}
    return {"receiver": "trainmedic", "status": "firing", "alerts": [alert], "groupLabels": {}, "commonLabels": labels,
            "commonAnnotations": {}, "externalURL": "http://alertmanager:9093", "version": "4",
            "groupKey": "{}:{alertname=\"TrainingLossSpike\"}", "truncatedAlerts": 0}


def fire(http: Any, job: str, t_spike: float) -> str:
    """POST the alert to the webhook (the shipped playbooks); returns the loss-spike record's id."""
    resp = post_json(http, "/webhook", spike_alert(job, t_spike))
    assert resp.status_code == 200, resp.get_json()
    [made] = [m for m in resp.get_json()["remediations"] if m["playbook"] == "loss-spike"]
    assert made["status"] == "dispatched", made
    return str(made["id"])


def rows_by_step(rank: dict) -> dict[int, list]:
    steps = [row[0] for row in rank["rows"]]
    assert steps == list(range(1, len(steps) + 1)), steps  # the global step kept counting, one by one
    return {row[0]: row for row in rank["rows"]}


def own_ack(rank: dict, rid: str, index: int) -> dict:
    """This rank's own result for an action, from its client's state (the record shows rank 0's)."""
    [items] = [items for r, _, items in rank["state"]["commands"] if r == rid]
    [(_, action, status, _, result)] = [i for i in items if i[0] == index]
    return {"action": action, "status": status, "result": result}


class Scenario:
    """scale_lr 0.8 at gate 10, scale_lr 0.9 at gate 42, the alert at gate 52, slow steps from 54 until 0.9 is
    applied again; optionally a replay at gate 60."""

    def __init__(self, r: redis.Redis, http: Any, job: str, tmp: Path, replay: bool):
        self.r, self.http, self.job, self.tmp = r, http, job, tmp
        self.ids: dict[str, str] = {}
        self.records: dict[str, dict] = {}  # as they stood before the replay (Redis loses them then)
        self.gates = {10: HOLD, 42: HOLD, 52: HOLD, 54: SLOW, **({60: SLOW} if replay else {})}
        self.on_gate: dict[int, Callable[[dict], None]] = {
            10: lambda g: self.ids.setdefault("before", send(r, job, "scale_lr", {"factor": 0.8})),
            42: lambda g: self.ids.setdefault("after", send(r, job, "scale_lr", {"factor": 0.9})),
            52: lambda g: self.ids.setdefault("spike", fire(http, job, g["t_spike"])),
            54: self.reapplied,
        }
        if replay:
            self.on_gate[60] = self.replay

    def reapplied(self, gate: dict) -> None:
        """Steps go on slowly until the ledger has been read and scale_lr 0.9 applied again (within a second)."""
        self.settle()
        (self.tmp / "go-54").write_text("")

    def replay(self, gate: dict) -> None:
        """Redis loses everything and Alertmanager resends the same alert: a new record of the same episode."""
        self.r.flushall()
        beat = keys.heartbeat(keys.Target("job", self.job))
        wait_until(lambda: self.r.get(beat), timeout=10, what="the job's heartbeat after the flush")
        self.ids["replay"] = fire(self.http, self.job, gate["t_spike"])
        self.records["replay"] = wait_record(self.r, self.ids["replay"], timeout=30)
        (self.tmp / "go-60").write_text("")

    def settle(self) -> None:
        """Every record done, and scale_lr 0.9 applied again after the rollback undid it."""
        for name, rid in self.ids.items():
            if name in self.records:
                continue
            again: Callable[[dict | None], bool] = settled
            if name == "after":
                again = lambda rec: settled(rec) and bool(rec and rec["actions"][0].get("reapplied"))  # noqa: E731
            self.records[name] = wait_record(self.r, rid, until=again, timeout=30)


def check_rollback(ranks: list[dict], sc: Scenario, framework: str) -> dict:
    """What every scenario run must show; returns the measured figures."""
    spike = sc.records["spike"]
    roll, halve = spike["actions"]
    assert spike["status"] == "applied", spike
    assert roll["action"] == "rollback_checkpoint" and roll["status"] == "applied", roll
    assert halve["action"] == "scale_lr" and halve["status"] == "applied", halve
    at = roll["result"]["step"]
    assert at == 53  # held at gate 52, so the next step's poll applied it
    assert roll["result"]["checkpoint_step"] == 40 and roll["result"]["skipped_batches"] == at - 40
    name = "checkpoint-40" if framework == "hf" else "step=40.ckpt"
    assert Path(roll["result"]["checkpoint"]).name == name, roll["result"]
    # Checkpoint 50 holds the spoiled weights: saved after the alert began, so passed over.
    assert (sc.tmp / ("hf/checkpoint-50" if framework == "hf" else "pl/step=50.ckpt")).exists()
    before, after = sc.records["before"]["actions"][0], sc.records["after"]["actions"][0]
    assert before["result"]["step"] == 11 and after["result"]["step"] == 43
    assert not before.get("reapplied"), before  # in checkpoint 40 already: never applied twice
    [again] = after["reapplied"]  # undone by the rollback, applied again once from the ledger
    assert at < again["step"], again
    figures: dict[str, Any] = {}
    for rank in ranks:
        assert rank["world"] == len(ranks) and rank["global_step"] == STEPS  # training finished
        rows = rows_by_step(rank)
        own = own_ack(rank, sc.ids["spike"], 0)
        assert own["status"] == "applied" and own["result"]["checkpoint_step"] == 40
        assert Path(own["result"]["checkpoint"]).name == name  # every rank restored the same checkpoint
        probe = {s: row[1] for s, row in rows.items()}
        # The spike is measurable; the rollback put back checkpoint 40's weights exactly, and the next step's
        # loss is within a few percent of its pre-spike level.
        assert probe[SPIKE_AT] > 2 * probe[SPIKE_AT - 1], (probe[SPIKE_AT - 1], probe[SPIKE_AT])
        assert probe[at] == pytest.approx(probe[40], rel=1e-6)
        assert probe[at + 1] == pytest.approx(probe[SPIKE_AT - 1], rel=0.05)
        # The scheduler came back to step 40 and goes on from there; the global step did not.
        pos = {s: row[3] for s, row in rows.items()}
        assert pos[at - 1] == at - 1 and pos[at] == 40 and pos[STEPS] == 40 + STEPS - at
        # The LR over the untouched twin's at the same scheduler position: 0.8 from step 11, 0.72 from 43,
        # 0.4 at the rollback (checkpoint 40 held 0.8; the playbook halves it), 0.36 once 0.9 is applied again.
        ratio = {s: row[4] for s, row in rows.items() if row[4] is not None}
        expect = {s: 1.0 if s < 11 else 0.8 if s < 43 else 0.72 if s < at else 0.4 if s < again["step"] else 0.36
                  for s in ratio}
        bad = [(s, ratio[s], expect[s]) for s in ratio if not math.isclose(ratio[s], expect[s], rel_tol=1e-6)]
        assert not bad, bad[:5]
        figures[f"rank{rank['rank']}"] = {"pre_spike_loss": probe[SPIKE_AT - 1], "spike_loss": probe[SPIKE_AT],
                                          "loss_at_checkpoint": probe[40], "restored_loss": probe[at],
                                          "post_rollback_loss": probe[at + 1], "lr_vs_twin_end": ratio[STEPS - 1]}
    figures.update(rollback=roll["result"], reapplied_at=again["step"])
    return figures


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_a_loss_spike_rolls_back_to_the_checkpoint_before_it_and_a_replay_does_not_roll_back_again(
        framework: str, r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    job = f"{framework}-spike"
    sc = Scenario(r, make_app().test_client(), job, tmp_path, replay=True)
    ranks = run(framework, 1, tmp_path, redis_url, job, sc.gates, sc.on_gate)
    figures = check_rollback(ranks, sc, framework)
    print(json.dumps(figures))
    # The resent alert is answered with the first rollback's acks: no second rollback, no second halving.
    replay = sc.records["replay"]
    assert replay["status"] == "applied" and replay["id"] != sc.ids["spike"]
    assert [a["result"] for a in replay["actions"]] == [a["result"] for a in sc.records["spike"]["actions"]]
    rows = rows_by_step(ranks[0])
    assert all(rows[s][3] == rows[s - 1][3] + 1 for s in range(54, STEPS + 1))  # the scheduler never went back
    assert all(math.isclose(rows[s][4], 0.36, rel_tol=1e-6) for s in range(61, STEPS))


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_every_rank_of_a_distributed_run_restores_the_same_checkpoint_at_the_same_step(
        framework: str, r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    job = f"{framework}-spike-ddp"
    sc = Scenario(r, make_app().test_client(), job, tmp_path, replay=False)
    ranks = run(framework, 2, tmp_path, redis_url, job, sc.gates, sc.on_gate)
    sc.settle()
    figures = check_rollback(ranks, sc, framework)
    print(json.dumps(figures))
    roll = sc.records["spike"]["actions"][0]
    assert roll["result"]["ranks"] == 2 and roll["result"]["ranks_applied"] == 2
    assert ranks[0]["rows"] == ranks[1]["rows"]  # same weights, LR and schedule on both ranks, step by step


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_no_checkpoint_from_before_the_alert_fails_the_rollback_in_one_sentence_and_training_goes_on(
        framework: str, r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    job = f"{framework}-too-late"
    http = make_app().test_client()
    ids: dict[str, str] = {}
    # The spike at step 5 comes before checkpoints 10 and 20: neither was saved before the alert began.
    ranks = run(framework, 1, tmp_path, redis_url, job, {25: HOLD},
                {25: lambda g: ids.setdefault("spike", fire(http, job, g["t_spike"]))}, spike_at=5, steps=40)
    rec = wait_record(r, ids["spike"])
    roll, halve = rec["actions"]
    assert rec["status"] == "partially_applied" and halve["status"] == "applied"
    assert roll["status"] == "failed", roll
    error = roll["result"]["error"]
    assert error.startswith("None of the 2 checkpoints in "), error
    assert error.endswith(f"was saved before the alert began ({rfc3339(ranks[0]['t_spike'])}), "
                          "so there is nothing to roll back to."), error
    rows = rows_by_step(ranks[0])
    assert ranks[0]["global_step"] == 40 and rows[26][3] == 26  # nothing restored; training went on to the end


def test_the_client_state_merges_a_rolled_back_checkpoint_and_forgets_nothing_newer() -> None:
    def cmd(rid: str, action: str) -> Command:
        return Command(rid, "job", "j", (ActionCall(0, action),), 0.0, 1e12, fence=f"episode-{rid}")

    def applied(c: Command) -> list[Ack]:
        return [Ack(c.record_id, 0, c.actions[0].action, "applied", {"step": 1}, "me")]

    state = AppliedState()
    before, after, save = cmd("before", "scale_lr"), cmd("after", "scale_lr"), cmd("save", "save_checkpoint")
    state.remember(before, applied(before))
    checkpoint = state.state_dict()
    state.remember(after, applied(after))
    state.remember(save, applied(save))
    assert state.rolled_back_to(checkpoint) == [("after", 0)]  # the restored optimizer lacks only that change
    # The ledger applies again what the checkpoint lacks, and only that.
    assert state.applied("before", 0) and not state.applied("after", 0)
    # A repeat of anything this run handled, by record or by episode, is still answered, never applied again.
    assert state.seen(after) and state.seen(save) and state.seen(replace(save, record_id="resent"))
    # A checkpoint saved before the re-apply keeps that to do; the re-apply clears it.
    later = AppliedState()
    later.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert not later.applied("after", 0) and later.seen(save)
    state.mark_applied("after", 0, "scale_lr", {"step": 9}, "me")
    assert state.applied("after", 0) and "undone" not in state.state_dict()
    # Rolling back to a checkpoint that held the change (saved after it) undoes nothing.
    assert later.rolled_back_to(state.state_dict()) == []
