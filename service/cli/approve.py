"""`trainmedic approve ID` / `trainmedic reject ID`: decide a held remediation through the service's API."""
from __future__ import annotations

import argparse
from typing import Any

from trainmedic.client.settings import Settings

from .common import api, call, need, operator_token


def add(sub: Any) -> None:
    for verb, words in (("approve", "release a remediation held for approval"),
                        ("reject", "refuse a remediation held for approval")):
        p = sub.add_parser(verb, help=words)
        p.add_argument("id", metavar="ID", help="the remediation's id")
        p.add_argument("--url", help="the service (default: TRAINMEDIC_URL, else http://127.0.0.1:9095)")
        p.add_argument("--comment", default=None, help="why (kept in the record)")
        p.set_defaults(run=run, verb=verb)


def run(args: argparse.Namespace, settings: Settings) -> int:
    need(args.verb, "requests")
    http = api(settings, args.url, operator_token(settings))
    body = {"comment": args.comment} if args.comment is not None else {}
    rec = call(http.post, f"/remediations/{args.id}/{args.verb}", body)
    print(f"remediation {rec['id']}: {rec['status']}{' (' + rec['reason'] + ')' if rec.get('reason') else ''}")
    return 0
