"""Cost of a /metrics scrape as targets grow, and of rendering the history pages, under gunicorn.

Run: .venv/bin/python benchmarks/scrape_and_page.py [--targets 10,100,1000] [--scrapes 40]
Each target gets one loss-spike remediation through POST /webhook; three in four are acked through the
client's Mailbox (the ACK script counts them), the rest stay in their mailbox as backlog. A scrape reads
every target's ack stats, heartbeat and backlog from Redis, so its cost grows with the number of targets.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import redis
import requests

from common import ROOT, TOKEN, Stack, percentile

from trainmedic.client.wire import keys
from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire.protocol import Ack

FIXTURE = json.loads((ROOT / "tests/fixtures/alertmanager-0.25/firing_single.json").read_text())
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def seed(url: str, r: redis.Redis, first: int, last: int) -> None:
    """Targets job-first .. job-(last-1): one remediation each, three in four acked."""
    def send(i: int) -> None:
        body = copy.deepcopy(FIXTURE)
        body["alerts"][0]["labels"]["job_name"] = f"bench-{i}"
        body["alerts"][0]["fingerprint"] = f"b{i}"
        requests.post(url + "/webhook", data=json.dumps(body), headers=HEADERS, timeout=10).raise_for_status()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, range(first, last)))
    for i in range(first, last):
        if i % 4 == 3:
            continue
        box = Mailbox(r, keys.Target("job", f"bench-{i}"))
        for e in box.fetch():
            box.claim(e)
            box.ack([Ack(e.command.record_id, a.index, a.action, "applied", {}, "bench:1") for a in e.command.actions])


def timed_gets(url: str, n: int) -> list[float]:
    s = requests.Session()
    s.get(url, timeout=30)  # warm: a worker's first request loads templates and scripts
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        resp = s.get(url, timeout=30)
        out.append((time.perf_counter() - t0) * 1000)
        resp.raise_for_status()
    return out


def line(label: str, ms: list[float]) -> dict:
    fig = {"median_ms": statistics.median(ms), "p95_ms": percentile(ms, 95)}
    print(f"{label:<44} median {fig['median_ms']:7.2f} ms   p95 {fig['p95_ms']:7.2f} ms")
    return fig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="10,100,1000")
    ap.add_argument("--scrapes", type=int, default=40)
    args = ap.parse_args()
    sizes = sorted(int(x) for x in args.targets.split(","))
    results: dict = {"scrape": {}, "pages": {}}
    with Stack(workers=2) as stack:
        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        done = 0
        for size in sizes:
            seed(stack.url, r, done, size)
            done = size
            body = requests.get(stack.url + "/metrics", timeout=30).text
            acked = f'trainmedic_actions_acked_total{{action="scale_lr",status="applied"}} {float(size - size // 4)}'
            assert acked in body
            results["scrape"][size] = line(f"GET /metrics, {size} targets",
                                           timed_gets(stack.url + "/metrics", args.scrapes))
        results["pages"]["index_50"] = line("GET / (50 newest records)", timed_gets(stack.url + "/", args.scrapes))
        results["pages"]["index_filtered"] = line("GET /?status=dispatched (filter scans)",
                                                  timed_gets(stack.url + "/?status=dispatched", args.scrapes))
        results["pages"]["target"] = line("GET /targets/job/bench-0 (timeline + LR)",
                                          timed_gets(stack.url + "/targets/job/bench-0", args.scrapes))
        results["pages"]["history_api_50"] = line("GET /history (JSON, 50 records), for scale",
                                                  timed_gets(stack.url + "/history", args.scrapes))
        r.close()
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "scrape_and_page.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
