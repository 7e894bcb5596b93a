"""`trainmedic replay` over a week of alerts for 1,000 targets (about 20,000 episodes), and `trainmedic test` on
the shipped playbooks' tests.

Run: .venv/bin/python benchmarks/replay_scale.py [--targets 1000] [--episodes 20000] [--days 7] [--against]
The history: each target's alerts in bursts (a flapping GPU, a loss that spikes again), written as OpenMetrics
ALERTS samples every 30 s while they fire, backfilled with `promtool tsdb create-blocks-from openmetrics` and
served by Debian's prometheus started on that data dir. Then `trainmedic replay --since 7d --json` runs as a
user runs it (a process of its own, the shipped playbooks; with --against, a copy whose cooldowns are doubled),
timed from start to exit; its JSON says how long reading Prometheus and the replay itself took.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from xml.etree import ElementTree

import yaml

from common import ROOT

from trainmedic.service.cli.replay import table
from trainmedic.service.playtest.replay import Tally

from tests.support import history
from tests.support.history import HistoricPrometheus

TRAINMEDIC = Path(sys.executable).parent / "trainmedic"
STEP = 30
# Alerts of the shipped playbooks, by the kind of target they name, with how long an episode lasts (s).
JOB_ALERTS = [({"alertname": "TrainingLossSpike", "severity": "critical"}, (60, 900)),
              ({"alertname": "GPUMemoryUsageHigh", "severity": "warning"}, (120, 1800)),
              ({"alertname": "TrainingThroughputDrop", "severity": "warning"}, (300, 3600)),
              ({"alertname": "TrainingLossNaN", "severity": "critical"}, (60, 300))]
NODE_ALERTS = [({"alertname": "GPUTemperatureHigh", "severity": "warning"}, (120, 1800)),
               ({"alertname": "DiskSpaceLow", "severity": "warning"}, (600, 7200)),
               ({"alertname": "GPUXidError", "severity": "critical", "xid_class": "drain"}, (300, 3600))]


def make_history(targets: int, episodes: int, days: float, until: int, seed: int = 7) -> list[history.Run]:
    """Runs of alerts: bursts of one to five episodes per target and alert, 8 to 40 minutes apart (longer than
    Prometheus's lookback, so each stays one run), spread over the window."""
    rng = random.Random(seed)
    jobs = max(1, targets * 7 // 10)
    start = until - int(days * 86400)
    runs: list[history.Run] = []
    busy: dict[tuple[str, str], int] = {}  # (target, alertname) -> when its last run ended
    while len(runs) < episodes:
        i = rng.randrange(targets)
        if i < jobs:
            base, (lo, hi) = rng.choice(JOB_ALERTS)
            labels = {**base, "job_name": f"job-{i:04d}", "instance": f"node-{i % (targets - jobs):04d}:9445"}
        else:
            base, (lo, hi) = rng.choice(NODE_ALERTS)
            labels = {**base, "node": f"node-{i - jobs:04d}", "gpu_id": str(rng.randrange(8))}
        key = (labels.get("job_name") or labels["node"], labels["alertname"])
        at = start + rng.randrange(0, int(days * 86400) - 4 * 3600) // STEP * STEP
        for _ in range(rng.randint(1, 5)):
            if len(runs) >= episodes:
                break
            if busy.get(key, -1) + 600 >= at:
                break  # overlaps a run of the same alert
            length = rng.randrange(lo, hi) // STEP * STEP
            runs.append((labels, float(at), float(at + length)))
            busy[key] = at + length
            at += length + rng.randrange(480, 2400) // STEP * STEP
    return runs


def doubled_cooldowns(tmp: Path) -> Path:
    """The shipped playbooks with every cooldown doubled (what --against compares)."""
    doc = yaml.safe_load((ROOT / "playbooks" / "default.yaml").read_text())
    for pb in doc["playbooks"]:
        if pb.get("cooldown"):
            pb["cooldown"] = f"{2 * int(str(pb['cooldown'])[:-1])}{str(pb['cooldown'])[-1]}"
    path = tmp / "doubled.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def playbook_tests(tmp: Path) -> str:
    """`trainmedic test playbooks/tests/` as a user runs it: its wall time, and each test's from its JUnit."""
    report = tmp / "junit.xml"
    t = time.perf_counter()
    out = subprocess.run([str(TRAINMEDIC), "test", "playbooks/tests/", "--junit", str(report)], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"trainmedic test failed: {out.stdout}{out.stderr}")
    times = sorted(float(c.get("time") or 0) for c in ElementTree.parse(report).getroot().iter("testcase"))
    return (f"trainmedic test playbooks/tests/: {len(times)} tests in {wall:.1f}s wall (the process, its scratch "
            f"Redis and every test); per test median {statistics.median(times) * 1000:.0f} ms, slowest "
            f"{times[-1] * 1000:.0f} ms (the longest runs 24 virtual hours)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", type=int, default=1000)
    ap.add_argument("--episodes", type=int, default=20000)
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--against", action="store_true", help="also replay a copy with doubled cooldowns")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-replay-bench-"))
    tests_line = playbook_tests(tmp)
    until = (int(time.time()) // 3600) * 3600 - 3600
    runs = make_history(args.targets, args.episodes, args.days, until)
    t = time.perf_counter()
    data = history.backfill(tmp, runs, every=STEP)
    backfilled = time.perf_counter() - t
    prometheus = HistoricPrometheus(tmp, data)
    try:
        argv = [str(TRAINMEDIC), "replay", "--prometheus", prometheus.url, "--since", f"{args.days:g}d",
                "--until", str(until), "--step", f"{STEP}s"]
        if args.against:
            argv += ["--against", str(doubled_cooldowns(tmp))]
        t, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=3600, cwd=ROOT)
        wall, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
        # CPU of the replay, its worker processes and their scratch Redis servers (all waited for).
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    finally:
        prometheus.stop()
    if out.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"replay failed: {out.stderr}")
    got = json.loads(out.stdout)
    load = os.getloadavg()
    print(f"replay_scale: {args.targets} targets, {len(runs)} runs of alerts over {args.days:g} days "
          f"(backfilled in {backfilled:.0f}s), {STEP}s steps; load average {load[0]:.1f} / {load[1]:.1f} on "
          f"{os.cpu_count()} cores")
    print(tests_line)
    print(f"trainmedic replay{' --against' if args.against else ''}: {wall:.1f}s wall (read Prometheus "
          f"{got['seconds']['read']:.1f}s, replay {got['seconds']['replay']:.1f}s), {cpu:.1f}s of CPU in all; "
          f"{got['episodes']} episodes of {got['series']} series, {len(got['changed'])} decisions changed")
    tallies = [{k: Tally(v["matched"], v["dispatched"], v["held"], Counter(v["skipped"]))
                for k, v in got[key].items()} for key in ("playbooks", "against") if key in got]
    for line in table(tallies):
        print(f"    {line}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
