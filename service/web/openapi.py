"""GET /openapi.json: an OpenAPI 3.0 description of the HTTP API, kept beside the code it describes."""
from __future__ import annotations

import copy
import functools
from typing import Any

from flask import Blueprint, current_app, jsonify

from ...client.wire import keys
from ...client.wire.actions import CATALOGUE
from ...client.wire.durations import POSITIVE as POSITIVE_DURATION
from ...client.wire.status import Outcome, RecordStatus, values

from ..store.views import SCHEMA as RECORD_SCHEMAS

from .. import history, jobs
from ..rules import alerts

bp = Blueprint("openapi", __name__)

# JSON Schema patterns end in $ (what Python writes \Z for: no final newline).
TARGET_NAME = keys.TARGET_NAME_RE.pattern.replace("\\Z", "$")
RECORD_ID = keys.RECORD_ID_RE.pattern.replace("\\Z", "$")


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict:
    return _json(_ref("Error"), description)


def _strings(description: str) -> dict:
    return {"type": "object", "additionalProperties": {"type": "string"}, "description": description}


SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {"error": {"type": "string", "description": "One human sentence."}},
    },
    "Target": {
        "type": "object", "required": ["kind", "name"],
        "properties": {
            "kind": {"type": "string", "enum": ["job", "node"]},
            "name": {"type": "string", "nullable": True,
                     "description": "null when the alert's label could not be used as a target (bad_label)"},
        },
    },
    # The record's own shape, from the module that writes and reads it.
    **RECORD_SCHEMAS,
    # A job's time (Goodput), likewise from its views.
    **jobs.SCHEMA,
    "HistoryPage": {
        "type": "object", "required": ["items", "next"],
        "properties": {
            "items": {"type": "array", "items": _ref("Record")},
            "next": {"type": "string", "nullable": True, "pattern": RECORD_ID,
                     "description": "Pass as `before` for the next (older) page; null on the last page."},
        },
    },
    "AlertmanagerAlert": {
        "type": "object", "required": ["status", "labels", "startsAt"],
        "properties": {
            "status": {"type": "string", "enum": ["firing", "resolved"]},
            "labels": {**_strings("Must include a non-empty alertname."), "required": ["alertname"],
                       "properties": {"alertname": {"type": "string", "minLength": 1}}},
            "annotations": {**_strings("Free text; shown in the history."), "nullable": True},
            "startsAt": {"type": "string", "format": "date-time", "example": "2026-11-22T01:25:24.115697517Z"},
            "endsAt": {"type": "string", "nullable": True},
            "generatorURL": {"type": "string", "nullable": True},
            "fingerprint": {"type": "string", "nullable": True, "pattern": alerts.FINGERPRINT_PATTERN,
                            "description": "Derived from the labels when absent or empty."},
        },
    },
    "AlertmanagerPayload": {
        "type": "object", "required": ["alerts"],
        "description": "Alertmanager's webhook body, payload version 4; other fields are ignored.",
        "properties": {
            "version": {"type": "string", "enum": ["4"]},
            "receiver": {"type": "string", "nullable": True},
            "status": {"type": "string", "nullable": True},
            "groupKey": {"type": "string", "nullable": True},
            "externalURL": {"type": "string", "nullable": True},
            # Each alert is matched on its own labels, so the group's summaries are read by no one.
            "groupLabels": {"description": "Ignored."},
            "commonLabels": {"description": "Ignored."},
            "commonAnnotations": {"description": "Ignored."},
            "truncatedAlerts": {"description": "Ignored."},
            "alerts": {"type": "array", "maxItems": alerts.MAX_ALERTS, "items": _ref("AlertmanagerAlert")},
        },
    },
    "Outcome": {
        "type": "object", "required": ["id", "playbook", "fingerprint", "status", "reason"],
        "properties": {
            "id": {"type": "string", "pattern": RECORD_ID},
            "playbook": {"type": "string"},
            "fingerprint": {"type": "string"},
            "status": {"type": "string", "enum": values(RecordStatus)},
            "reason": {"type": "string", "nullable": True},
        },
    },
    "WebhookResult": {
        "type": "object", "required": ["status", "alerts", "remediations", "duplicates"],
        "properties": {
            "status": {"type": "string", "enum": ["ok"]},
            "alerts": {"type": "integer", "minimum": 0},
            "remediations": {"type": "array", "items": _ref("Outcome"),
                             "description": "The records this notification created (resends create none)."},
            "duplicates": {"type": "integer", "minimum": 0},
        },
    },
    "ManualTrigger": {
        "type": "object", "required": ["playbook"], "additionalProperties": False,
        "properties": {
            "playbook": {"type": "string", "example": "loss-spike"},
            "labels": {**_strings("Labels of the synthetic alert; alertname defaults to manual:PLAYBOOK."),
                       "properties": {"alertname": {"type": "string", "minLength": 1}}, "nullable": True},
            "annotations": {**_strings("Annotations of the synthetic alert."), "nullable": True},
        },
    },
    "Command": {
        "description": "One ad-hoc command: an action of the catalogue, with its own parameters, for a target of "
                       "the kind it runs on.",
        "oneOf": [{
            "type": "object", "required": ["target", "action", *(["params"] if spec.needs_params else [])],
            "additionalProperties": False, "title": spec.name,
            "properties": {
                "target": {"type": "string", "pattern": f"^{spec.kind}:" + TARGET_NAME.lstrip("^"),
                           "example": f"{spec.kind}:{'llama-ft-01' if spec.kind == 'job' else 'gpu-node-01'}"},
                "action": {"type": "string", "enum": [spec.name]},
                "params": {**spec.params_schema(), **({} if spec.needs_params else {"nullable": True})},
                "expire_after": {"type": "string", "example": "10m", "pattern": POSITIVE_DURATION,
                                 "description": "Not applied by then: it ends expired or lost (default 1h)."},
            },
        } for spec in CATALOGUE.values()],
    },
    "Decision": {
        "type": "object", "additionalProperties": False,
        "properties": {"comment": {"type": "string", "maxLength": 1000, "description": "Kept in the record."}},
    },
    "LiveTarget": {
        "type": "object", "required": ["kind", "name", "last_seen", "age_seconds"], "additionalProperties": True,
        "description": "A training client or node agent; other fields are what it reports (host, pid, step, lr).",
        "properties": {
            "kind": {"type": "string", "enum": ["job", "node"]},
            "name": {"type": "string"},
            "last_seen": {"type": "string", "format": "date-time"},
            "age_seconds": {"type": "number"},
            "incidents_7d": {"type": "integer", "minimum": 0,
                             "description": "A node's firing remediations dispatched to it in the last 7 days "
                                            "(Lemon nodes); nodes only."},
        },
    },
    "Targets": {
        "type": "object", "required": ["targets"],
        "properties": {"targets": {"type": "array", "items": _ref("LiveTarget")}},
    },
    "Playbooks": {
        "type": "object", "required": ["items"],
        "properties": {"items": {"type": "array", "items": _ref("PlaybookSummary")}},
    },
    "PlaybookSummary": {
        "type": "object", "required": ["name", "settings", "outcomes", "time_to_resolve_s"],
        "properties": {
            "name": {"type": "string"},
            "settings": {"type": "object", "additionalProperties": True,
                         "description": "The playbook as loaded: durations in seconds, a notify URL as its host only."},
            "outcomes": {"type": "object", "required": values(Outcome),
                         "properties": {o: {"type": "integer", "minimum": 0} for o in values(Outcome)},
                         "description": "Records per outcome over the last 30 days."},
            "time_to_resolve_s": {
                "type": "object", "required": ["median", "p90"],
                "properties": {"median": {"type": "number", "nullable": True},
                               "p90": {"type": "number", "nullable": True}},
                "description": "From the last ack to the alert's end, over the effective records of 30 days."},
            "breaker": {
                "type": "object", "required": ["limit", "active", "open"],
                "properties": {"limit": {"type": "integer", "minimum": 0}, "active": {"type": "integer", "minimum": 0},
                               "open": {"type": "boolean"}},
                "description": "A playbook with max_active: its bound now, the targets with an open remediation, "
                               "and whether it holds new remediations back."},
        },
    },
    "Health": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string", "enum": ["ok"]}}},
    "Ready": {
        "type": "object", "required": ["status", "redis", "playbooks"],
        "properties": {"status": {"type": "string", "enum": ["ready"]}, "redis": {"type": "string"},
                       "playbooks": {"type": "integer", "minimum": 0}},
    },
}

