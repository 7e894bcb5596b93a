"""History, records, manual triggers, approvals, targets and probes."""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from flask import Blueprint, current_app, jsonify, request

from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import rfc3339

from trainmedic.service.rules import alerts
from trainmedic.service.decide import dispatch
from trainmedic.service import history
from trainmedic.service.web.auth import write_endpoint
from trainmedic.service.errors import BadRequest, Conflict, NotFound, Unavailable
from trainmedic.service.rules.targets import resolve
from trainmedic.service.web.webhook import read_json

bp = Blueprint("api", __name__)
LIVE_WINDOW = 60.0


def _ext() -> Any:
    return current_app.extensions["trainmedic"]


@bp.get("/history")
def list_history() -> Any:
    q = history.Query.from_args(request.args)
    _ext().dispatcher.expire_approvals()
    items, nxt = history.page(_ext().redis, q)
    return jsonify({"items": items, "next": nxt})


@bp.get("/remediations/<rid>")
def get_remediation(rid: str) -> Any:
    rec = history.get(_ext().redis, rid)
    if rec is None:
        raise NotFound(f"no remediation with id {rid!r}")
    if rec["status"] == "pending_approval":
        # A record whose approval time has passed must read as expired, not as still pending.
        _ext().dispatcher.approve(rid, expire_only=True)
        rec = history.get(_ext().redis, rid) or rec
    return jsonify(rec)


@bp.post("/remediations")
@write_endpoint
def trigger() -> Any:
    body = read_json()
    if not isinstance(body, dict) or not isinstance(body.get("playbook"), str):
        raise BadRequest('the body must be {"playbook": NAME, "labels": {...}}')
    extra = set(body) - {"playbook", "labels", "annotations"}
    if extra:
        raise BadRequest(f"unknown field {sorted(extra)[0]!r}")
    ext = _ext()
    pb = next((p for p in ext.playbooks if p.name == body["playbook"]), None)
    if pb is None:
        raise NotFound(f"no playbook named {body['playbook']!r}")
    # null means none; any other non-object (0, "", [], false) is refused by parse_alert, not taken as none.
    labels = {} if body.get("labels") is None else body["labels"]
    labels = {"alertname": f"manual:{pb.name}", **labels} if isinstance(labels, dict) else labels
    now = rfc3339()
    alert = alerts.parse_alert({
        "status": "firing", "labels": labels, "annotations": body.get("annotations"),
        "startsAt": now, "fingerprint": hashlib.sha256(f"{now}{time.perf_counter_ns()}".encode()).hexdigest()[:16],
    }, "body")
    decision = dispatch.Decision(pb, "manual", alert, resolve(pb.target, alert.labels))
    outcome = ext.dispatcher.execute([decision])[0]
    ext.metrics.remediations([outcome])
    return jsonify(history.get(ext.redis, outcome.record_id)), 201


@bp.post("/remediations/<rid>/approve")
@write_endpoint
def approve(rid: str) -> Any:
    if not keys.RECORD_ID_RE.match(rid):
        raise NotFound(f"no remediation with id {rid!r}")
    answer = _ext().dispatcher.approve(rid)
    if answer[0] == "missing":
        raise NotFound(f"no remediation with id {rid!r}")
    if answer[0] == "not_pending":
        raise Conflict(f"remediation {rid} is {answer[1]}, not pending approval")
    if answer[0] == "expired":
        raise Conflict(f"the approval time of remediation {rid} has passed; it is now expired")
    return jsonify(history.get(_ext().redis, rid))


def live_targets(r: Any) -> list[dict]:
    """Training clients and node agents with a recent heartbeat, sorted by kind and name."""
    now = time.time()
    r.zremrangebyscore(keys.TARGETS, "-inf", now - 86400)
    labels = r.zrangebyscore(keys.TARGETS, now - LIVE_WINDOW, "+inf")
    pipe = r.pipeline(transaction=False)
    for label in labels:
        kind, _, name = label.partition(":")
        pipe.get(keys.heartbeat(keys.Target(kind, name)))
    out = []
    for label, raw in zip(labels, pipe.execute()):
        if not raw:
            continue
        info = json.loads(raw)
        kind, _, name = label.partition(":")
        seen = float(info.pop("last_seen", 0))
        out.append({**info, "kind": kind, "name": name, "last_seen": rfc3339(seen),
                    "age_seconds": round(now - seen, 3)})
    out.sort(key=lambda t: (t["kind"], t["name"]))
    return out


@bp.get("/targets")
def targets() -> Any:
    return jsonify({"targets": live_targets(_ext().redis)})


@bp.get("/healthz")
def healthz() -> Any:
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> Any:
    ext = _ext()
    try:
        ext.redis.ping()
    except Exception as exc:
        raise Unavailable(f"Redis is unreachable ({type(exc).__name__})") from None
    return jsonify({"status": "ready", "redis": "ok", "playbooks": len(ext.playbooks)})
