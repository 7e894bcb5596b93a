"""What signing costs: sign and verify one command (Ed25519 over its exact bytes), and whether it shows in the
webhook's throughput.

Run: .venv/bin/python benchmarks/signing_cost.py [--calls 20000] [--seconds 5] [--rounds 3]

1. One typical command (the shipped loss-spike's: rollback_checkpoint, then scale_lr), its exact bytes as the
   service signs them: sign (the service, once per dispatched record), verify with one key (agents and
   trainers, once per mailbox entry), verify with two keys when the second signed (during a key rotation), and
   a forged signature (every key tried). Each call timed on its own: median and p99 over --calls.
2. The CPU time of one POST /webhook with 10 alerts, in-process (Flask test client, a real Redis), signing on
   and a no-op signer, alternating batches: CPU time barely moves when other processes share the machine.
3. webhook_throughput.py's load (wrk, 8 connections, new fingerprints every request, groups of 1 and 10
   alerts, 4 gthread workers, embedded Redis with AOF fsync always) against two services side by side: signing
   as it is, and one whose Signer.sign returns a fixed placeholder (benchmarks/_nosign). Runs alternate between
   the two, --rounds times; medians. The difference is what signing costs the webhook.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from common import ROOT, SIGNING_KEY, Stack, percentile

import redis

from trainmedic.client.wire import keys
from trainmedic.service.store.decision import Step
from trainmedic.client.wire.signing import Signer, Verifier
from trainmedic.client.wire.protocol import command_message
from trainmedic.service.decide.dispatch import new_record_id
from trainmedic.service.store.decision import decided_text
from webhook_throughput import run_wrk

NOSIGN = ROOT / "benchmarks" / "_nosign"


def typical_command() -> bytes:
    """The bytes the service signs for the shipped loss-spike playbook's command to one job."""
    target = keys.Target("job", "llama-ft-01")
    steps = (Step("rollback_checkpoint", {}), Step("scale_lr", {"factor": 0.5, "min_lr": 1.0e-7}))
    starts = "2026-11-22T01:25:24.115697517Z"
    alert = {"alertname": "TrainingLossSpike", "status": "firing", "fingerprint": "071ff15f8faead0f",
             "starts_at": starts, "ends_at": "0001-01-01T00:00:00Z",
             "labels": {"alertname": "TrainingLossSpike", "job_name": "llama-ft-01", "severity": "critical"},
             "annotations": {"summary": "Training loss spike detected"},
             "generator_url": "http://prometheus:9090/graph?g0.expr=train_loss"}
    decided = decided_text("loss-spike", "firing", "webhook", alert, steps, {}, "2026-11-22T01:25:24Z", 0, "",
                           3600.0)
    return command_message(new_record_id(target), int((time.time() + 3600.0) * 1000), "", decided)


def timed(fn, calls: int) -> tuple[float, float]:
    """(median, p99) in microseconds of fn() timed call by call, after a warm-up."""
    for _ in range(min(1000, calls)):
        fn()
    out = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1000)
    return statistics.median(out), percentile(out, 99)


def micro(calls: int) -> tuple[int, list[dict]]:
    data = typical_command()
    signer = Signer.from_secret(SIGNING_KEY)
    old = Signer.from_secret("the-key-before-rotation-" + "9" * 16)
    sig = signer.sign(data)
    one = Verifier.from_texts([signer.public])
    two = Verifier.from_texts([old.public, signer.public])  # rotation: the new key is the second one tried
    forged = Signer.from_secret("someone-elses-key-" + "7" * 16).sign(data)
    assert one.verify(data, sig) and two.verify(data, sig) and not two.verify(data, forged)
    rows = []
    for what, fn in [
        ("sign (service, per dispatched record)", lambda: signer.sign(data)),
        ("verify, 1 key (agent/trainer, per entry)", lambda: one.verify(data, sig)),
        ("verify, 2 keys, 2nd signed (rotation)", lambda: two.verify(data, sig)),
        ("verify a forged signature, 2 keys", lambda: two.verify(data, forged)),
        ("for scale: build the command's bytes", typical_command),
    ]:
        med, p99 = timed(fn, calls)
        rows.append({"what": what, "median_us": med, "p99_us": p99})
    return len(data), rows


class _NoSign:
    """A signer that does no work (the placeholder the no-op service writes)."""

    @staticmethod
    def sign(data: bytes) -> str:
        return "A" * 88


