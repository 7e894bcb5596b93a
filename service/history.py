"""Remediation records: read one, list newest first with filters and a cursor."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import rfc3339

from trainmedic.service.errors import BadRequest

STATUSES = ("pending_approval", "dispatched", "applied", "partially_applied", "failed", "skipped",
            "dry_run", "expired")
MAX_LIMIT = 500
SCAN_CAP = 5000  # records examined per request when filters are sparse; the cursor continues from there


@dataclass(frozen=True)
class Query:
    """A validated GET /history query."""

    limit: int = 50
    before: str | None = None
    alertname: str | None = None
    playbook: str | None = None
    target: str | None = None
    status: str | None = None

    @classmethod
    def from_args(cls, args: Any) -> "Query":
        unknown = set(args) - {"limit", "before", "alertname", "playbook", "target", "status"}
        if unknown:
            raise BadRequest(f"unknown query parameter {sorted(unknown)[0]!r}")
        raw = args.get("limit", "50")
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
            raise BadRequest(f"limit must be an integer from 1 to {MAX_LIMIT}")
        before = args.get("before") or None
        if before is not None and not keys.RECORD_ID_RE.match(before):
            raise BadRequest("before must be the `next` cursor of a previous page")
        status = args.get("status") or None
        if status is not None and status not in STATUSES:
            raise BadRequest(f"status must be one of {', '.join(STATUSES)}")
        for name in ("alertname", "playbook", "target"):
            if len(args.get(name, "")) > 256:
                raise BadRequest(f"{name} is too long")
        return cls(limit=int(raw), before=before, alertname=args.get("alertname") or None,
                   playbook=args.get("playbook") or None, target=args.get("target") or None, status=status)

    def accepts(self, rec: dict) -> bool:
        t = rec["target"]
        return ((self.status is None or rec["status"] == self.status)
                and (self.playbook is None or rec["playbook"] == self.playbook)
                and (self.alertname is None or rec["alert"].get("alertname") == self.alertname)
                and (self.target is None or self.target in (t.get("name"), f"{t['kind']}:{t.get('name')}")))


def to_record(h: dict) -> dict:
    """The contract's record from its Redis hash."""
    actions = []
    for i in range(int(h.get("n") or 0)):
        spec = json.loads(h[f"a:{i}:spec"])
        result = h.get(f"a:{i}:result")
        actions.append({
            "action": spec["action"], "params": spec["params"],
            "status": h.get(f"a:{i}:status", "pending"),
            "result": json.loads(result) if result else None,
            "acked_at": h.get(f"a:{i}:acked_at") or None,
            "acked_by": h.get(f"a:{i}:acked_by") or None,
        })
    rec = {
        "id": h["id"], "created_at": h["created_at"], "playbook": h["playbook"], "status": h["status"],
        "reason": h.get("reason") or None, "alert": json.loads(h["alert"]), "target": json.loads(h["target"]),
        "actions": actions,
    }
    if h.get("detail"):
        rec["detail"] = h["detail"]
    if h.get("mode") == "resolved":
        rec["on_resolved"] = True
    if h.get("approve_by") and h["status"] == "pending_approval":
        rec["approval_expires_at"] = rfc3339(float(h["approve_by"]))
    return rec


def get(r: redis.Redis, record_id: str) -> dict | None:
    """One record, or None."""
    try:
        key = keys.record(record_id)
    except ValueError:
        return None
    h = r.hgetall(key)
    return to_record(h) if h else None


def page(r: redis.Redis, q: Query) -> tuple[list[dict], str | None]:
    """Records newest first that pass the query, and the cursor of the next page (or None)."""
    items: list[dict] = []
    hi = "(" + q.before if q.before else "+"
    batch = max(q.limit, 100) if (q.status or q.playbook or q.alertname or q.target) else q.limit + 1
    scanned = 0
    while True:
        ids = r.zrevrangebylex(keys.HISTORY, hi, "-", start=0, num=batch)
        if not ids:
            return items, None
        pipe = r.pipeline(transaction=False)
        for rid in ids:
            pipe.hgetall(keys.record(rid))
        gone = []
        for rid, h in zip(ids, pipe.execute()):
            scanned += 1
            if not h:
                gone.append(rid)  # expired record: drop it from the index
                continue
            rec = to_record(h)
            if q.accepts(rec):
                if len(items) == q.limit:
                    return items, items[-1]["id"]
                items.append(rec)
        if gone:
            r.zrem(keys.HISTORY, *gone)
        hi = "(" + ids[-1]
        if len(ids) < batch:
            return items, None
        if scanned >= SCAN_CAP:
            return items, ids[-1]
