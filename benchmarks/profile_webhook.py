"""Profile the webhook's gunicorn workers with py-spy under the storm load of baseline_compare.py.

Run: .venv/bin/python benchmarks/profile_webhook.py [--group 10] [--seconds 15]
Needs py-spy (`.venv/bin/pip install py-spy`) and wrk. Writes the collapsed stacks and a summary of the top
frames (self and inclusive share of the samples) to benchmarks/results/webhook_profile_<group>.txt.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from common import ROOT, TOKEN, Stack

RESULTS = ROOT / "benchmarks" / "results"


def summarize(collapsed: str, top: int) -> str:
    """Top frames by self samples and by inclusive samples, from py-spy's raw (collapsed) output."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = stack.split(";")
        if any("wait" in f and "threading.py" in f for f in frames[-2:]) or "select" in frames[-1]:
            continue  # idle threads (the gthread pool waiting, the reconciler sleeping)
        total += count
        own[_short(frames[-1])] += count
        for f in set(map(_short, frames)):
            incl[f] += count
    lines = [f"busy samples: {total}", "", f"top {top} frames by self time:"]
    for f, n in own.most_common(top):
        lines.append(f"  {100 * n / total:5.1f}%  {f}")
    lines += ["", f"top {top} frames by inclusive time:"]
    for f, n in incl.most_common(top):
        lines.append(f"  {100 * n / total:5.1f}%  {f}")
    return "\n".join(lines)


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)"; keep site-packages names readable
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if parts else path
    return f"{name} ({short})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", type=int, default=10)
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    RESULTS.mkdir(exist_ok=True)
    raw = RESULTS / f"webhook_profile_{args.group}{args.tag}.collapsed"
    with Stack(workers=4, playbooks=str(ROOT / "playbooks"), env={"TRAINMEDIC_LOG_LEVEL": "info"}) as stack:
        env = dict(os.environ, TRAINMEDIC_BENCH_GROUP=str(args.group), TRAINMEDIC_BENCH_TOKEN=TOKEN,
                   TRAINMEDIC_BENCH_RUN="200")
        load = subprocess.Popen(["wrk", "-t", "2", "-c", "8", "-d", f"{args.seconds + 4}s", "--latency", "-s",
                                 str(ROOT / "benchmarks" / "storm.lua"), stack.url + "/webhook"],
                                env=env, stdout=subprocess.PIPE, text=True)
        time.sleep(2)
        subprocess.run([spy, "record", "--nonblocking", "--subprocesses", "--pid", str(stack.proc.pid),
                        "--rate", "200", "--duration", str(args.seconds), "--format", "raw", "--output", str(raw)],
                       check=True, capture_output=True)
        out, _ = load.communicate()
    summary = summarize(raw.read_text(), args.top)
    text = (f"py-spy record --nonblocking --subprocesses (gunicorn master and its 4 workers), {args.seconds}s at "
            f"200 Hz, under wrk 8 connections with {args.group}-alert storm groups (benchmarks/storm.lua)\n"
            + out.strip().splitlines()[-1] + "\n\n" + summary + "\n")
    (RESULTS / f"webhook_profile_{args.group}{args.tag}.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
