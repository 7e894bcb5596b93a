"""Redis data written by earlier versions, brought to today's layout once, at the first start of this one.

- Guards and episodes: the version before kept them in one hash per playbook and target (and the one before
  that in keys of their own); today they live in the target's state (keys.target_state), each field under its
  playbook's name. Every old key is folded in and deleted, so an upgrade forgets no open episode, cooldown or
  spent budget (fields written since by this version win).
- Records still open (dispatched, held, or followed by the reconciler) are rewritten in today's layout (what
  was decided in one value, `d`, sealed anew) if their seal still matches; the command a dispatched one holds
  keeps its own bytes and signature, which appliers still check. Closed records are read as they are.
- A job's ledger (the LR changes a resume applies again): the version before kept each change's command in its
  entry; today's appliers read it from the record, so each such record gets its command back (`cmd`, `sig`).
- The approvals index is kept in milliseconds.

The old keys are found from the records the history lists (every episode and guard belongs to a record's
target, playbook and alert), not by scanning the keyspace, which the service's Redis user may not.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from ..client.wire import keys
from ..client.wire.status import ACTION_CODES, RecordStatus

from .store.decision import decided_text, shown_alert
from .store.record import BadRecord, StoredRecord
from .store.seals import seal_text

log = logging.getLogger("trainmedic.upgrade")

UPGRADED = keys.PREFIX + "upgraded:v4"
UPGRADING = keys.PREFIX + "upgrading:v4"  # the lock of the one service doing it
# Written by versions before the episode kept its `hi`; nothing reads it.
_DROPPED = frozenset({"st"})
# One worker folds; the others wait for it this long (a worker must be up within gunicorn's timeout).
LOCK_MS = 60_000
WAIT = 25.0
BATCH = 1000
# The fields a record of the version before kept that today's keeps in `d` or under other names.
_EARLIER = ("playbook", "mode", "n", "alert", "start", "fence", "expire_after", "context", "stage", "parent",
            "created_ms", "requested_by", "verify_ms", "follow", "approve_by", "expires_ms", "dispatched_ms", "seq",
            "hx")


def run(r: Any, signer: Any = None) -> int:
    """Bring an earlier version's data to today's layout (see the module's docstring), once; how many keys and
    records it changed."""
    if r.exists(UPGRADED):
        return 0
    token = uuid.uuid4().hex
    if not r.set(UPGRADING, token, nx=True, px=LOCK_MS):
        deadline = time.monotonic() + WAIT
        while not r.exists(UPGRADED) and time.monotonic() < deadline:
            time.sleep(0.1)
        return 0
    changed = _approvals_in_ms(r)
    for ids in _history(r):
        changed += _upgrade_records(r, ids, signer)
    r.set(UPGRADED, "1")
    r.delete(UPGRADING)
    if changed:
        log.info("brought %d keys and records of an earlier version to today's layout", changed)
    return changed


def _history(r: Any) -> Any:
    """The history's record ids, newest first, a batch at a time."""
    start = 0
    # ZRANGE ... REV (the service's Redis user has ZRANGE, not ZREVRANGE).
    while ids := r.execute_command("ZRANGE", keys.HISTORY, start, start + BATCH - 1, "REV"):
        yield [str(x) for x in ids]
        start += BATCH


def _approvals_in_ms(r: Any) -> int:
    """The approvals index as the version before kept it (deadlines in seconds), in milliseconds."""
    old = r.zrangebyscore(keys.APPROVALS, "-inf", 1e11, withscores=True)
    if old:
        r.zadd(keys.APPROVALS, {str(rid): int(score * 1000) for rid, score in old})
    return len(old)


def _upgrade_records(r: Any, ids: list[str], signer: Any) -> int:
    """Fold the old state keys of these records' targets, playbooks and alerts; rewrite the open ones."""
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.hgetall(keys.record(rid))
    changed = 0
    old: dict[str, tuple[str, keys.Target, str, str]] = {}  # old key -> (kind, target, playbook, fingerprint)
    jobs: set[keys.Target] = set()
    for rid, h in zip(ids, pipe.execute()):
        if not h or "d" in h or not h.get("playbook"):
            continue
        t = keys.target_of_record(rid)
        playbook = str(h["playbook"])
        head = f"{keys.PREFIX}{t.tag}"
        fingerprint = str((json.loads(h["alert"]) if h.get("alert") else {}).get("fingerprint") or "")
        old[keys.playbook_state(t, playbook)] = ("state", t, playbook, "")
        old[f"{head}:cooldown:{playbook}"] = ("cooldown", t, playbook, "")
        old[f"{head}:budget:{playbook}"] = ("budget", t, playbook, "")
        if fingerprint:
            old[f"{head}:episode:{playbook}:{fingerprint}"] = ("episode", t, playbook, fingerprint)
        if signer is not None and _open(h):
            changed += _rewrite(r, rid, h, signer)
        if t.kind == "job":
            jobs.add(t)
    for t in jobs:
        changed += _ledger_commands(r, t)
    pipe = r.pipeline(transaction=False)
    for key in old:
        pipe.pttl(key)
    now_ms = int(time.time() * 1000)
    for (key, (kind, t, playbook, fingerprint)), ttl in zip(old.items(), pipe.execute()):
        if ttl > 0:
            _fold(r, kind, key, t, playbook, fingerprint, now_ms + ttl)
            state = keys.target_state(t)
            r.pexpire(state, max(ttl, r.pttl(state)))
            r.delete(key)
            changed += 1
    return changed


def _fold(r: Any, kind: str, key: str, t: keys.Target, playbook: str, fingerprint: str, until_ms: int) -> None:
    """One old key's content, written into the target's state where the state does not hold it already."""
    state = keys.target_state(t)
    have = r.hmget(state, f"{playbook}|cool", f"{playbook}|runs")
    if kind == "cooldown":
        r.hset(state, f"{playbook}|cool", max(int(have[0] or 0), until_ms))
    elif kind == "budget":
        spent = (str(int(score)) for _, score in r.zrange(key, 0, -1, withscores=True))
        r.hset(state, f"{playbook}|runs", " ".join(sorted({*(have[1] or "").split(), *spent})))
    elif kind == "episode":
        for name, value in r.hgetall(key).items():
            if name not in _DROPPED:
                r.hsetnx(state, keys.episode_fields(playbook, fingerprint, name)[0], value)
    else:  # a playbook's state hash: its guards, and each alert's episode as FINGERPRINT|NAME
        for name, value in r.hgetall(key).items():
            if name == "cool":
                r.hset(state, f"{playbook}|cool", max(int(have[0] or 0), int(value or 0)))
            elif name == "runs":
                r.hset(state, f"{playbook}|runs", " ".join(sorted({*(have[1] or "").split(), *str(value).split()})))
            else:
                r.hsetnx(state, f"{playbook}|{name}", value)


def _ledger_commands(r: Any, t: keys.Target) -> int:
    """The commands the job's ledger entries of the version before carry (their own bytes and signature), kept
    in their records, where today's appliers read a ledger entry's command to apply it again after a resume;
    how many."""
    changed = 0
    for raw in r.lrange(keys.ledger(t), 0, -1):
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("cmd"), str) or not entry.get("sig"):
            continue
        rid = str(entry.get("rid") or "")
        if not keys.RECORD_ID_RE.match(rid) or keys.target_of_record(rid) != t:
            continue
        status, cmd = r.hmget(keys.record(rid), "status", "cmd")
        if status is not None and cmd is None:  # a record that is still kept, without its command
            r.hset(keys.record(rid), mapping={"cmd": entry["cmd"], "sig": str(entry["sig"])})
            changed += 1
    return changed