WEBHOOK: list[dict[str, list[str]]] = [{"webhook": []}]
OPERATOR: list[dict[str, list[str]]] = [{"operator": []}]
REDIS_DOWN = _error("Redis is unavailable, or the worker already holds as many requests as it may (any endpoint); "
                    "retry later (Alertmanager retries 5xx).")
AUTH_ERRORS = {
    "401": _error("Authorization: Bearer token missing or wrong (a token is configured)."),
    "403": _error("No token is configured and the request is not from loopback."),
}
OPERATOR_ERRORS = {
    "401": _error("Authorization: Bearer token missing or wrong."),
    "403": _error("The webhook token, a foreign Origin, or no operator token configured."),
}
BODY_ERRORS = {
    "400": _error("Malformed JSON or payload."),
    "413": _error("The body is over 1 MiB."),
    "415": _error("The body is not sent as application/json."),
}
HTML = {"text/html": {"schema": {"type": "string"}}}
# Reads are open unless TRAINMEDIC_READ_TOKEN is set; then every GET but these (and static files) needs a token.
OPEN_READS = ("/healthz", "/readyz", "/metrics")
READ: list[dict[str, list[str]]] = [{}, {"read": []}, {"operator": []}]
READ_ERRORS = {
    "401": _error("TRAINMEDIC_READ_TOKEN is set, and the bearer token is missing or is not the read token or an "
                  "operator token."),
    "403": _error("The webhook token, which does not read."),
}
TO_LOGIN = {"description": "TRAINMEDIC_READ_TOKEN is set and the request has no token and no login: to the login "
                           "form (/login).", "headers": {"Location": {"schema": {"type": "string"}}}}
