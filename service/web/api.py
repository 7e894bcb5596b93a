"""History, records, manual triggers, ad-hoc commands, approvals, targets and probes."""
from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, jsonify, request

from ...client.wire import keys
from ...client.wire.actions import CATALOGUE, ParamError
from ...client.wire.durations import parse_duration
from ...client.wire.status import RecordStatus

from .. import history, outcomes, repairs
from ..store import record as records
from ..store.decision import Step
from ..decide import plan
from ..errors import BadRequest, Conflict, NotFound, Unavailable
from ..rules.playbooks import Playbook
from .auth import operator_endpoint
from .common import ext, live_targets, read_json

bp = Blueprint("api", __name__)
MAX_COMMENT = 1000


@bp.get("/history")
def list_history() -> Any:
    items, nxt = history.page(ext().redis, history.Query.from_args(request.args))
    return jsonify({"items": items, "next": nxt})


@bp.get("/remediations/<rid>")
def get_remediation(rid: str) -> Any:
    # People name records by the start of their id too (`trainmedic show`): the full id or a unique prefix.
    rid = history.resolve_record_id(ext().redis, rid)
    rec = records.get(ext().redis, rid)
    if rec is None:
        raise NotFound(f"no remediation with id {rid!r}")
    return jsonify(rec)


def _object(body: Any, shape: str, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be {shape}")
    extra = set(body) - allowed
    if extra:
        raise BadRequest(f"unknown field {sorted(extra)[0]!r}")
    return body


@bp.post("/remediations")
@operator_endpoint
def trigger(by: str) -> Any:
    body = _object(read_json(), '{"playbook": NAME, "labels": {...}}', {"playbook", "labels", "annotations"})
    if not isinstance(body.get("playbook"), str):
        raise BadRequest('the body must be {"playbook": NAME, "labels": {...}}')
    pb = ext().playbook(body["playbook"])
    if pb is None:
        raise NotFound(f"no playbook named {body['playbook']!r}")
    # null means none; any other non-object (0, "", [], false) is refused by parse_alert, not taken as none.
    labels = {} if body.get("labels") is None else body["labels"]
    if not isinstance(labels, dict):
        raise BadRequest("body.labels must be an object of strings")
    outcome = ext().dispatcher.decide_one(plan.manual(pb, labels, body.get("annotations"), by))
    ext().metrics.remediations([outcome])
    return jsonify(records.get(ext().redis, outcome.record_id)), 201


@bp.post("/commands")
@operator_endpoint
def command(by: str) -> Any:
    body = _object(read_json(), '{"target": "job:NAME", "action": NAME, "params": {...}}',
                   {"target", "action", "params", "expire_after"})
    raw = body.get("target")
    target = keys.parse_label(raw) if isinstance(raw, str) else None
    if target is None:
        raise BadRequest('target must be "job:NAME" or "node:NAME" (a name of letters, digits and _.:@-)')
    action = body.get("action")
    spec = CATALOGUE.get(action) if isinstance(action, str) else None
    if spec is None:
        raise BadRequest(f"unknown action {action!r} (known: {', '.join(sorted(CATALOGUE))})")
    if spec.kind != target.kind:
        raise BadRequest(f"{action} runs on a {spec.kind}, not on a {target.kind}")
    params = {} if body.get("params") is None else body["params"]
    try:
        spec.parse(params)
    except ParamError as exc:
        raise BadRequest(f"bad parameters for {action}: {exc}") from None
    try:
        expire_after = parse_duration(body.get("expire_after", "1h"))
    except ValueError as exc:
        raise BadRequest(f"expire_after: {exc}") from None
    if expire_after <= 0:
        raise BadRequest("expire_after must be longer than zero")
    pb = Playbook(name="manual", matchers=(), target=target.kind, actions=(Step(spec.name, dict(params)),),
                  expire_after=expire_after)
    # An ad-hoc command answers no alert and has no playbook of its own: its alert is named `manual`.
    labels = {"alertname": "manual", "job_name" if target.kind == "job" else "node": target.name}
    outcome = ext().dispatcher.decide_one(plan.manual(pb, labels, None, by))
    ext().metrics.remediations([outcome])
    return jsonify(records.get(ext().redis, outcome.record_id)), 201


def _decide_held(rid: str, verb: str, by: str) -> Any:
    body = _object(read_json(), '{} or {"comment": TEXT}', {"comment"})
    comment = body.get("comment") or ""
    if not isinstance(comment, str) or len(comment) > MAX_COMMENT:
        raise BadRequest(f"comment must be text of at most {MAX_COMMENT} characters")
    x = ext()
    rid = history.resolve_record_id(x.redis, rid)  # a full id, or a prefix naming one record
    rec = records.get(x.redis, rid)
    if rec is None:
        raise NotFound(f"no remediation with id {rid!r}")
    pb = x.playbook(rec["playbook"])
    due = x.dispatcher.settings.alertmanager_poll or (pb.resolve_timeout if pb else 12 * 3600.0)
    answer = x.dispatcher.decide_held(rid, verb, by, comment, bool(pb and pb.on_resolved), due)
    if answer[0] == "missing":
        raise NotFound(f"no remediation with id {rid!r}")
    if answer[0] == "not_pending":
        raise Conflict(f"remediation {rid} is {answer[1]}, not pending approval")
    if answer[0] == RecordStatus.EXPIRED:
        raise Conflict(f"the approval time of remediation {rid} has passed; it is now expired")
    return jsonify(records.get(x.redis, rid))


@bp.post("/remediations/<rid>/approve")
@operator_endpoint
def approve(rid: str, by: str) -> Any:
    return _decide_held(rid, "approve", by)


@bp.post("/remediations/<rid>/reject")
@operator_endpoint
def reject(rid: str, by: str) -> Any:
    return _decide_held(rid, "reject", by)


@bp.get("/playbooks")
def playbooks() -> Any:
    """Each loaded playbook as loaded, with its outcomes over the last 30 days."""
    x = ext()
    now = time.time()
    stats = outcomes.summaries(x.redis, [p.name for p in x.playbooks], now)
    breakers = x.dispatcher.breaker.state(x.playbooks, now)
    return jsonify({"items": [{"name": p.name, "settings": p.settings(), **stats[p.name].as_dict(),
                               **({"breaker": breakers[p.name]} if p.name in breakers else {})}
                              for p in x.playbooks]})


@bp.get("/targets")
def targets() -> Any:
    return jsonify({"targets": live_targets(ext().redis)})


@bp.get("/healthz")
def healthz() -> Any:
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> Any:
    x = ext()
    try:
        x.redis.ping()
    except Exception as exc:
        raise Unavailable(f"Redis is unreachable ({type(exc).__name__})") from None
    try:
        # Every key the targets share holds what the service wrote there, or is repaired now.
        repairs.check_shared(x.redis)
    except Exception as exc:
        raise Unavailable("a key every target shares can be neither read nor repaired "
                          f"({type(exc).__name__})") from None
    return jsonify({"status": "ready", "redis": "ok", "playbooks": len(x.playbooks)})
