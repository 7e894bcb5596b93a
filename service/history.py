"""The history: remediation records newest first, with filters and a cursor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


from trainmedic.client.wire import keys
from trainmedic.client.wire.records import OUTCOMES, RECORD_STATUSES, from_hash

from .errors import BadRequest

STATUSES = RECORD_STATUSES
FILTERS = ("alertname", "playbook", "target", "status", "outcome")
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
    outcome: str | None = None

    @classmethod
    def from_args(cls, args: Any) -> Query:
        unknown = set(args) - {"limit", "before", *FILTERS}
        if unknown:
            raise BadRequest(f"unknown query parameter {sorted(unknown)[0]!r}")
        raw = args.get("limit", "50")
        # ASCII digits only: "²".isdigit() is true, and int("²") fails.
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIMIT:
            raise BadRequest(f"limit must be an integer from 1 to {MAX_LIMIT}")
        before = args.get("before") or None
        if before is not None and not keys.RECORD_ID_RE.match(before):
            raise BadRequest("before must be the `next` cursor of a previous page")
        status = args.get("status") or None
        if status is not None and status not in STATUSES:
            raise BadRequest(f"status must be one of {', '.join(STATUSES)}")
        outcome = args.get("outcome") or None
        if outcome is not None and outcome not in OUTCOMES:
            raise BadRequest(f"outcome must be one of {', '.join(OUTCOMES)}")
        for name in ("alertname", "playbook", "target"):
            if len(args.get(name, "")) > 256:
                raise BadRequest(f"{name} is too long")
        return cls(limit=int(raw), before=before, alertname=args.get("alertname") or None,
                   playbook=args.get("playbook") or None, target=args.get("target") or None, status=status,
                   outcome=outcome)

    def accepts(self, rec: dict) -> bool:
        t = rec["target"]
        return ((self.status is None or rec["status"] == self.status)
                and (self.playbook is None or rec["playbook"] == self.playbook)
                and (self.alertname is None or rec["alert"].get("alertname") == self.alertname)
                and (self.outcome is None or (rec.get("outcome") or {}).get("status") == self.outcome)
                and (self.target is None or self.target in (t.get("name"), f"{t['kind']}:{t.get('name')}")))


def page(r: Any, q: Query) -> tuple[list[dict], str | None]:
    """Records newest first that pass the query, and the cursor of the next page (or None)."""
    items: list[dict] = []
    hi = "(" + q.before if q.before else "+"
    batch = max(q.limit, 100) if any(getattr(q, f) for f in FILTERS) else q.limit + 1
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
            rec = from_hash(h)
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
