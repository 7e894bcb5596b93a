"""`make demo` closes the loop for real: Prometheus rule -> Alertmanager -> webhook -> the toy job's LR halved."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import ROOT

ALERT = "TrainingLossSpike"


def test_make_demo_halves_the_lr_of_the_spiking_job(tmp_path: Path) -> None:
    summary = tmp_path / "demo.json"
    proc = subprocess.run(["make", "-s", "demo", f"DEMO_ARGS=--exit --summary {summary}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["record_status"] == "applied" and result["scale_lr_status"] == "applied"
    assert result["new_lr"][0] == result["old_lr"][0] * 0.5
    # The rollback skipped the corrupt shard: the alert resolved, and the record says it worked, and how fast.
    assert result["outcome"] == "effective" and result["time_to_resolve_s"] >= 0
    assert "trainmedic: outcome effective" in proc.stdout and f"{ALERT} resolved" in proc.stdout
    assert "Timeline" in proc.stdout and "History page: http://127.0.0.1:" in proc.stdout
    assert "Prometheus: TrainingLossSpike firing" in proc.stdout