# gunicorn refuses a request line over 4094 bytes before the app sees it (long query or path values).
TOO_LONG = {"414": {"description": "The URL is longer than the server accepts (gunicorn: 4094 bytes).",
                    "content": HTML}}


def _query(name: str, schema: dict, description: str) -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def _path(name: str, schema: dict) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": schema}


FILTERS = [
    _query("alertname", {"type": "string", "maxLength": 256}, "Only records of this alert."),
    _query("playbook", {"type": "string", "maxLength": 256}, "Only records of this playbook."),
    _query("target", {"type": "string", "maxLength": 256}, "A target name, or kind:name."),
    _query("status", {"type": "string", "enum": ["", *values(RecordStatus)]},
           "Only records in this status (empty: any)."),
    _query("outcome", {"type": "string", "enum": ["", *values(Outcome)]},
           "Only records with this outcome (empty: any)."),
    _query("before", {"type": "string", "pattern": "^$|" + RECORD_ID}, "The `next` cursor of the previous page."),
]


# A new record's id leads to reading, approving and rejecting it (schemathesis follows these when stateful).
RECORD_LINKS = {
    "GetRemediation": {"operationId": "getRemediation", "parameters": {"id": "$response.body#/id"}},
    "ApproveRemediation": {"operationId": "approve", "parameters": {"id": "$response.body#/id"}},
    "RejectRemediation": {"operationId": "reject", "parameters": {"id": "$response.body#/id"}},
}


# A listed job leads to the job itself.
JOB_LINKS = {"GetJob": {"operationId": "getJob", "parameters": {"name": "$response.body#/items/0/job_name"}}}


