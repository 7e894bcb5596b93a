"""POST /webhook: Alertmanager notifications in, decisions recorded and dispatched out."""
from __future__ import annotations

import logging
from typing import Any

from flask import Blueprint, jsonify

from ...client.logs import EACH, remediation

from .. import unmatched
from ..decide.plan import plan
from ..rules.alerts import parse_group
from .auth import webhook_endpoint
from .common import ext, read_json

bp = Blueprint("webhook", __name__)
log = logging.getLogger("trainmedic.webhook")


@bp.post("/webhook")
@webhook_endpoint
def webhook() -> Any:
    group = parse_group(read_json())
    x = ext()
    decisions = plan(group, x.playbooks)
    matched = {id(d.alert) for d in decisions}
    missed = [a.alertname for a in group.alerts if id(a) not in matched]
    if missed:
        unmatched.note(x.redis, missed)
    outcomes = x.dispatcher.execute(decisions)
    x.metrics.webhook(group, outcomes)
    if log.isEnabledFor(logging.INFO):
        # One log call for the notification, one line for each remediation (logs.EACH).
        lines = [(f"remediation {o.record_id}: playbook {o.playbook} on {d.target.label} for {d.alert.alertname} "
                  f"({d.mode}): {o.status}{f' ({o.reason})' if o.reason else ''}",
                  remediation(o.record_id, o.fingerprint, d.target, playbook=o.playbook,
                              alertname=d.alert.alertname, status=o.status, reason=o.reason))
                 for d, o in zip(decisions, outcomes) if o.new]
        if lines:
            log.info("%d remediations", len(lines), extra={EACH: lines})
    return jsonify({
        "status": "ok",
        "alerts": len(group.alerts),
        "remediations": [o.as_dict() for o in outcomes if o.new],
        "duplicates": sum(1 for o in outcomes if o.status == "duplicate"),
    })