def _open(h: dict[str, str]) -> bool:
    return h.get("status") in (RecordStatus.DISPATCHED, RecordStatus.PENDING_APPROVAL) or h.get("follow") == "1"


def _rewrite(r: Any, rid: str, h: dict[str, str], signer: Any) -> int:
    """An open record of the version before, in today's layout, when its seal still matches; 1 if rewritten."""
    try:
        rec = StoredRecord.from_hash(rid, h)
    except BadRecord:
        return 0
    if not rec.intact(signer):
        return 0  # changed in Redis since it was decided: left as it is (never signed again)
    alert = shown_alert(json.loads(h["alert"])) if h.get("alert") else {}
    decided = decided_text(rec.playbook, rec.mode, rec.requested_by, alert, rec.steps, rec.context, rec.start,
                           rec.stage, rec.parent or "", rec.expire_after)
    # Every rewritten record keeps its actions' statuses in `as` (a followed one that settled too: without it,
    # its applied actions would read as skipped).
    new: dict[str, Any] = {"d": decided, "seal": signer.seal(seal_text(rid, decided)), "at": rec.dispatched_ms,
                           "as": "".join(ACTION_CODES.get(a.status, "S") for a in rec.actions)}
    for i, a in enumerate(rec.actions):
        if a.acked_at or a.reason or a.result:
            new[f"r:{i}"] = json.dumps({"reason": a.reason, "result": a.result, "at": a.acked_at, "by": a.acked_by})
        if a.reapplied:
            new[f"re:{i}"] = json.dumps(list(a.reapplied))
        if a.acked_by:
            new["acked"] = "1"
        claimed = h.get(f"a:{i}:claimed_by")
        if claimed:
            new["c"] = f"{claimed}|{h.get(f'a:{i}:claimed_ms') or 0}"
    for name, value in (("exp", rec.expires_ms), ("ab", rec.approve_by_ms), ("v", rec.verify_ms)):
        if value is not None:
            new[name] = value
    if rec.follow:
        new["f"] = "1"
    gone = [*_EARLIER, *(k for k in h if k.startswith("a:"))]
    pipe = r.pipeline(transaction=True)
    pipe.hdel(keys.record(rid), *gone)
    pipe.hset(keys.record(rid), mapping=new)
    pipe.execute()
    return 1
