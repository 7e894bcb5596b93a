"""POST /webhook: Alertmanager notifications in, decisions recorded and dispatched out."""
from __future__ import annotations

import json
import logging
from typing import Any

from flask import Blueprint, current_app, jsonify, request

from trainmedic.service.rules import alerts
from trainmedic.service.decide import dispatch
from trainmedic.client import logs
from trainmedic.service.web.auth import write_endpoint
from trainmedic.service.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

bp = Blueprint("webhook", __name__)
log = logging.getLogger("trainmedic.webhook")


def read_json() -> Any:
    """The request's JSON body, or the contract's 413 / 415 / 400 with one sentence."""
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"the body is larger than {limit // 1024} KiB")
    if request.mimetype != "application/json":
        raise UnsupportedMediaType("the body must be sent as Content-Type: application/json")
    data = request.get_data(cache=False)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRequest("the body is not valid UTF-8") from None
    except RecursionError:
        raise BadRequest("the JSON body is nested too deeply") from None
    except ValueError:
        raise BadRequest("the body is not valid JSON") from None


@bp.post("/webhook")
@write_endpoint
def webhook() -> Any:
    group = alerts.parse_group(read_json())
    ext = current_app.extensions["trainmedic"]
    decisions = dispatch.plan(group, ext.playbooks)
    outcomes = ext.dispatcher.execute(decisions)
    ext.metrics.webhook(group, outcomes)
    if log.isEnabledFor(logging.INFO):
        for d, o in zip(decisions, outcomes):
            if o.new:
                log.info("remediation %s: playbook %s on %s for %s (%s): %s%s", o.record_id, o.playbook,
                         d.target.label, d.alert.alertname, d.mode, o.status, f" ({o.reason})" if o.reason else "",
                         extra=logs.remediation(o.record_id, o.fingerprint, d.target, playbook=o.playbook,
                                                alertname=d.alert.alertname, status=o.status, reason=o.reason))
    return jsonify({
        "status": "ok",
        "alerts": len(group.alerts),
        "remediations": [o.as_dict() for o in outcomes if o.new],
        "duplicates": sum(1 for o in outcomes if o.status == "duplicate"),
    })
