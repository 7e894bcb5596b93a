"""The webhook's ceiling on this machine: the most req/s any service can reach that does, per alert, the work
its guarantees require (record, sign, dispatch), beside the baseline and the goals, in one run.

Run: .venv/bin/python benchmarks/webhook_bound.py [--seconds 10] [--alerts 2000]

Measured in one run, on one machine:
- the baseline (benchmarks/baseline/) under gunicorn, 4 sync workers, and wrk with benchmarks/storm.lua (both
  streams, as in baseline_compare.py);
- the framework's floor: a Flask app under trainmedic's gunicorn settings (4 gthread workers, 4 threads) that
  only checks the token, parses the notification and answers: no Redis, no planning, no signing;
- trainmedic itself, same wrk runs;
- what each alert costs besides, in process: one Ed25519 signature of a typical command, and Redis's CPU with
  AOF `appendfsync everysec` (as the service runs it) for (a) today's DECIDE script (cost_model.py's measure)
  and (b) the barest durable write any design needs: the record's hash, its mailbox entry and a wake-up,
  pipelined per notification.

The ceiling of a stream with G alerts a request: the machine's CPU divided by (the floor's CPU per request +
G x (Redis per alert + one signature)). The floor's CPU per request is the cores divided by its req/s (wrk
and gunicorn included: it saturates the cores). The service's own Python (planning, records, JSON, logging,
metrics) counts as zero, so the real ceiling is lower.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# The rest is imported where it is used: gunicorn imports this module for floor_app(), which needs only Flask.


def floor_app() -> Any:
    """The framework's floor: token, parse, answer (gunicorn imports this)."""
    from flask import Flask, abort, jsonify, request

    from common import TOKEN

    app = Flask("floor")

    @app.post("/webhook")
    def webhook() -> Any:
        if request.headers.get("Authorization") != "Bearer " + TOKEN:
            abort(401)
        doc = request.get_json()
        return jsonify({"status": "ok", "alerts": len(doc["alerts"])})

    return app


class Floor:
    """floor_app() under gunicorn with trainmedic's worker settings."""

    def __init__(self, workers: int = 4, threads: int = 4):
        from trainmedic.service.embedded_redis import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers, self.threads = workers, threads

    def __enter__(self) -> Floor:
        import requests

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-w", str(self.workers), "-k", "gthread", "--threads",
             str(self.threads), "--keep-alive", "5", "-b", f"127.0.0.1:{self.port}", "--chdir", str(HERE),
             "webhook_bound:floor_app()"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                requests.get(self.url + "/", timeout=1)
                return self
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError("the floor app did not start")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(15)


