"""Jobs as GET /jobs, GET /jobs/<name>, `trainmedic jobs` and the job's page show them (README: Goodput).

Each job's figures come from its account (service/job_account.py), as of now; its incidents are its newest
records (the history's per-target index) with when its step passed the highest step it had when their alert
began (service/goodput.py notes that). The list pages through an index whose members sort live jobs first,
then the others, each by name; a page's cursor is the member of its last job.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..client.wire import keys
from ..client.wire.protocol import parse_rfc3339, rfc3339
from ..client.wire.status import Mode

from . import goodput, incidents
from .errors import BadRequest
from .job_account import Figures
from .store.record import BadRecord, StoredRecord
from .store.schema import TIME, View, schema_of, view

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_INCIDENTS = incidents.MAX_INCIDENTS
CURSOR_RE = re.compile(r"^[ln]:" + keys.TARGET_NAME_RE.pattern.lstrip("^"))
SECONDS = {"minimum": 0, "description": "seconds"}


@view
class LostView(View):
    """Seconds that made no progress, by why."""

    stall: float = dataclasses.field(metadata=SECONDS)
    recompute: float = dataclasses.field(metadata=SECONDS)
    down: float = dataclasses.field(metadata=SECONDS)


@view
class IncidentView(View):
    """A remediation of the job and when the job recovered from what it answered."""

    id: str = dataclasses.field(metadata={"pattern": keys.RECORD_ID_RE.pattern.replace("\\Z", "$")})
    playbook: str
    alertname: str
    started_at: str | None = dataclasses.field(metadata={**TIME, "description": "the alert's start"})
    decided_at: str = dataclasses.field(metadata={**TIME, "description": "the record's creation"})
    applied_at: str | None = dataclasses.field(metadata={**TIME, "description": "its last acknowledgement"})
    recovered_at: str | None = dataclasses.field(metadata={
        **TIME, "description": "when the job's step first passed the highest step it had reached when the alert "
                               "started (null until then)"})
    recovered_after_s: float | None = dataclasses.field(metadata={"description": "from started_at to recovered_at"})


@view
class JobView(View):
    """A job's time: what made progress, what was lost and why (README: Goodput)."""

    job_name: str = dataclasses.field(metadata={"pattern": keys.TARGET_NAME_RE.pattern.replace("\\Z", "$")})
    live: bool = dataclasses.field(metadata={"description": "a process heartbeated within the last minute and "
                                                            "has not closed"})
    step: int | None
    first_seen: str = dataclasses.field(metadata=TIME)
    last_seen: str = dataclasses.field(metadata=TIME)
    wall_s: float = dataclasses.field(metadata=SECONDS)
    productive_s: float = dataclasses.field(metadata=SECONDS)
    lost_s: LostView
    goodput: float | None = dataclasses.field(metadata={
        "minimum": 0, "maximum": 1, "description": "productive_s / wall_s; null before the first step"})
    remediations: int = dataclasses.field(metadata={"minimum": 0, "description": "the job's records, 30 days"})
    incidents: list[IncidentView] | None = dataclasses.field(
        default=None, metadata={"description": "GET /jobs/<name> only: newest first, at most 100"})


@view
class JobsPage(View):
    """A page of GET /jobs."""

    items: list[JobView]
    next: str | None = dataclasses.field(metadata={
        "pattern": CURSOR_RE.pattern.replace("\\Z", "$"),
        "description": "Pass as `before` for the next page; null on the last page."})


# The OpenAPI components, by name.
COMPONENTS: dict[type, str] = {JobView: "Job", IncidentView: "Incident", JobsPage: "JobsPage"}
SCHEMA: dict[str, dict[str, Any]] = {name: schema_of(cls, COMPONENTS) for cls, name in COMPONENTS.items()}


@dataclass(frozen=True)
class Query:
    """A validated GET /jobs query."""

    limit: int = DEFAULT_LIMIT
    before: str | None = None
    live: bool | None = None

    @classmethod
    def from_args(cls, args: Mapping[str, str]) -> Query:
        unknown = set(args) - {"limit", "before", "live"}
        if unknown:
            raise BadRequest(f"unknown query parameter {sorted(unknown)[0]!r}")
        raw = args.get("limit", str(DEFAULT_LIMIT))
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIMIT:
            raise BadRequest(f"limit must be an integer from 1 to {MAX_LIMIT}")
        before = args.get("before") or None
        if before is not None and not CURSOR_RE.match(before):
            raise BadRequest("before must be the `next` cursor of a previous page")
        live = args.get("live") or None
        if live not in (None, "true", "false"):
            raise BadRequest("live must be true or false")
        return cls(limit=int(raw), before=before, live=None if live is None else live == "true")


