"""`trainmedic approve ID` / `trainmedic reject ID`: decide a held remediation through the service's API, after
showing the exact actions and parameters being decided."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import quote

from ..settings import ServiceSettings
from .common import UsageError, api, call, need, operator_token


def add(sub: Any) -> None:
    for verb, words in (("approve", "release a remediation held for approval"),
                        ("reject", "refuse a remediation held for approval")):
        p = sub.add_parser(verb, help=words)
        p.add_argument("id", metavar="ID", help="the remediation's id, or a prefix of it (8 characters or more) "
                                                "that names one record")
        p.add_argument("--url", help="the service (default: TRAINMEDIC_URL, else http://127.0.0.1:9095)")
        p.add_argument("--comment", default=None, help="why (kept in the record)")
        p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        p.set_defaults(run=run, verb=verb)


def describe(rec: dict) -> list[str]:
    """What a person is asked to decide: the record, then each action with its exact parameters."""
    t = rec["target"]
    lines = [f"remediation {rec['id']}", f"  playbook {rec['playbook']} on {t['kind']}:{t.get('name') or 'none'}, "
             f"alert {rec['alert'].get('alertname') or '-'}, status {rec['status']}"]
    for i, a in enumerate(rec["actions"], 1):
        flags = " (optional)" if a.get("optional") else ""
        lines.append(f"  {i}. {a['action']} {json.dumps(a.get('params') or {}, sort_keys=True)}{flags}")
    return lines


def confirmed(verb: str, n: int) -> bool:
    """Ask on the terminal; anything but y or yes is a no."""
    sys.stdout.write(f"{verb} {'this action' if n == 1 else f'these {n} actions'}? [y/N] ")
    sys.stdout.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def outcome(rec: dict) -> list[str]:
    """The record after the decision: its status and reason, and each action's."""
    lines = [f"remediation {rec['id']}: {rec['status']}{' (' + rec['reason'] + ')' if rec.get('reason') else ''}"]
    if rec.get("detail"):
        lines.append(f"  {rec['detail']}")
    for i, a in enumerate(rec["actions"], 1):
        why = (a.get("result") or {}).get("message") if isinstance(a.get("result"), dict) else None
        reason = f" ({a['reason']})" if a.get("reason") else ""
        lines.append(f"  {i}. {a['action']}: {a['status']}{reason}{': ' + why if why else ''}")
    return lines


def run(args: argparse.Namespace, settings: ServiceSettings) -> int:
    need(args.verb, "requests")
    if not args.yes and not sys.stdin.isatty():
        raise UsageError(f"{args.verb} asks for confirmation on a terminal: pass --yes to {args.verb} without it")
    http = api(settings, args.url, operator_token(settings), writes=True)
    rec = call(http.get, f"/remediations/{quote(args.id, safe='')}")
    print("\n".join(describe(rec)), flush=True)
    if not args.yes and not confirmed(args.verb, len(rec["actions"])):
        print(f"not {'approved' if args.verb == 'approve' else 'rejected'}: nothing changed")
        return 1
    body = {"comment": args.comment} if args.comment is not None else {}
    done = call(http.post, f"/remediations/{quote(rec['id'], safe='')}/{args.verb}", body)
    print("\n".join(outcome(done)))
    return 0