def cpu_per_request(batches: int, per_batch: int = 50) -> list[dict]:
    """This process's CPU time per POST /webhook (Flask in-process, 10-alert groups), signing on and a no-op.

    CPU time, not wall time: what the other processes on a busy machine do barely moves it. Batches alternate.
    """
    import tempfile

    from trainmedic.service.app import create_app
    from trainmedic.service.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="trainmedic-bench-")) / "redis", appendonly=False).start()
    try:
        apps = {}
        for name in ("signed", "no-op sign"):
            app = create_app({"TESTING": True, "redis_url": server.url, "webhook_token": "t",
                              "signing_key": SIGNING_KEY, "playbooks": str(ROOT / "benchmarks" / "playbooks.yaml")})
            if name != "signed":
                app.extensions["trainmedic"].dispatcher.signer = _NoSign()
            apps[name] = app.test_client()
        body = json.loads((ROOT / "tests" / "fixtures" / "alertmanager-0.25" / "firing_single.json").read_text())
        alert = body["alerts"][0]
        counter = 0

        def post(client) -> None:
            nonlocal counter
            counter += 1
            body["alerts"] = [{**alert, "fingerprint": f"{counter:012x}{i:04x}",
                               "labels": {**alert["labels"], "job_name": f"bench-{(counter * 10 + i) % 64}"}}
                              for i in range(10)]
            resp = client.post("/webhook", json=body, headers={"Authorization": "Bearer t"})
            assert resp.status_code == 200, resp.get_data(as_text=True)

        samples: dict[str, list[float]] = {name: [] for name in apps}
        for client in apps.values():
            for _ in range(per_batch):  # warm-up
                post(client)
        for _ in range(batches):
            for name, client in apps.items():
                t0 = time.process_time()
                for _ in range(per_batch):
                    post(client)
                samples[name].append((time.process_time() - t0) / per_batch * 1e6)
    finally:
        server.stop()
    return [{"service": name, "cpu_us_per_request": statistics.median(v), "batches": batches}
            for name, v in samples.items()]


def ab(seconds: int, rounds: int, workers: int) -> list[dict]:
    playbooks = str(ROOT / "benchmarks" / "playbooks.yaml")
    nosign_env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(NOSIGN), os.environ.get("PYTHONPATH")]))}
    runs: dict[tuple[str, int], list[dict]] = {}
    with Stack(workers=workers, playbooks=playbooks) as signed, \
            Stack(workers=workers, playbooks=playbooks, env=nosign_env) as unsigned:
        for stack in (signed, unsigned):
            run_wrk(stack.url, 10, 2)  # warm-up
        for _ in range(rounds):
            for group in (1, 10):
                for name, stack in (("signed", signed), ("no-op sign", unsigned)):
                    runs.setdefault((name, group), []).append(run_wrk(stack.url, group, seconds))
        # The comparison is the one intended: real signatures on one side, the placeholder on the other.
        for stack, placeholder in ((signed, False), (unsigned, True)):
            r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
            box = next(r.scan_iter(match="trainmedic:*:mailbox"))
            sig = r.xrange(box, count=1)[0][1]["s"]
            assert (sig == "A" * 88) == placeholder, sig
            r.close()
    out = []
    for (name, group), rs in runs.items():
        out.append({"service": name, "group": group, "rps": statistics.median(x["rps"] for x in rs),
                    "alerts_per_s": statistics.median(x["alerts_per_s"] for x in rs),
                    "p50_ms": statistics.median(x["p50_ms"] for x in rs),
                    "p99_ms": statistics.median(x["p99_ms"] for x in rs),
                    "non2xx": sum(x["non2xx"] + x["errors"] for x in rs), "runs": [round(x["rps"]) for x in rs]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batches", type=int, default=20)
    args = ap.parse_args()
    size, rows = micro(args.calls)
    print(f"one typical command: {size} bytes (loss-spike: rollback_checkpoint, scale_lr), Ed25519, "
          f"{args.calls} calls each, {os.cpu_count()} cores")
    print(f"{'':44} {'median us':>10} {'p99 us':>8}")
    for row in rows:
        print(f"{row['what']:44} {row['median_us']:>10.1f} {row['p99_us']:>8.1f}")
    cpu = cpu_per_request(args.batches)
    on_cpu, off_cpu = (next(x["cpu_us_per_request"] for x in cpu if x["service"] == n) for n in ("signed",
                                                                                                  "no-op sign"))
    print(f"\nCPU time of one POST /webhook with 10 alerts (Flask in-process; median of {args.batches} batches of 50):"
          f" signed {on_cpu:.0f} us, no-op sign {off_cpu:.0f} us: signing is {100 * (on_cpu - off_cpu) / on_cpu:.1f} %"
          f" of the webhook's own CPU ({(on_cpu - off_cpu) / 10:.0f} us per alert)")
    table = ab(args.seconds, args.rounds, args.workers)
    print(f"\nwebhook under gunicorn ({args.workers} workers), 8 connections, unique alerts, {args.seconds}s runs, "
          f"{args.rounds} alternating rounds, medians")
    print(f"{'service':>11} {'alerts/req':>10} {'req/s':>7} {'alerts/s':>9} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'non-2xx':>8}  runs req/s")
    for row in sorted(table, key=lambda x: (x["group"], x["service"] != "signed")):
        print(f"{row['service']:>11} {row['group']:>10} {row['rps']:>7.0f} {row['alerts_per_s']:>9.0f} "
              f"{row['p50_ms']:>7.1f} {row['p99_ms']:>7.1f} {row['non2xx']:>8}  {row['runs']}")
    sign_us = rows[0]["median_us"]
    for group in (1, 10):
        on = next(x for x in table if x["service"] == "signed" and x["group"] == group)
        off = next(x for x in table if x["service"] != "signed" and x["group"] == group)
        share = on["alerts_per_s"] * sign_us / 1e6 / (os.cpu_count() or 1)
        print(f"groups of {group:>2}: req/s signed / no-op = {on['rps'] / off['rps']:.2f} (runs move by about "
              f"±20 %); by CPU: {sign_us:.0f} us per alert x {on['alerts_per_s']:.0f} alerts/s = "
              f"{100 * share:.1f} % of the machine")
    Path(ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "signing_cost.json").write_text(json.dumps(
        {"command_bytes": size, "calls": args.calls, "micro": rows, "webhook_cpu": cpu, "webhook": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
