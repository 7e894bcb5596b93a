"""Writes tests/fixtures/v3_keyspace.json: a keyspace made by version 3's own code (commit d2ee5c9), for the
upgrade tests.

It runs against version 3, not this checkout's code: install version 3 into a virtual environment of its own
and run this file with that environment's Python, from this repository's root (it reads the tests' keys and
tokens from tests/conftest.py):

    mkdir /tmp/v3 && git archive d2ee5c9 | tar -x -C /tmp/v3
    python3 -m venv /tmp/v3/.venv && /tmp/v3/.venv/bin/pip install -e '/tmp/v3[service]' torch==2.13.0 pytest
    /tmp/v3/.venv/bin/python tests/support/make_v3_keyspace.py

It starts a private redis-server, builds version 3's app with the tests' signing key and tokens, and through
its webhook, API, reconciler and a real RemediationClient in a tiny PyTorch loop makes: a record applied and
closed (its alert resolved: effective), a record applied and still followed (outcome pending, its episode
open), a dispatched record nobody claimed (its command valid for 3650 days, one run of its playbook's budget
spent), another whose command expires a second after it is made, and a record held for approval. Then it
saves every key (type, value, PTTL), when it saved them, the alerts it sent and what version 3's API showed of
each record.
"""
from __future__ import annotations

import base64
import json
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import torch  # noqa: E402

from tests.conftest import AUTH, OPERATOR, SIGNING_KEY, TOKEN, VERIFY_KEY  # noqa: E402
from trainmedic.client import RemediationClient  # noqa: E402
from trainmedic.service.app import create_app  # noqa: E402
from trainmedic.service.embedded_redis import EmbeddedRedis  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "v3_keyspace.json"
VERSION = "d2ee5c9"
PLAYBOOKS = """\
playbooks:
  - name: halve-lr
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
    cooldown: 1h
    verify: 1h
  - name: quarter-lr
    matchers: ['alertname="Quarter"']
    target: job
    actions: [{scale_lr: {factor: 0.25}}]
    verify: 1h
  - name: budgeted
    matchers: ['alertname="Budgeted"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
    max_runs: {count: 2, per: 24h}
    expire_after: 3650d
    verify: 1h
  - name: ask-first
    matchers: ['alertname="AskFirst"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
    approval: true
    approval_timeout: 6h
    expire_after: 3650d
    verify: 1h
  - name: short-lived
    matchers: ['alertname="ShortLived"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
    expire_after: 1s
"""
TRAINED = "llama-a"  # a job with a training process (its client applies its commands)
IDLE = "llama-idle"  # a job whose process is not running (its commands wait)


def utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def alert(status: str, alertname: str, job: str, fingerprint: str, starts: str, ends: str | None = None) -> dict:
    """An Alertmanager notification of one alert, as Alertmanager 0.25 sends it."""
    one = {"status": status, "labels": {"alertname": alertname, "job_name": job, "severity": "critical"},
           "annotations": {"summary": f"{alertname} on {job}"}, "startsAt": starts,
           "endsAt": ends or "0001-01-01T00:00:00Z", "generatorURL": "http://prometheus:9090/graph",
           "fingerprint": fingerprint}
    return {"version": "4", "status": status, "receiver": "trainmedic", "groupKey": f"{{}}:{{alertname={alertname}}}",
            "groupLabels": {"alertname": alertname}, "commonLabels": one["labels"], "commonAnnotations": {},
            "externalURL": "http://alertmanager:9093", "alerts": [one]}


class Loop:
    """A tiny real training loop polling version 3's RemediationClient in a thread of its own."""

    def __init__(self, url: str, job: str):
        self.param = torch.nn.Parameter(torch.ones(3))
        self.opt = torch.optim.SGD([self.param], lr=0.1)
        self.rc = RemediationClient(job=job, redis_url=url, optimizer=self.opt, heartbeat_interval=0.2,
                                    max_backoff=0.3, verify_key=VERIFY_KEY, detect=False)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        step = 0
        while not self.stop.is_set():
            (self.param ** 2).sum().backward()
            self.opt.step()
            self.opt.zero_grad()
            step += 1
            self.rc.poll(step=step)
            time.sleep(0.005)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.rc.close()


def post(http: Any, path: str, body: Any, auth: dict) -> dict:
    resp = http.post(path, data=json.dumps(body), content_type="application/json", headers=auth)
    assert resp.status_code in (200, 201), (path, resp.status_code, resp.get_json())
    return dict(resp.get_json())


def wait_for(http: Any, rid: str, until: Any, what: str) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        rec = http.get(f"/remediations/{rid}").get_json()
        if until(rec):
            return dict(rec)
        time.sleep(0.05)
    raise SystemExit(f"record {rid} did not become {what}: {rec}")


