"""`make demo` closes the loop for real: Prometheus rule -> Alertmanager -> webhook -> the toy job's LR halved."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def _started(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/PID/stat), which tells it from a later one with its pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _descendants(root: int) -> dict[int, str]:
    """Every process below root (children in sessions of their own included), with its start time."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found and (started := _started(pid)) is not None:
                found[pid] = started
                todo.append(pid)
    return found


@pytest.mark.parametrize(("signum", "after"), [
    (signal.SIGTERM, "Waiting for the loss spike"),  # everything runs
    (signal.SIGHUP, "- starting Alertmanager"),       # a closed terminal while it starts
], ids=["SIGTERM while it runs", "SIGHUP while it starts"])
def test_a_stopped_demo_leaves_no_process_and_no_temporary_folder(signum: int, after: str, tmp_path: Path) -> None:
    out = tmp_path / "demo.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "demo.py"), "--spike-at", "1000000",
                                 "--timeout", "600"], stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        while after not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)
        [work] = re.findall(r"logs and data in (\S+)", out.read_text())
        children = _descendants(proc.pid)
        assert len(children) >= 3, children  # Redis, the service (with its gunicorn and agent), the trainer
        proc.send_signal(signum)
        assert proc.wait(120) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for pid, started in children.items() if _started(pid) == started}
    assert left == {}, out.read_text()
    assert not Path(work).exists()
    assert "Stopping..." in out.read_text() and "Traceback" not in out.read_text()
