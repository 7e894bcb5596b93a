"""Time from a bad training step to the LR halved in the loop: the in-loop detector against the Prometheus path.

Run: .venv/bin/python benchmarks/detection_latency.py [--runs 20] [--prometheus-runs 20] [--baseline 150]

Both paths run against the same service (gunicorn, 2 workers, the shipped playbooks), the same embedded Redis
and a real Alertmanager configured as config/alertmanager.yml ships it (group_by, group_wait, group_interval,
repeat_interval read from that file). Each job is a RemediationClient in a loop of 20 ms steps passing a float
loss to poll(); from its bad step on, its loss is 30 times its normal level (a corrupt data shard). The clock
stops when poll() returns the loss-spike playbook's scale_lr acknowledged `applied`.

- detector: --runs jobs one after another, detectors on as shipped (the spike is judged in the loop; the
  service decides it at once).
- prometheus: --prometheus-runs jobs at once, detectors off, heartbeats every 5 s (the default). A real
  Prometheus scrapes the service's /metrics at config/prometheus.yml's scrape and evaluation intervals and
  evaluates config/rules/training.yml unchanged (TrainingLossSpike: twice the 10-minute median, `for: 20s`);
  it sends to the Alertmanager, whose webhook reaches the service. The jobs run normally for --baseline
  seconds first (the rule's median needs normal samples to outnumber the spike's), and their bad steps are
  spread over one evaluation interval so that they meet the scrape and evaluation cycle at every phase.
"""
from __future__ import annotations

import argparse
import random
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from common import ROOT, TOKEN, Stack, percentile

import torch  # noqa: E402

from tests.support.stack import PROMETHEUS, Alertmanager, _Child  # noqa: E402
from trainmedic.client import RemediationClient  # noqa: E402
from trainmedic.service.embedded_redis import free_port  # noqa: E402

STEP = 0.02
NORMAL, SPIKE = 2.0, 60.0


def shipped_alertmanager() -> dict[str, str]:
    """group_wait, group_interval and repeat_interval of config/alertmanager.yml's route."""
    route = yaml.safe_load((ROOT / "config" / "alertmanager.yml").read_text())["route"]
    return {k: str(route[k]) for k in ("group_wait", "group_interval", "repeat_interval")}


def shipped_prometheus() -> dict[str, str]:
    """scrape_interval and evaluation_interval of config/prometheus.yml."""
    glob = yaml.safe_load((ROOT / "config" / "prometheus.yml").read_text())["global"]
    return {k: str(glob[k]) for k in ("scrape_interval", "evaluation_interval")}


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in ("ms", "s", "m", "h"):
        if duration.endswith(unit):
            return float(duration[:-len(unit)]) * units[unit]
    return float(duration)


class Prometheus(_Child):
    """Debian's prometheus with the shipped intervals, scraping the service and evaluating the shipped rules."""

    def __init__(self, workdir: Path, service: str, alertmanager: str, intervals: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = workdir / "prometheus.yml"
        conf.write_text(yaml.safe_dump({
            "global": intervals, "rule_files": [str(ROOT / "config" / "rules" / "training.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
            "scrape_configs": [{"job_name": "trainmedic", "static_configs": [{"targets": [service]}]}]}))
        self._spawn([PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={workdir / 'prometheus-data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}"], workdir / "prometheus.log")
        self._wait_ready("/-/ready", 30)


def run_job(url: str, job: str, detect: bool, bad_at: float | None, timeout: float, out: dict[str, Any]) -> None:
    """A 20 ms-step loop: normal losses until the wall clock reaches bad_at (None: 1 s after the loop starts),
    then spiked ones until scale_lr is applied; out gets the time from the first bad step to that poll, and
    the steps in between."""
    rng = random.Random(job)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    rc = RemediationClient(job=job, redis_url=url, optimizer=opt, detect=detect)
    # At least a second of normal losses: the detector judges spikes from its 20th loss on.
    bad_at = max(bad_at or 0.0, time.time() + 1.0)
    try:
        step, first_bad, bad_step = 0, None, None
        while True:
            started = time.time()
            if first_bad is None and started >= bad_at:
                first_bad, bad_step = started, step
            loss = (SPIKE if first_bad is not None else NORMAL) * (1 + 0.1 * rng.random())
            for ack in rc.poll(step=step, loss=loss):
                if ack.action == "scale_lr" and ack.status == "applied" and first_bad is not None:
                    out[job] = (time.time() - first_bad, step - (bad_step or 0))
                    return
            if first_bad is not None and started - first_bad > timeout:
                out[job] = None
                return
            step += 1
            time.sleep(max(0.0, STEP - (time.time() - started)))
    finally:
        rc.close()


def summary(name: str, results: dict[str, Any], asked: int) -> None:
    done = [v for v in results.values() if v is not None]
    if not done:
        print(f"{name}: no run reached applied ({asked} asked)")
        return
    secs = [d for d, _ in done]
    steps = [s for _, s in done]
    print(f"{name}: {len(done)} of {asked} runs applied; bad step -> applied p50 {percentile(secs, 50):.3f} s, "
          f"p99 {percentile(secs, 99):.3f} s (min {min(secs):.3f}, max {max(secs):.3f}); steps p50 "
          f"{percentile(steps, 50):.0f}, max {max(steps)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20, help="detector runs, one after another")
    ap.add_argument("--prometheus-runs", type=int, default=20, help="Prometheus-path jobs, all at once")
    ap.add_argument("--baseline", type=float, default=150.0, help="seconds of normal losses before the bad step")
    args = ap.parse_args()
    am_conf, prom_conf = shipped_alertmanager(), shipped_prometheus()
    print(f"Alertmanager as shipped: {am_conf}; Prometheus as shipped: {prom_conf}")
    stack = Stack(workers=2)
    am = Alertmanager(stack.tmp, stack.url + "/webhook", TOKEN, **am_conf)
    stack.extra_env["TRAINMEDIC_ALERTMANAGER_URL"] = am.url
    try:
        with stack:
            detector: dict[str, Any] = {}
            for i in range(args.runs):
                run_job(stack.redis_url, f"detect-{i:02d}", True, None, 30.0, detector)
            summary("detector", detector, args.runs)

            if args.prometheus_runs:
                prom = Prometheus(stack.tmp, stack.url.removeprefix("http://"), am.url.removeprefix("http://"),
                                  prom_conf)
                try:
                    via_prom: dict[str, Any] = {}
                    spread = seconds(prom_conf["evaluation_interval"])
                    start = time.time() + args.baseline
                    threads = [threading.Thread(target=run_job, args=(
                        stack.redis_url, f"prom-{i:02d}", False, start + spread * i / args.prometheus_runs, 300.0,
                        via_prom)) for i in range(args.prometheus_runs)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    summary("prometheus", via_prom, args.prometheus_runs)
                finally:
                    prom.stop()
    finally:
        am.stop()


if __name__ == "__main__":
    main()