def encoded(value: bytes) -> Any:
    """A Redis value as JSON: its text, or its bytes in base64 when it is not UTF-8 (a bitmap)."""
    try:
        return value.decode()
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(value).decode()}


def dump(r: redis.Redis) -> dict[str, dict[str, Any]]:
    """Every key: its type, its value and its PTTL (-1: none)."""
    out: dict[str, dict[str, Any]] = {}
    for raw in sorted(r.scan_iter(count=1000)):
        key = raw.decode()
        kind = r.type(raw).decode()
        value: Any
        if kind == "string":
            value = encoded(r.get(raw))
        elif kind == "hash":
            value = {k.decode(): encoded(v) for k, v in sorted(r.hgetall(raw).items())}
        elif kind == "zset":
            value = [[encoded(m), s] for m, s in r.zrange(raw, 0, -1, withscores=True)]
        elif kind == "set":
            value = sorted(encoded(m) for m in r.smembers(raw))
        elif kind == "list":
            value = [encoded(v) for v in r.lrange(raw, 0, -1)]
        elif kind == "stream":
            value = [[eid.decode(), {k.decode(): encoded(v) for k, v in fields.items()}]
                     for eid, fields in r.xrange(raw)]
        else:
            raise SystemExit(f"{key}: a {kind} this file cannot save")
        out[key] = {"type": kind, "pttl": r.pttl(raw), "value": value}
    return out


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="v3-keyspace-"))
    server = EmbeddedRedis(tmp / "redis", appendonly=False).start()
    try:
        make(server.url, tmp)
    finally:
        server.stop()


def make(url: str, tmp: Path) -> None:
    (tmp / "playbooks.yaml").write_text(PLAYBOOKS)
    app = create_app({"TESTING": True, "redis_url": url, "webhook_token": TOKEN, "operator_token": OPERATOR,
                      "signing_key": SIGNING_KEY, "playbooks": str(tmp / "playbooks.yaml")})
    ext = app.extensions["trainmedic"]
    http = app.test_client()
    starts = utc(time.time() - 120)
    alerts = {
        "applied": alert("firing", "TrainingLossSpike", TRAINED, "a1a1a1a1a1a1a1a1", starts),
        "followed": alert("firing", "Quarter", TRAINED, "a2a2a2a2a2a2a2a2", starts),
        "dispatched": alert("firing", "Budgeted", IDLE, "b1b1b1b1b1b1b1b1", starts),
        "held": alert("firing", "AskFirst", IDLE, "c1c1c1c1c1c1c1c1", starts),
        "short": alert("firing", "ShortLived", IDLE, "d1d1d1d1d1d1d1d1", starts),
    }
    made: dict[str, str] = {}
    loop = Loop(url, TRAINED)
    try:
        for name in ("applied", "followed"):
            [rem] = post(http, "/webhook", alerts[name], AUTH)["remediations"]
            made[name] = rem["id"]
            wait_for(http, rem["id"], lambda rec: rec["status"] == "applied", "applied")
    finally:
        loop.close()
    # The first alert resolves: its record is effective, and the reconciler stops following it.
    alerts["applied_resolved"] = alert("resolved", "TrainingLossSpike", TRAINED, "a1a1a1a1a1a1a1a1", starts,
                                       utc(time.time()))
    post(http, "/webhook", alerts["applied_resolved"], AUTH)
    for name in ("dispatched", "held", "short"):
        [rem] = post(http, "/webhook", alerts[name], AUTH)["remediations"]
        made[name] = rem["id"]
    ext.reconciler.tick()
    wait_for(http, made["applied"], lambda rec: (rec["outcome"] or {}).get("status") == "effective", "effective")
    r = redis.Redis.from_url(url)
    assert r.hget(f"trainmedic:{{job:{TRAINED}}}:rec:{made['applied']}", "follow") is None, "still followed"
    expected = {"applied": "applied", "followed": "applied", "dispatched": "dispatched", "held": "pending_approval",
                "short": "dispatched"}
    views = {rid: http.get(f"/remediations/{rid}").get_json() for rid in made.values()}
    for name, rid in made.items():
        assert views[rid]["status"] == expected[name], (name, views[rid])
    history = http.get("/history?limit=100").get_json()["items"]
    saved_at_ms = int(time.time() * 1000)
    keyspace = dump(r)
    OUT.write_text(json.dumps({
        "version": VERSION, "saved_at_ms": saved_at_ms, "playbooks": PLAYBOOKS, "alerts": alerts, "records": made,
        "api": {"history": history, "remediations": views}, "keys": keyspace}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(keyspace)} keys and {len(made)} records to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
