"""Loading playbooks: defaults, matching, line numbers (deeper checks are in test_check.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from trainmedic.service.rules.playbooks import PlaybookError, load

from tests.conftest import ROOT


def test_the_shipped_playbooks_answer_the_contract_alerts_and_the_xid_error() -> None:
    pbs = {p.name: p for p in load([ROOT / "playbooks"])}
    by_alert = {m.value: p for p in pbs.values() for m in p.matchers if m.name == "alertname"}
    assert set(by_alert) == {"GPUTemperatureHigh", "GPUMemoryUsageHigh", "TrainingLossSpike", "DiskSpaceLow",
                             "TrainingThroughputDrop", "GPUXidError", "TrainingLossNaN", "TrainingHang",
                             "TrainingStraggler", "NodeLemon"}
    assert by_alert["GPUXidError"].approval and [s.action for s in by_alert["GPUXidError"].actions] == [
        "checkpoint_jobs", "drain_node"]
    # A straggler's node saves its jobs' checkpoints, then leaves Slurm's service and its jobs start elsewhere;
    # a lemon node is drained. Both wait for a person and nothing resumes them.
    straggler, lemon = by_alert["TrainingStraggler"], by_alert["NodeLemon"]
    assert (straggler.name, straggler.target, straggler.approval) == ("straggler", "node", True)
    assert [(s.action, s.params, s.optional) for s in straggler.actions] == [
        ("checkpoint_jobs", {"timeout": "5m"}, False), ("drain_node", {"reason": "straggler"}, True),
        ("requeue_jobs", {}, True)]
    assert straggler.max_active and not straggler.on_resolved
    assert (lemon.name, lemon.target, lemon.approval, lemon.on_resolved) == ("lemon-node", "node", True, ())
    assert [(s.action, s.params, s.optional) for s in lemon.actions] == [("drain_node", {"reason": "lemon"}, True)]
    # A NaN is answered as a spike is; a hung loop cannot apply anything: recorded, and notified when configured.
    assert [(s.action, s.params, s.optional) for s in by_alert["TrainingLossNaN"].actions] == [
        ("rollback_checkpoint", {}, True), ("scale_lr", {"factor": 0.5, "min_lr": 1e-7}, False)]
    assert by_alert["TrainingHang"].target == "job" and not by_alert["TrainingHang"].actions
    gpu = by_alert["GPUTemperatureHigh"]
    assert gpu.target == "node" and [s.action for s in gpu.actions] == ["power_limit"]
    assert gpu.actions[0].params == {"fraction": 0.8}
    assert [s.action for s in gpu.on_resolved] == ["restore_power_limit"]
    assert [s.action for s in by_alert["GPUMemoryUsageHigh"].actions] == ["empty_cache", "reduce_batch_size"]
    assert [s.action for s in by_alert["TrainingLossSpike"].actions] == ["rollback_checkpoint", "scale_lr"]
    assert by_alert["DiskSpaceLow"].actions[0].params == {"keep_last": 3, "older_than": "7d"}
    # The shipped playbooks (README): the steps a plain client cannot apply are optional.
    assert [(s.action, s.optional) for s in by_alert["GPUMemoryUsageHigh"].actions] == [
        ("empty_cache", False), ("reduce_batch_size", True)]
    assert [(s.action, s.optional) for s in by_alert["TrainingLossSpike"].actions] == [
        ("rollback_checkpoint", True), ("scale_lr", False)]
    drop = by_alert["TrainingThroughputDrop"].actions
    assert [(s.action, s.params, s.optional) for s in drop] == [
        ("reduce_dataloader_workers", {"factor": 0.5, "min": 1}, True),
        ("enable_gradient_accumulation", {"steps": 2}, True)]
    assert all('nodename="$node"' in (s.when or "") for s in drop)
    assert "node_cpu_seconds_total" in (drop[0].when or "") and "> 0.8" in (drop[0].when or "")
    assert "MemAvailable" in (drop[1].when or "") and "> 0.85" in (drop[1].when or "")


def test_defaults_are_on_the_safe_side(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text('playbooks:\n  - name: a\n    matchers: [\'alertname="A"\']\n    target: job\n'
                 '    actions: [stop_training]\n')
    [pb] = load([f])
    assert (pb.cooldown, pb.max_runs, pb.approval, pb.dry_run, pb.expire_after) == (0.0, None, False, False, 3600.0)
    assert pb.source == f"{f}:2"


def test_a_playbook_matches_only_when_every_matcher_holds() -> None:
    pb = next(p for p in load([ROOT / "playbooks"]) if p.name == "loss-spike")
    assert pb.matches({"alertname": "TrainingLossSpike", "severity": "warning"})
    assert not pb.matches({"alertname": "TrainingLossSpike", "severity": "info"})


def test_invalid_playbooks_raise_with_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text('playbooks:\n  - name: a\n    matchers: [\'alertname="A"\']\n    target: job\n'
                 '    actions:\n      - scale_lr: {factor: 20}\n')
    with pytest.raises(PlaybookError) as exc:
        load([f])
    assert exc.value.problems == [f"{f}:6: scale_lr: factor must be <= 10, not 20"]