def bare_redis_us(group: int, alerts: int, signature: str, command: bytes) -> float:
    """Redis CPU per alert (AOF fsync everysec) for the barest durable write: HSET record, XADD mailbox, PUBLISH."""
    import redis

    from cost_model import body
    from trainmedic.service.embedded_redis import EmbeddedRedis

    srv = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="trainmedic-bound-")) / "redis").start()
    try:
        r = redis.Redis.from_url(srv.url)
        notes = [json.loads(body("bare", i * group, group))["alerts"] for i in range(alerts // group)]

        def write(batch: list[dict[str, Any]]) -> None:
            pipe = r.pipeline(transaction=False)
            for a in batch:
                job = a["labels"]["job_name"]
                pipe.hset(f"bare:record:{a['fingerprint']}", mapping={
                    "alert": json.dumps(a), "playbook": "loss-spike", "status": "dispatched",
                    "created_ms": int(time.time() * 1000)})
                pipe.xadd(f"bare:mailbox:{job}", {"cmd": command, "sig": signature})
                pipe.publish(f"bare:wake:{job}", "1")
            pipe.execute()

        for batch in notes[:5]:
            write(batch)  # warm-up
        cpu = r.info("cpu")
        before = cpu["used_cpu_user"] + cpu["used_cpu_sys"]
        for batch in notes:
            write(batch)
        cpu = r.info("cpu")
        return (cpu["used_cpu_user"] + cpu["used_cpu_sys"] - before) / (len(notes) * group) * 1e6
    finally:
        srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=10, help="seconds per wrk run")
    ap.add_argument("--alerts", type=int, default=2000, help="alerts per in-process measurement")
    args = ap.parse_args()

    from baseline_compare import Baseline, wrk
    from common import SIGNING_KEY, Stack
    from cost_model import in_process, measure
    from signing_cost import timed, typical_command
    from trainmedic.client.wire.signing import Signer

    cores = os.cpu_count() or 1
    command = typical_command()
    signer = Signer.from_secret(SIGNING_KEY)
    sign_us = timed(lambda: signer.sign(command), 5000)[0]
    signature = signer.sign(command)
    groups = {10: 4.0, 1: 1.5}  # alerts a request: the goal's ratio to the baseline
    decide_us, bare_us = {}, {}
    with in_process() as (http, r):
        for g in groups:
            decide_us[g] = measure(http, r, g, args.alerts, f"bound{g}")["redis_us"]
    for g in groups:
        bare_us[g] = bare_redis_us(g, args.alerts, signature, command)

    rps: dict[str, dict[int, dict]] = {"baseline": {}, "floor": {}, "trainmedic": {}}
    with Stack(workers=4, env={"TRAINMEDIC_LOG_LEVEL": "info"}) as stack, Baseline(4) as base, Floor() as floor:
        urls = {"baseline": base.url, "floor": floor.url, "trainmedic": stack.url}
        for g in groups:
            for who, url in urls.items():
                wrk(url, g, 2)  # warm-up
                rps[who][g] = wrk(url, g, args.seconds)

    print(f"the webhook's ceiling: {cores} cores shared by wrk (2 threads, 8 connections), gunicorn (4 workers) "
          f"and Redis (AOF appendfsync everysec); {args.seconds}s per wrk run, one run each; every alert a new "
          "fingerprint and a new job")
    print(f"one Ed25519 signature: {sign_us:.1f} us (median)")
    print(f"{'stream':<16} {'baseline':>9} {'goal':>7} {'floor':>7} {'floor us/req':>12} {'Redis us/alert':>14} "
          f"{'ceiling':>8} {'bare':>6} {'bare ceiling':>12} {'trainmedic':>10} {'of floor':>8}")
    rows = []
    for g, ratio in groups.items():
        b, f, t = rps["baseline"][g]["rps"], rps["floor"][g]["rps"], rps["trainmedic"][g]["rps"]
        floor_us = cores * 1e6 / f
        ceiling = cores * 1e6 / (floor_us + g * (decide_us[g] + sign_us))
        bare = cores * 1e6 / (floor_us + g * (bare_us[g] + sign_us))
        name = f"{g}-alert groups"
        print(f"{name:<16} {b:9.0f} {ratio * b:7.0f} {f:7.0f} {floor_us:12.0f} "
              f"{decide_us[g]:7.0f} /{bare_us[g]:5.0f} {ceiling:8.0f} {bare:12.0f} {t:10.0f} {t / f:8.0%}")
        rows.append({"group": g, "baseline_rps": b, "goal_rps": ratio * b, "floor_rps": f, "floor_us": floor_us,
                     "decide_redis_us": decide_us[g], "bare_redis_us": bare_us[g], "sign_us": sign_us,
                     "ceiling_rps": ceiling, "bare_ceiling_rps": bare, "trainmedic_rps": t,
                     "trainmedic_p99_ms": rps["trainmedic"][g]["p99_ms"]})
    print("req/s; goal: 4x the baseline (10-alert groups), 1.5x (1-alert groups), and 25 % / 45 % of the floor; "
          "floor: token, parse, answer; "
          "Redis us/alert: today's DECIDE / the bare write; ceiling: req/s at the floor's CPU plus, per alert, "
          "DECIDE's Redis CPU and a signature, the service's own Python taken as free; bare ceiling: the same "
          "with the bare write")
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "webhook_bound.json").write_text(json.dumps({"cores": cores, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