def _paths() -> dict:
    rid = _path("id", {"type": "string"})
    created = _json(_ref("Record"), "The new record.")
    created["links"] = RECORD_LINKS
    return {
        "/webhook": {"post": {
            "summary": "Alertmanager webhook (payload version 4)",
            "operationId": "webhook", "security": WEBHOOK, "tags": ["webhook"],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("AlertmanagerPayload")}}},
            "responses": {"200": _json(_ref("WebhookResult"), "Processed: decided, recorded and dispatched."),
                          **BODY_ERRORS, **AUTH_ERRORS, "503": REDIS_DOWN},
        }},
        "/history": {"get": {
            "summary": "Remediation records, newest first", "operationId": "listHistory", "tags": ["history"],
            "parameters": [_query("limit", {"type": "integer", "minimum": 1, "maximum": history.MAX_LIMIT,
                                            "default": 50}, "Records per page."), *FILTERS],
            "responses": {"200": _json(_ref("HistoryPage"), "A page of records."),
                          "400": _error("A bad query."), **TOO_LONG, "503": REDIS_DOWN},
        }},
        "/remediations": {"post": {
            "summary": "Trigger a playbook by hand", "operationId": "trigger", "security": OPERATOR,
            "tags": ["remediations"],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ManualTrigger")}}},
            "responses": {"201": created, **BODY_ERRORS, **OPERATOR_ERRORS,
                          "404": _error("No playbook of that name."), "503": REDIS_DOWN},
        }},
        "/commands": {"post": {
            "summary": "Send one ad-hoc command (what `trainmedic send` does)", "operationId": "command",
            "security": OPERATOR, "tags": ["remediations"],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("Command")}}},
            "responses": {"201": created, **BODY_ERRORS, **OPERATOR_ERRORS, "503": REDIS_DOWN},
        }},
        "/remediations/{id}": {"get": {
            "summary": "One record, by its full id or a unique prefix of at least 8 characters",
            "operationId": "getRemediation", "tags": ["remediations"], "parameters": [rid],
            "responses": {"200": _json(_ref("Record"), "The record."),
                          "400": _error("The prefix starts more than one record's id."),
                          "404": _error("No such record."),
                          **TOO_LONG, "503": REDIS_DOWN},
        }},
        "/remediations/{id}/approve": {"post": {
            "summary": "Release a record held for approval", "operationId": "approve", "security": OPERATOR,
            "tags": ["remediations"], "parameters": [rid],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("Decision")}}},
            "responses": {"200": _json(_ref("Record"), "Released: its command is dispatched."), **BODY_ERRORS,
                          **OPERATOR_ERRORS,
                          "404": _error("No such record."),
                          "409": _error("The record is not pending approval, or its approval time has passed."),
                          **TOO_LONG, "503": REDIS_DOWN},
        }},
        "/remediations/{id}/reject": {"post": {
            "summary": "Refuse a record held for approval", "operationId": "reject", "security": OPERATOR,
            "tags": ["remediations"], "parameters": [rid],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("Decision")}}},
            "responses": {"200": _json(_ref("Record"), "Refused: it is skipped / rejected."), **BODY_ERRORS,
                          **OPERATOR_ERRORS,
                          "404": _error("No such record."),
                          "409": _error("The record is not pending approval, or its approval time has passed."),
                          **TOO_LONG, "503": REDIS_DOWN},
        }},
        "/playbooks": {"get": {
            "summary": "The loaded playbooks with their outcomes over 30 days", "operationId": "listPlaybooks",
            "tags": ["playbooks"],
            "responses": {"200": _json(_ref("Playbooks"), "Each loaded playbook."), "503": REDIS_DOWN},
        }},
        "/records/{id}": {"get": {
            "summary": "One record's page: its outcome, ladder, the metric around it, approve and reject",
            "operationId": "recordPage", "tags": ["pages"], "parameters": [rid],
            "responses": {"200": {"description": "HTML.", "content": HTML},
                          "404": {"description": "No such record.", "content": HTML}, **TOO_LONG,
                          "503": REDIS_DOWN},
        }},
        "/targets": {"get": {
            "summary": "Live training clients and node agents", "operationId": "listTargets", "tags": ["targets"],
            "responses": {"200": _json(_ref("Targets"), "Targets with a heartbeat in the last minute."),
                          "503": REDIS_DOWN},
        }},
        "/jobs": {"get": {
            "summary": "Every job seen in the last 30 days and where its time went, live ones first, then by name",
            "operationId": "listJobs", "tags": ["jobs"],
            "parameters": [
                _query("live", {"type": "string", "enum": ["", "true", "false"]},
                       "true: only live jobs; false: only the others (empty: all)."),
                _query("limit", {"type": "integer", "minimum": 1, "maximum": jobs.MAX_LIMIT,
                                 "default": jobs.DEFAULT_LIMIT}, "Jobs per page."),
                _query("before", {"type": "string", "pattern": "^$|" + jobs.CURSOR_RE.pattern.replace("\\Z", "$")},
                       "The `next` cursor of the previous page.")],
            "responses": {"200": {**_json(_ref("JobsPage"), "A page of jobs."), "links": JOB_LINKS},
                          "400": _error("A bad query."),
                          **TOO_LONG, "503": REDIS_DOWN},
        }},
        "/jobs/{name}": {"get": {
            "summary": "One job: where its time went, and its incidents", "operationId": "getJob", "tags": ["jobs"],
            "parameters": [_path("name", {"type": "string"})],
            "responses": {"200": _json(_ref("Job"), "The job, with its incidents."),
                          "404": _error("No job of that name was seen in the last 30 days."), **TOO_LONG,
                          "503": REDIS_DOWN},
        }},
        "/healthz": {"get": {
            "summary": "The process is up", "operationId": "healthz", "tags": ["probes"],
            "responses": {"200": _json(_ref("Health"), "Up.")},
        }},
        "/readyz": {"get": {
            "summary": "Redis reachable and playbooks loaded", "operationId": "readyz", "tags": ["probes"],
            "responses": {"200": _json(_ref("Ready"), "Ready."), "503": _error("Redis is unreachable.")},
        }},
        "/metrics": {"get": {
            "summary": "Prometheus metrics, exact across gunicorn workers", "operationId": "metrics",
            "tags": ["probes"],
            "responses": {"200": {"description": "Prometheus text exposition format.",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}},
        }},
        "/": {"get": {
            "summary": "The history page for people", "operationId": "historyPage", "tags": ["pages"],
            "parameters": [_query("limit", {"type": "integer", "minimum": 1, "maximum": history.MAX_LIMIT},
                                  "Records per page."), *FILTERS],
            "responses": {"200": {"description": "HTML.", "content": HTML},
                          "400": {"description": "HTML saying what is wrong with the query.", "content": HTML},
                          **TOO_LONG, "503": REDIS_DOWN},
        }},
        "/targets/{kind}/{name}": {"get": {
            "summary": "One target's page: timeline, LR before and after, its records; a job's time by kind, its "
                       "goodput and incidents", "operationId": "targetPage",
            "tags": ["pages"],
            "parameters": [_path("kind", {"type": "string", "enum": ["job", "node"]}),
                           _path("name", {"type": "string", "pattern": TARGET_NAME})],
            "responses": {"200": {"description": "HTML.", "content": HTML},
                          "404": {"description": "No such target name.",
                                  "content": {**HTML, "application/json": {"schema": _ref("Error")}}},
                          "503": REDIS_DOWN},
        }},
        "/openapi.json": {"get": {
            "summary": "This description", "operationId": "openapi", "tags": ["probes"],
            "responses": {"200": {"description": "OpenAPI 3.0 document.",
                                  "content": {"application/json": {"schema": {"type": "object"}}}}},
        }},
    }


