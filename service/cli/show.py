"""`trainmedic show ID`: one remediation record for people (or the API's JSON), by its id or a unique prefix."""
from __future__ import annotations

import argparse
import json
from typing import Any
from urllib.parse import quote

from ..settings import ServiceSettings
from .common import api, call, need, read_token
from .history import target


def add(sub: Any) -> None:
    s = sub.add_parser("show", help="show one remediation record")
    s.add_argument("id", metavar="ID", help="the record's id, or at least its first 8 characters")
    s.add_argument("--url", help="the service (default: TRAINMEDIC_URL, else http://127.0.0.1:9095)")
    s.add_argument("--json", action="store_true", help="the record as the API gives it")
    s.set_defaults(run=run)


def _time(value: Any) -> str:
    """An RFC 3339 time as people read it: to the second, in UTC."""
    return f"{str(value)[:19].replace('T', ' ')} UTC" if value else "-"


def _who(by: Any, at: Any, what: str) -> str:
    return f"{what} by {by} at {_time(at)}"


def _json(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "), sort_keys=True)


def lines(rec: dict) -> list[str]:
    """A record as lines for people, its full id first."""
    alert = rec.get("alert") or {}
    out = [rec["id"]]

    def row(name: str, value: str) -> None:
        out.append(f"  {name:<11} {value}")

    row("created", _time(rec.get("created_at")))
    row("status", rec["status"] + (f" ({rec['reason']})" if rec.get("reason") else ""))
    row("playbook", rec["playbook"])
    row("target", target(rec))
    since = f", since {_time(alert.get('starts_at'))}" if alert.get("starts_at") else ""
    row("alert", f"{alert.get('alertname') or '-'} ({alert.get('status') or '-'}{since})")
    labels = alert.get("labels") or {}
    if labels:
        row("labels", ", ".join(f"{k}={v}" for k, v in sorted(labels.items())))
    people = [f"requested by {rec.get('requested_by') or '-'}"]
    if rec.get("approved_by"):
        people.append(_who(rec["approved_by"], rec.get("approved_at"), "approved"))
    if rec.get("rejected_by"):
        people.append(_who(rec["rejected_by"], rec.get("rejected_at"), "rejected"))
    if rec.get("approval_comment"):
        people.append(f"comment {rec['approval_comment']!r}")
    row("who", "; ".join(people))
    outcome = rec.get("outcome")
    if outcome:
        detail = []
        if outcome.get("resolved_at"):
            detail.append(f"resolved at {_time(outcome['resolved_at'])}")
        if outcome.get("time_to_resolve_s") is not None:
            detail.append(f"{outcome['time_to_resolve_s']:g}s from the last ack")
        row("outcome", outcome.get("status", "-") + (f" ({', '.join(detail)})" if detail else ""))
    else:
        row("outcome", "none")
    esc = rec.get("escalation") or {}
    if esc.get("stage") or esc.get("parent") or esc.get("next"):
        row("escalation", f"stage {esc.get('stage', 0)}; parent {esc.get('parent') or '-'}; "
                          f"next {esc.get('next') or '-'}")
    if rec.get("silence_id") or rec.get("silence_error"):
        row("silence", rec.get("silence_id") or f"not made: {rec['silence_error']}")
    out.append("  actions" if rec.get("actions") else "  actions     none")
    for i, a in enumerate(rec.get("actions") or [], 1):
        status = a["status"] + (f" ({a['reason']})" if a.get("reason") else "")
        acked = f" at {_time(a['acked_at'])}" if a.get("acked_at") else ""
        by = f" by {a['acked_by']}" if a.get("acked_by") else ""
        out.append(f"    {i}. {a['action']} {_json(a.get('params') or {})}: {status}{acked}{by}")
        result = a.get("result")
        if result:
            out.append(f"       result {_json(result)}")
        for again in a.get("reapplied") or []:
            out.append(f"       applied again at {_time(again.get('at'))}, step {again.get('step')}, "
                       f"by {again.get('by')}")
    return out


def run(args: argparse.Namespace, settings: ServiceSettings) -> int:
    need("show", "requests")
    http = api(settings, args.url, read_token(settings))
    # The service resolves a prefix: unknown or ambiguous, it answers 404 or 400 (one line, exit 2).
    rec = call(http.get, f"/remediations/{quote(args.id, safe='')}")
    print(json.dumps(rec, indent=2) if args.json else "\n".join(lines(rec)))
    return 0
