"""`trainmedic history`: remediation records from the service's API, as lines or JSON; --follow for new ones."""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from trainmedic.client.settings import Settings

from .common import UsageError, api, call, need

FOLLOW_SECONDS = 2.0


def add(sub: Any) -> None:
    h = sub.add_parser("history", help="show remediation records, newest first")
    h.add_argument("--url", help="the service (default: TRAINMEDIC_URL, else http://127.0.0.1:9095)")
    h.add_argument("--limit", type=int, default=20, help="records to show first (1 to 500)")
    h.add_argument("--follow", action="store_true", help="keep printing records newer than those shown")
    h.add_argument("--json", action="store_true", help="one JSON record per line")
    h.set_defaults(run=run)


def line(rec: dict) -> str:
    """One record as a line for people."""
    t = rec["target"]
    acts = ", ".join(f"{a['action']}={a['status']}" for a in rec["actions"]) or "-"
    reason = f" ({rec['reason']})" if rec.get("reason") else ""
    outcome = (rec.get("outcome") or {}).get("status")
    return (f"{rec['created_at'][:19].replace('T', ' ')}  {rec['status'] + reason:<30} {rec['playbook']:<22} "
            f"{t['kind']}:{t.get('name') or '?':<20} {rec['alert'].get('alertname', ''):<24} {acts}"
            + (f"  outcome={outcome}" if outcome else ""))


def run(args: argparse.Namespace, settings: Settings) -> int:
    need("history", "requests")
    if not 1 <= args.limit <= 500:
        raise UsageError("--limit must be from 1 to 500")
    http = api(settings, args.url)
    items = call(http.get, "/history", {"limit": args.limit})["items"]
    show = (lambda rec: json.dumps(rec)) if args.json else line
    for rec in items:  # newest first, as the page and the API list them
        print(show(rec), flush=True)
    newest = items[0]["id"] if items else ""
    while args.follow:
        time.sleep(FOLLOW_SECONDS)
        fresh = [rec for rec in call(http.get, "/history", {"limit": 500})["items"] if rec["id"] > newest]
        # Record ids sort by creation time: print only those newer than the newest shown, in time order.
        for rec in reversed(fresh):
            print(show(rec), flush=True)
        if fresh:
            newest = fresh[0]["id"]
    return 0
