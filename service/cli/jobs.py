"""`trainmedic jobs`: every job seen in the last 30 days and where its time went, from the service's API."""
from __future__ import annotations

import argparse
import json
from typing import Any

from ..settings import ServiceSettings
from .common import api, call, need, read_token
from .history import Table

COLUMNS = ("JOB", "LIVE", "STEP", "WALL", "GOODPUT", "PRODUCTIVE", "STALL", "RECOMPUTE", "DOWN", "REMEDIATIONS",
           "LAST SEEN")
PAGE = 1000


def add(sub: Any) -> None:
    j = sub.add_parser("jobs", help="show every job's time: productive, lost to stalls, recompute and down time")
    j.add_argument("--url", help="the service (default: TRAINMEDIC_URL, else http://127.0.0.1:9095)")
    j.add_argument("--json", action="store_true", help="one JSON job per line")
    j.set_defaults(run=run)


def span(seconds: float) -> str:
    """Seconds as a table reads them: 42s, 3m12s, 2h05m, 3d04h."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def cells(job: dict) -> tuple[str, ...]:
    """One job's cells, in COLUMNS order."""
    lost = job["lost_s"]
    goodput = "-" if job["goodput"] is None else f"{100 * job['goodput']:.1f}%"
    return (job["job_name"], "yes" if job["live"] else "no", "-" if job["step"] is None else str(job["step"]),
            span(job["wall_s"]), goodput, span(job["productive_s"]), span(lost["stall"]), span(lost["recompute"]),
            span(lost["down"]), str(job["remediations"]), job["last_seen"][:19].replace("T", " "))


def run(args: argparse.Namespace, settings: ServiceSettings) -> int:
    need("jobs", "requests")
    http = api(settings, args.url, read_token(settings))
    items: list[dict] = []
    query: dict[str, Any] = {"limit": PAGE}
    while True:  # live jobs first, then by name, page after page
        answer = call(http.get, "/jobs", query)
        items.extend(answer["items"])
        if not answer.get("next"):
            break
        query["before"] = answer["next"]
    if args.json:
        for job in items:
            print(json.dumps(job))
        return 0
    rows = [cells(job) for job in items]
    table = Table([COLUMNS, *rows], COLUMNS)
    for row in [COLUMNS, *rows]:
        print(table.line(row))
    return 0