def _with_reads(paths: dict) -> dict:
    """Every GET but the probes and the scrape: a read token when one is set (pages go to /login without one)."""
    for path, ops in paths.items():
        op = ops.get("get")
        if op is None or path in OPEN_READS:
            continue
        op["security"] = READ
        for code, answer in READ_ERRORS.items():
            op["responses"].setdefault(code, answer)
        if "pages" in op.get("tags", ()):
            op["responses"].setdefault("303", TO_LOGIN)
    return paths


@functools.lru_cache(maxsize=8)
def document(playbooks: tuple[str, ...] = ()) -> dict:
    """The OpenAPI document; a manual trigger's playbook is one of those loaded (when known)."""
    schemas = copy.deepcopy(SCHEMAS)
    if playbooks:
        schemas["ManualTrigger"]["properties"]["playbook"]["enum"] = list(playbooks)
        schemas["ManualTrigger"]["properties"]["playbook"]["example"] = playbooks[0]
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "trainmedic",
            "version": "2",
            "description": "Auto-remediation for ML training clusters: Alertmanager webhook in, playbook actions "
                           "out to training jobs and GPU nodes, every decision recorded.",
        },
        "paths": _with_reads(_paths()),
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "webhook": {"type": "http", "scheme": "bearer",
                            "description": "TRAINMEDIC_WEBHOOK_TOKEN: POST /webhook only (loopback without one)."},
                "operator": {"type": "http", "scheme": "bearer",
                             "description": "TRAINMEDIC_OPERATOR_TOKEN (recorded as `operator`) or a person's own "
                                            "token from TRAINMEDIC_OPERATOR_TOKENS_FILE (recorded as "
                                            "`operator:NAME`): people's writes (approve, reject, manual triggers, "
                                            "POST /commands); it reads too."},
                "read": {"type": "http", "scheme": "bearer",
                         "description": "TRAINMEDIC_READ_TOKEN: when it is set, every GET but /healthz, /readyz, "
                                        "/metrics and static files needs it or an operator token; unset, reads are "
                                        "open. The pages log in once with a form at /login into a signed session "
                                        "cookie (HttpOnly, SameSite=Strict, Secure behind HTTPS) that names the "
                                        "person and never holds the token."},
            },
        },
        "tags": [{"name": n} for n in ("webhook", "history", "remediations", "targets", "jobs", "probes", "pages")],
    }


@bp.get("/openapi.json")
def openapi() -> Any:
    """The OpenAPI document of this service (with its loaded playbooks)."""
    return jsonify(document(tuple(p.name for p in current_app.extensions["trainmedic"].playbooks)))