def job_view(name: str, f: Figures, first: float, last: float, step: int | None, remediations: int,
             incidents: list[IncidentView] | None = None) -> JobView:
    """A job as the API shows it."""
    return JobView(job_name=name, live=f.live, step=step, first_seen=rfc3339(first), last_seen=rfc3339(last),
                   wall_s=round(f.wall, 3), productive_s=round(f.productive, 3),
                   lost_s=LostView(stall=round(f.stall, 3), recompute=round(f.recompute, 3), down=round(f.down, 3)),
                   goodput=None if f.goodput is None else round(f.goodput, 4), remediations=remediations,
                   incidents=incidents)


def page(r: Any, q: Query, now: float) -> tuple[list[JobView], str | None]:
    """A page of jobs, live first, then by name, and the cursor of the next page (or None)."""
    low = {True: "[l:", False: "[n:", None: "-"}[q.live]
    high = {True: "(l;", False: "(n;", None: "+"}[q.live]
    if q.before:  # after the cursor, within the section the query lists
        low = max(low, f"({q.before}", key=lambda x: x[1:])
    items: list[JobView] = []
    last = None
    more = False
    while len(items) <= q.limit:
        members = [str(m) for m in r.zrange(keys.GOODPUT_JOBS, low, high, bylex=True, offset=0,
                                            num=q.limit + 1 - len(items))]
        if not members:
            break
        names = [m[2:] for m in members]
        accounts = goodput.accounts(r, names)
        pipe = r.pipeline(transaction=False)
        for n in names:
            pipe.zcard(keys.target_history(keys.Target("job", n)))
        counts = pipe.execute()
        gone = []
        for m, n, acc, count in zip(members, names, accounts, counts):
            if acc is None:
                gone.append(m)  # past retention (or not an account): the sweep would drop it too
                continue
            if len(items) == q.limit:
                more = True
                break
            items.append(job_view(n, acc.figures(now), acc.first, acc.last, acc.step, int(count)))
            last = m
        if gone:
            r.zrem(keys.GOODPUT_JOBS, *gone)
        if more:
            break
        low = f"({members[-1]}"
    return items, last if more else None


def one(r: Any, name: str, now: float) -> JobView | None:
    """One job with its incidents, or None when no job of that name was seen within retention."""
    if not keys.TARGET_NAME_RE.match(name):
        return None
    [acc] = goodput.accounts(r, [name])
    if acc is None:
        return None
    t = keys.Target("job", name)
    pipe = r.pipeline(transaction=False)
    pipe.zcard(keys.target_history(t))
    pipe.zrevrangebyscore(keys.target_history(t), "+inf", "-inf", start=0, num=2 * MAX_INCIDENTS)
    pipe.hgetall(keys.goodput_incidents(t))
    count, rids, noted = pipe.execute()
    return job_view(name, acc.figures(now), acc.first, acc.last, acc.step, int(count),
                    incident_views(r, [str(x) for x in rids], noted))


def incident_views(r: Any, rids: Sequence[str], noted: Mapping[str, str]) -> list[IncidentView]:
    """The records of these ids that remediated an alert (not on_resolved, skipped or dry-run ones), newest first,
    at most 100."""
    pipe = r.pipeline(transaction=False)
    for rid in rids:
        pipe.hgetall(keys.record(rid))
    out: list[IncidentView] = []
    for rid, h in zip(rids, pipe.execute()):
        if not h or len(out) == MAX_INCIDENTS:
            continue
        try:
            rec = StoredRecord.from_hash(rid, h)
        except BadRecord:
            continue  # not a record trainmedic wrote (the history skips it too)
        if rec.mode in (Mode.RESOLVED, Mode.TIMEOUT) or rec.status in incidents.NOT_REMEDIATIONS:
            continue
        started = rec.alert.starts_at or None
        acks = [a for a in (a.acked_at for a in rec.actions) if a]
        applied = max(acks, key=lambda a: parse_rfc3339(a) or 0.0) if acks else None
        recovered = incidents.recovered_at(noted.get(rid))
        start = parse_rfc3339(started)
        out.append(IncidentView(
            id=rid, playbook=rec.playbook, alertname=rec.alert.alertname, started_at=started,
            decided_at=rec.created_at, applied_at=applied,
            recovered_at=rfc3339(recovered) if recovered is not None else None,
            recovered_after_s=round(max(0.0, recovered - start), 3)
            if recovered is not None and start is not None else None))
    return out
