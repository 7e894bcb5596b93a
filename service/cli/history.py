"""`trainmedic history`: remediation records from the service's API, as a table or JSON; --follow for new ones."""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..settings import ServiceSettings
from .common import UsageError, api, call, need, read_token

FOLLOW_SECONDS = 2.0
COLUMNS = ("ID", "CREATED", "STATUS", "PLAYBOOK", "TARGET", "ALERT", "ACTIONS", "OUTCOME")


def add(sub: Any) -> None:
    h = sub.add_parser("history", help="show remediation records, newest first")
    h.add_argument("--url", help="the service (default: TRAINMEDIC_URL, else http://127.0.0.1:9095)")
    h.add_argument("--limit", type=int, default=20, help="records to show first (1 to 500)")
    h.add_argument("--follow", action="store_true", help="keep printing records newer than those shown")
    h.add_argument("--json", action="store_true", help="one JSON record per line")
    h.set_defaults(run=run)


def target(rec: dict) -> str:
    """A record's target as `kind:name`, or `kind:none` when its alert named none that can be used."""
    t = rec["target"]
    # The record's reason (no_target or bad_label) says why there is none; the target says only that.
    return f"{t['kind']}:{t.get('name') or 'none'}"


def cells(rec: dict) -> tuple[str, ...]:
    """One record's cells, in COLUMNS order."""
    reason = f" ({rec['reason']})" if rec.get("reason") else ""
    acts = ", ".join(f"{a['action']}={a['status']}" for a in rec["actions"]) or "-"
    outcome = (rec.get("outcome") or {}).get("status") or "-"
    return (rec["id"], rec["created_at"][:19].replace("T", " "), rec["status"] + reason, rec["playbook"],
            target(rec), rec["alert"].get("alertname") or "-", acts, outcome)


class Table:
    """Rows in columns as wide as the widest cell seen first (records that come later keep those widths)."""

    def __init__(self, first: list[tuple[str, ...]], columns: tuple[str, ...] = COLUMNS):
        self.widths = [max([len(h), *(len(row[i]) for row in first)]) for i, h in enumerate(columns)]

    def line(self, row: tuple[str, ...]) -> str:
        # The last column is not padded: no trailing spaces.
        return "  ".join([c.ljust(w) for c, w in zip(row[:-1], self.widths)] + [row[-1]])


def run(args: argparse.Namespace, settings: ServiceSettings) -> int:
    need("history", "requests")
    if not 1 <= args.limit <= 500:
        raise UsageError("--limit must be from 1 to 500")
    http = api(settings, args.url, read_token(settings))
    items = call(http.get, "/history", {"limit": args.limit})["items"]
    table = Table([cells(rec) for rec in items])
    show = (lambda rec: json.dumps(rec)) if args.json else (lambda rec: table.line(cells(rec)))
    if not args.json:
        print(table.line(COLUMNS), flush=True)
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
