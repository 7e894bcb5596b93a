"""A job's incidents: each remediation of the job, and when the job recovered from it (README: Goodput).

When the service first sees a new record of a job (the history's sequence numbers, from where the last pass
stopped), it notes the job's highest step when the record's alert began; at each later heartbeat whose step
is above it, once the record's actions were answered, it notes when the step passed it: the incident's
recovery. Notes live in one hash per job (record id -> "HIGHEST RECOVERED_AT"), its newest 100, 30 days.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..client.wire import keys
from ..client.wire.cluster import mget
from ..client.wire.protocol import parse_rfc3339
from ..client.wire.status import Mode, RecordStatus

from .job_account import ACCOUNT_KEY, DAY, Account
from .store.record import BadRecord, StoredRecord

RETENTION = 30 * DAY
MAX_INCIDENTS = 100
# New records looked at per pass.
NEW_RECORDS = 1000
# Records still waiting for their actions: their incident cannot have recovered yet.
UNSETTLED = (RecordStatus.DISPATCHED, RecordStatus.PENDING_APPROVAL)
# Records that are no remediation: skipped (cooldown, a repeat of an episode, a guard) or only recorded.
NOT_REMEDIATIONS = (RecordStatus.SKIPPED, RecordStatus.DRY_RUN)


def discover(r: Any, now: float, accounts: Mapping[str, Account]) -> dict[str, Account]:
    """Note, for each job record made since the last pass, the job's highest step when its alert began. Returns
    the accounts that now watch for a recovery (those of `accounts`, and of other jobs, read here)."""
    cursor = r.get(keys.GOODPUT_SEQ)
    if cursor is None:  # the first pass: records made before goodput was kept are not its incidents
        top = r.zrevrangebyscore(keys.HISTORY, "+inf", "-inf", start=0, num=1, withscores=True)
        r.set(keys.GOODPUT_SEQ, int(top[0][1]) if top else 0)
        return {}
    rows = r.zrangebyscore(keys.HISTORY, f"({int(cursor)}", "+inf", start=0, num=NEW_RECORDS, withscores=True)
    if not rows:
        return {}
    rids = [str(rid) for rid, _ in rows if keys.RECORD_ID_RE.match(str(rid)) and "~job~" in str(rid)]
    known = dict(accounts)
    others = sorted({keys.target_of_record(rid).name for rid in rids} - set(known))
    known.update((n, a) for n, a in zip(others, map(Account.decode, mget(r, [ACCOUNT_KEY % n for n in others])))
                 if a is not None)
    pipe = r.pipeline(transaction=False)
    for rid in rids:
        pipe.hgetall(keys.record(rid))
    notes: list[tuple[keys.Target, str, int | None]] = []
    watching: dict[str, Account] = {}
    for rid, h in zip(rids, pipe.execute()):
        t = keys.target_of_record(rid)
        acc = known.get(t.name)
        if not h or acc is None:
            continue  # gone already, or a job that never sent goodput figures
        try:
            rec = StoredRecord.from_hash(rid, h)
        except BadRecord:
            continue  # not a record trainmedic wrote (the history skips it too)
        if rec.mode in (Mode.RESOLVED, Mode.TIMEOUT):
            continue  # undoing an earlier remediation is not an incident of its own
        if rec.status in NOT_REMEDIATIONS:
            continue  # a repeat skipped by a guard, or a dry run: nothing was done to the job
        start = parse_rfc3339(rec.alert.starts_at) or parse_rfc3339(rec.created_at) or now
        high = acc.high_at(start)
        notes.append((t, rid, high))
        if high is not None:
            acc.watch = high if acc.watch is None else min(acc.watch, high)
            watching[t.name] = acc
    pipe = r.pipeline(transaction=False)
    for t, rid, high in notes:
        key = keys.goodput_incidents(t)
        pipe.hsetnx(key, rid, f"{'-' if high is None else high} -")
        pipe.pexpire(key, int(RETENTION * 1000))
    pipe.set(keys.GOODPUT_SEQ, int(rows[-1][1]))
    pipe.execute()
    for t in {t for t, _, _ in notes}:
        _trim(r, t)
    return watching


def _trim(r: Any, t: keys.Target) -> None:
    """Keep the job's newest MAX_INCIDENTS notes."""
    key = keys.goodput_incidents(t)
    if int(r.hlen(key)) > MAX_INCIDENTS:
        old = sorted(r.hgetall(key))[:-MAX_INCIDENTS]  # record ids sort by their creation time
        r.hdel(key, *old)


Beat = tuple[keys.Target, Account, tuple[float, int | None], tuple[float, int] | None]


def recover(r: Any, beats: Sequence[Beat]) -> None:
    """Note when each open incident recovered, for jobs whose new heartbeat's step passed one's highest step.
    A beat: the job, its account (after the heartbeat), the (time, step) of the heartbeat before, and when and
    to which step its process last went back."""
    due = [b for b in beats if b[1].watch is not None and b[1].step is not None and b[1].step > b[1].watch]
    if not due:
        return
    pipe = r.pipeline(transaction=False)
    for t, *_ in due:
        pipe.hgetall(keys.goodput_incidents(t))
    for (t, acc, prev, back), notes in zip(due, pipe.execute()):
        assert acc.step is not None
        opened = {rid: int(v.split(" ")[0]) for rid, v in notes.items()
                  if v.endswith(" -") and v.split(" ")[0].lstrip("-").isdigit()}
        recovered: dict[str, str] = {}
        for rid, high in opened.items():
            if high >= acc.step:
                continue
            try:
                rec = StoredRecord.from_hash(rid, h) if (h := r.hgetall(keys.record(rid))) else None
            except BadRecord:
                rec = None
            if rec is not None and rec.status in UNSETTLED:
                continue  # its actions are still under way: the step it passed may yet be rolled back
            at = crossing(prev, back, (acc.last, acc.step), high)
            if rec is not None:
                at = max(at, applied_at(rec) or 0.0, parse_rfc3339(rec.created_at) or 0.0)
            recovered[rid] = f"{high} {at:.3f}"
        if recovered:
            r.hset(keys.goodput_incidents(t), mapping=recovered)
        still = [h for rid, h in opened.items() if rid not in recovered]
        acc.watch = min(still) if still else None


def crossing(prev: tuple[float, int | None], back: tuple[float, int] | None, now: tuple[float, int],
             high: int) -> float:
    """When the step passed `high` between the previous heartbeat (or the step back after it) and this one."""
    t0, s0 = back if back is not None and back[0] > prev[0] else prev
    t1, s1 = now
    if s0 is None or s0 > high or s1 <= s0:
        return t0
    return t0 + (t1 - t0) * min(1.0, (high + 1 - s0) / (s1 - s0))  # integer steps: passing is reaching high + 1


def applied_at(rec: StoredRecord) -> float | None:
    """The record's last acknowledgement (seconds), or None when nothing was acknowledged."""
    times = [parse_rfc3339(a.acked_at) for a in rec.actions]
    known = [t for t in times if t is not None]
    return max(known) if known else None


def recovered_at(note: str | None) -> float | None:
    """When an incident's note says its job recovered, or None."""
    if not note:
        return None
    _, _, at = note.partition(" ")
    try:
        value = float(at)
    except ValueError:
        return None
    return value if value == value and 0 <= value < 1e11 else None
