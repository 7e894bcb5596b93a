"""The history: remediation records newest first, with filters and a cursor, answered from indexes.

The index (README "HTTP API", GET /history: full pages, every record within retention listed and filterable):

- Every record gets a sequence number when it is first indexed (HIST_SEQ, INCRBY); `keys.HISTORY` holds record
  ids scored by it, and the record keeps it in its `seq` field.
- Per segment of 2^16 sequence numbers, a bitmap per (field, value) says which records have it: status,
  outcome (`none` for records without one), playbook and alertname (hashed, so a key stays short).
- Per target, `{tag}:hist` holds the target's record ids by sequence number (the `target=` filter).
- The scripts that make a record or change its status or outcome push its id to a journal (lua/common.lua
  `hist_touch`): the global one on a single Redis, the target's own on Redis Cluster (a script may only touch
  its slot), where whoever ran the script then names the target in `keys.HIST_DIRTY` (client/wire/cluster.py
  `mark_journaled`: the service, and trainers and agents for their claims and acks). `catch_up` (one indexer
  at a time, under a lock) first moves the named targets' journals into the global one, then folds it into
  the indexes, reading each record's current status and outcome, so the order in which changes were
  journaled does not matter. Every query catches up before it answers, and so does every reconciler tick, so a
  query sees every change made before it (a record is listed and filterable as soon as the webhook answered),
  on any target, visited by the reconciler or not; the webhook itself never waits for the indexer.
- Concurrency: the lock (LOCK_MS) is renewed between batches. On a single Redis each batch of FOLD_BATCH
  entries is one script (client/wire/lua/fold.lua) that writes only while the lock holds the indexer's token,
  so an indexer whose lock lapsed writes nothing (the next one does it). On Redis Cluster (no transaction
  across slots) the lock is checked between batches only: a batch that stalls past LOCK_MS can still overlap
  the next indexer's first batch (both write the records' current state, but a new record could get two
  sequence numbers); batches there are DRAIN_BATCH entries, folded from the service in Python (`_drain_batch`).
  Which of the two runs, and the journals' forwarding, is client/wire/cluster.py's (`fold_batch`).
- A query walks candidates newest first (the history, a target's set, or the AND of bitmaps segment by
  segment), reads their records and checks each against the query (a stale bit can only add a candidate,
  never hide one), until the page has `limit` records and one more says there is a next page.
- Retention (`trim`, called by the reconciler) deletes the oldest records beyond the count, clears their
  bits and target entries, sweeps records that expired by age out of the indexes, and drops whole segments
  that hold no record any more.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..client.wire import cluster, keys
from ..client.wire.records import Outcome, RecordStatus, StoredRecord, lua

from .errors import BadRequest, NotFound

# The filters' choices.
STATUSES = tuple(RecordStatus)
OUTCOMES = tuple(Outcome)
FILTERS = ("alertname", "playbook", "target", "status", "outcome")
MAX_LIMIT = 500
SEG_BITS = 16
SEG = 1 << SEG_BITS
DRAIN_BATCH = 1000
# Journal entries one FOLD script takes on a single Redis (~35 µs of Redis each: it holds Redis ~4 ms).
FOLD_BATCH = 100
LOCK_MS = 10_000
# Records the retention sweep checks per tick for having expired by age (oldest first).
SWEEP_PROBE = 1000


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

    def bitmaps(self) -> list[tuple[str, str]]:
        """(field, value) of the bitmaps this query ANDs (target= has its own index)."""
        out = []
        if self.status:
            out.append(("s", self.status))
        if self.outcome:
            out.append(("o", self.outcome))
        if self.playbook:
            out.append(("p", _hashed(self.playbook)))
        if self.alertname:
            out.append(("a", _hashed(self.alertname)))
        return out


def _hashed(value: str) -> str:
    # SHA-1 because lua/fold.lua computes the same names (redis.sha1hex); a name, not a secret.
    return hashlib.sha1(value.encode()).hexdigest()[:16]


def _mutable(h: dict[str, Any]) -> str:
    """The index state of a record that may change: "status|outcome"."""
    raw = h.get("outcome")
    outcome = (json.loads(raw) or {}).get("status") if raw else None
    return f"{h.get('status')}|{outcome or 'none'}"


def _bits(seq: int, state: str, playbook: str | None, alertname: str | None) -> list[str]:
    seg = seq >> SEG_BITS
    status, outcome = state.split("|", 1)
    out = [keys.hist_bitmap(seg, "s", status), keys.hist_bitmap(seg, "o", outcome)]
    if playbook is not None:
        out.append(keys.hist_bitmap(seg, "p", _hashed(playbook)))
        out.append(keys.hist_bitmap(seg, "a", _hashed(alertname or "")))
    return out


# -- indexing ---------------------------------------------------------------------------------------------

def catch_up(r: Any, wait: float = 1.0) -> int:
    """Index what the journal holds (records made, statuses and outcomes changed); how many entries it took.
    One indexer at a time: a caller that finds another one at work waits for it (up to `wait` seconds), so
    that what was journaled before the call is indexed when it returns. On Redis Cluster it first moves the
    journals of the targets named in keys.HIST_DIRTY into the global one."""
    if not cluster.journal_pending(r):
        return 0
    # A waiter may stop once the journal shows everything before it indexed (cluster.journal_indexed);
    # otherwise it waits for the lock.
    token = _lock(r, wait, until=cluster.journal_indexed)
    if token is None:
        return 0
    try:
        return _fold(r, token)
    finally:
        _unlock(r, token)


def _lock(r: Any, wait: float, until: Callable[[Any], bool] | None = None) -> str | None:
    """Take the indexer's lock (waiting up to `wait` seconds, or until `until(r)`): its token, or None."""
    token = uuid.uuid4().hex
    deadline = time.monotonic() + wait
    while not r.set(keys.HIST_LOCK, token, nx=True, px=LOCK_MS):
        if time.monotonic() > deadline or (until is not None and until(r)):
            return None
        time.sleep(0.002)
    return token


def _unlock(r: Any, token: str) -> None:
    if r.get(keys.HIST_LOCK) == token:
        r.delete(keys.HIST_LOCK)


def _fold(r: Any, token: str) -> int:
    """Fold the journal into the indexes, holding the lock."""
    done = 0
    while True:
        n = cluster.fold_batch(r, lambda: _fold_script(r, token), lambda: _drain_batch(r))
        if n <= 0:  # done, or the lock lapsed (a batch stalled past LOCK_MS): the next indexer goes on
            return done
        done += n
        if r.get(keys.HIST_LOCK) != token:
            return done
        r.pexpire(keys.HIST_LOCK, LOCK_MS)


def _fold_script(r: Any, token: str) -> int:
    """A single Redis: fold a batch in one script (lua/fold.lua); entries it took, or -1 when the lock was not ours."""
    # Atomic: no round trips per record, and nothing written once the lock is no longer ours.
    return int(r.register_script(lua("fold"))(
        keys=[keys.HIST_JOURNAL, keys.HIST_LOCK, keys.HIST_SEQ, keys.HISTORY],
        args=[token, FOLD_BATCH, SEG, keys.HIST_PREFIX, keys.PREFIX]))


def _drain_batch(r: Any) -> int:
    """Redis Cluster: fold up to DRAIN_BATCH journal entries from here (the records live in other slots)."""
    rids = r.lrange(keys.HIST_JOURNAL, 0, DRAIN_BATCH - 1)
    if not rids:
        return 0
    uniq = [rid for rid in dict.fromkeys(rids) if keys.RECORD_ID_RE.match(rid)]
    pipe = r.pipeline(transaction=False)
    for rid in uniq:
        pipe.hmget(keys.record(rid), "seq", "hx", "status", "outcome")
        pipe.pttl(keys.record(rid))
    got = pipe.execute()
    rows, rttl = got[::2], dict(zip(uniq, (int(t) for t in got[1::2])))
    new = [rid for rid, row in zip(uniq, rows) if row[2] is not None and row[0] is None]
    info: dict[str, tuple[str, str]] = {}
    if new:
        pipe = r.pipeline(transaction=False)
        for rid in new:
            pipe.hmget(keys.record(rid), "playbook", "alert")
        for rid, (pb, alert) in zip(new, pipe.execute()):
            alertname = str((json.loads(alert) if alert else {}).get("alertname") or "")
            info[rid] = (pb or "", alertname)
        top = int(r.incrby(keys.HIST_SEQ, len(new)))
        seqs = dict(zip(new, range(top - len(new) + 1, top + 1)))
    pipe = r.pipeline(transaction=False)
    segments: dict[int, set[str]] = {}
    targets: dict[str, dict[str, int]] = {}
    ttls: dict[str, int] = {}
    history: dict[str, int] = {}
    for rid, (seq, old, status, outcome) in zip(uniq, rows):
        if status is None:
            continue  # gone meanwhile: retention clears what it left
        state = _mutable({"status": status, "outcome": outcome})
        rkey = keys.record(rid)
        if seq is None:
            s = seqs[rid]
            pb, alertname = info[rid]
            bits = _bits(s, state, pb, alertname)
            for k in bits:
                pipe.setbit(k, s & (SEG - 1), 1)
            segments.setdefault(s >> SEG_BITS, set()).update(bits)
            pipe.hset(rkey, mapping={"seq": s, "hx": state})
        else:
            s = int(seq)
        # Listed (again: idempotent, it heals a listing lost to a crash). A record that left the history has
        # left Redis too (retention deletes it, or it expired), so it is never listed again.
        history[rid] = s
        tkey = keys.target_history(keys.target_of_record(rid))
        targets.setdefault(tkey, {})[rid] = s
        ttls[tkey] = max(ttls.get(tkey, 0), rttl[rid])
        if seq is not None:
            if old == state:
                continue
            if old:
                for k in _bits(s, old, None, None):
                    pipe.setbit(k, s & (SEG - 1), 0)
            bits = _bits(s, state, None, None)
            for k in bits:
                pipe.setbit(k, s & (SEG - 1), 1)
            segments.setdefault(s >> SEG_BITS, set()).update(bits)
            pipe.hset(rkey, "hx", state)
    if history:
        pipe.zadd(keys.HISTORY, history)
    for tkey, members in targets.items():
        pipe.zadd(tkey, members)
    for seg, names in segments.items():
        pipe.sadd(keys.hist_segment_keys(seg), *names)
    pipe.ltrim(keys.HIST_JOURNAL, len(rids), -1)
    pipe.execute()
    # A target's list lives as long as its newest record (the sweep removes entries of older ones), never
    # shortened; PTTL first rather than PEXPIRE's NX and GT, which Redis 6.2 lacks.
    long = {t: ttl for t, ttl in ttls.items() if ttl > 0}
    pipe = r.pipeline(transaction=False)
    for tkey in long:
        pipe.pttl(tkey)
    grow = [t for t, cur in zip(long, pipe.execute()) if int(cur) < long[t]]
    pipe = r.pipeline(transaction=False)
    for tkey in grow:
        pipe.pexpire(tkey, long[tkey])
    pipe.execute()
    return len(rids)


# -- retention ----------------------------------------------------------------------------------------------

def trim(r: Any, keep: int, cap: int = 10_000) -> int:
    """Delete the oldest records beyond `keep` (up to `cap` a call) and drop them from every index; drop from
    the indexes the oldest records that expired by age. Returns how many records left the history.
    It holds the indexer's lock meanwhile (after folding the journal), so no fold lists again a record it
    deletes; when another indexer keeps the lock for seconds, it leaves retention to the next tick."""
    token = _lock(r, 5.0)
    if token is None:
        return 0
    try:
        _fold(r, token)
        return _trim(r, keep, cap)
    finally:
        _unlock(r, token)


def _trim(r: Any, keep: int, cap: int) -> int:
    excess = max(0, min(int(r.zcard(keys.HISTORY)) - keep, cap))
    rows = r.zrange(keys.HISTORY, 0, max(excess, SWEEP_PROBE) - 1, withscores=True)
    if not rows:
        return 0
    # The usual idle tick: nothing past the cap and every probed record still there. One EXISTS over them
    # all (split per slot on a cluster) instead of reading each one.
    if not excess and r.exists(*[keys.record(rid) for rid, _ in rows]) == len(rows):
        return 0
    pipe = r.pipeline(transaction=False)
    for rid, _ in rows:
        pipe.hmget(keys.record(rid), "hx", "playbook", "alert")
    got = pipe.execute()
    pipe = r.pipeline(transaction=False)
    seg_keys: dict[int, list[str]] = {}
    gone = []
    for i, ((rid, score), (state, pb, alert)) in enumerate(zip(rows, got)):
        if i >= excess and state is not None:
            continue  # within retention
        seq = int(score)
        if state is not None:
            alertname = str((json.loads(alert) if alert else {}).get("alertname") or "")
            bits = _bits(seq, state, pb or "", alertname)
            pipe.delete(keys.record(rid))
        else:  # expired by age: which bits it had is gone with it, so clear its bit in every bitmap of its segment
            seg = seq >> SEG_BITS
            if seg not in seg_keys:
                seg_keys[seg] = list(r.smembers(keys.hist_segment_keys(seg)))
            bits = seg_keys[seg]
        for k in bits:
            pipe.setbit(k, seq & (SEG - 1), 0)
        pipe.zrem(keys.target_history(keys.target_of_record(rid)), rid)
        gone.append(rid)
    if gone:
        pipe.zrem(keys.HISTORY, *gone)
    pipe.execute()
    _drop_segments(r)
    return len(gone)


def _drop_segments(r: Any) -> None:
    """Delete whole segments older than the oldest record still listed."""
    first = r.zrange(keys.HISTORY, 0, 0, withscores=True)
    low = (int(first[0][1]) >> SEG_BITS) if first else (int(r.get(keys.HIST_SEQ) or 0) >> SEG_BITS)
    for seg in range(low - 1, -1, -1):
        skey = keys.hist_segment_keys(seg)
        names = list(r.smembers(skey))
        if not names:
            break  # dropped before (segments go oldest first)
        r.delete(*names, skey)


# -- querying -------------------------------------------------------------------------------------------------

def _zset_desc(r: Any, key: str, hi: int | None, batch: int) -> Iterator[tuple[int, str]]:
    cur = f"({hi}" if hi is not None else "+inf"
    while True:
        rows = r.zrevrangebyscore(key, cur, "-inf", start=0, num=batch, withscores=True)
        for rid, s in rows:
            yield int(s), rid
        if len(rows) < batch:
            return
        cur = f"({int(rows[-1][1])}"


def _bitmap_desc(r: Any, names: list[tuple[str, str]], hi: int | None) -> Iterator[tuple[int, str | None]]:
    """Sequence numbers whose bits are set in every named bitmap, newest first (their ids looked up later)."""
    top = (hi - 1) if hi is not None else int(r.get(keys.HIST_SEQ) or 0)
    if top < 0:
        return
    first = r.zrange(keys.HISTORY, 0, 0, withscores=True)
    low = (int(first[0][1]) >> SEG_BITS) if first else 0
    for seg in range(top >> SEG_BITS, low - 1, -1):
        pipe = r.pipeline(transaction=False)
        for field, value in names:
            pipe.execute_command("GET", keys.hist_bitmap(seg, field, value), NEVER_DECODE=True)
        raws = pipe.execute()
        if any(not b for b in raws):
            continue
        width = min(len(b) for b in raws) * 8
        x = -1
        for b in raws:
            x &= int.from_bytes(b[:width // 8], "big")
        # Offsets below `limit` only (offset o is bit width-1-o of the integer).
        limit = min(width, (top & (SEG - 1)) + 1) if seg == top >> SEG_BITS else width
        x >>= width - limit
        base = seg << SEG_BITS
        while x:
            low_bit = x & -x
            yield base + limit - low_bit.bit_length(), None
            x ^= low_bit


def _targets(label: str) -> list[keys.Target]:
    out = []
    t = keys.parse_label(label)
    if t is not None:
        out.append(t)
    if keys.TARGET_NAME_RE.match(label):
        out += [keys.Target(kind, label) for kind in keys.TARGET_KINDS]
    return list(dict.fromkeys(out))


def _cursor_seq(r: Any, before: str) -> int | None:
    s = r.zscore(keys.HISTORY, before)
    if s is None:
        try:
            s = r.hget(keys.record(before), "seq")
        except ValueError:
            return None
    return None if s is None else int(s)


def page(r: Any, q: Query) -> tuple[list[dict], str | None]:
    """Records newest first that pass the query, and the cursor of the next page (or None)."""
    catch_up(r)
    hi = None
    if q.before:
        hi = _cursor_seq(r, q.before)
        if hi is None:
            return [], None  # the cursor's record left the history: so did every older one
    want = q.limit + 1
    batch = min(max(want, 64), 1000)
    cands: Iterator[tuple[int, str | None]]
    if q.target:
        gens = [_zset_desc(r, keys.target_history(t), hi, batch) for t in _targets(q.target)]
        cands = heapq.merge(*gens, key=lambda x: -x[0])
    elif q.bitmaps():
        cands = _bitmap_desc(r, q.bitmaps(), hi)
    else:
        cands = _zset_desc(r, keys.HISTORY, hi, batch)
    items: list[dict] = []
    while len(items) < want:
        chunk = list(itertools.islice(cands, max(want - len(items), 16)))
        if not chunk:
            break
        if chunk[0][1] is None:  # sequence numbers from bitmaps: look their ids up
            pipe = r.pipeline(transaction=False)
            for seq, _ in chunk:
                pipe.zrangebyscore(keys.HISTORY, seq, seq)
            chunk = [(seq, ids[0]) for (seq, _), ids in zip(chunk, pipe.execute()) if ids]
        pipe = r.pipeline(transaction=False)
        for _, rid in chunk:
            pipe.hgetall(keys.record(str(rid)))
        gone = []
        for (_, rid), h in zip(chunk, pipe.execute()):
            if not h:
                gone.append(str(rid))  # expired by age: drop it from the listings (the sweep clears its bits)
                continue
            rec = StoredRecord.from_hash(str(rid), h).as_dict()
            if q.accepts(rec):
                items.append(rec)
                if len(items) == want:
                    break
        if gone:
            pipe = r.pipeline(transaction=False)
            pipe.zrem(keys.HISTORY, *gone)
            for rid in gone:
                pipe.zrem(keys.target_history(keys.target_of_record(rid)), rid)
            pipe.execute()
    if len(items) > q.limit:
        return items[:q.limit], items[q.limit - 1]["id"]
    return items, None


# -- an id from its prefix ------------------------------------------------------------------------------------

# People may name a record by the start of its id (`trainmedic show 1K17DFQZ`), at least this many characters.
MIN_PREFIX = 8
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_HEAD = 26  # characters of the time-sortable part of an id: 130 bits, the microseconds in the top 55
_RANDOM_BITS = 75
# The history lists records by sequence number, which follows their ids' time only roughly: ids are made a
# moment before their records, by clocks assumed to agree within a few seconds, and on Redis Cluster a
# target's journal can be folded a tick late. A prefix's records are looked for this much either side.
PREFIX_SLACK_US = 30_000_000
_PROBES = 16  # ranks read per round trip while narrowing the search (a million records: 5 round trips)
_SCAN_BATCH = 5000


def _head_value(head: str) -> int:
    n = 0
    for c in head:
        n = n * 32 + _CROCKFORD.index(c)
    return n


def _head_of(us: int) -> str:
    """The smallest id head made at microsecond `us`."""
    n = min(max(us, 0) << _RANDOM_BITS, (1 << 5 * _HEAD) - 1)
    return "".join(_CROCKFORD[(n >> 5 * i) & 31] for i in range(_HEAD - 1, -1, -1))


def resolve_record_id(r: Any, text: str) -> str:
    """The full id of the one record whose id is or starts with `text`; NotFound if none, BadRequest if several."""
    # A prefix of 8 or more characters fixes when its record was made to within 33 ms, so the history's ranks
    # are narrowed to that time (a few round trips, however many records are kept) and only records made around
    # it are read. A text shaped like a whole id may still be the start of a longer one ("~job~llama" of
    # "~job~llama-2"), so it is looked up as a prefix when no record has it as its id.
    if keys.RECORD_ID_RE.match(text) and r.exists(keys.record(text)):
        return text
    head, sep, tail = text.partition("~")
    head = head.upper()  # the ids' alphabet is Crockford's base32, which people may type in either case
    if len(text) < MIN_PREFIX:
        raise NotFound(f"no remediation with id {text!r}: give its full id or at least {MIN_PREFIX} characters "
                       "of it")
    if len(head) > _HEAD or (sep and len(head) != _HEAD) or any(c not in _CROCKFORD for c in head):
        raise NotFound(f"no remediation with id {text!r}")
    prefix = head + sep + tail
    lo = _head_of((_head_value(head.ljust(_HEAD, "0")) >> _RANDOM_BITS) - PREFIX_SLACK_US)
    hi = _head_of((_head_value(head.ljust(_HEAD, "Z")) >> _RANDOM_BITS) + PREFIX_SLACK_US + 1)
    catch_up(r)
    found = [rid for rid in _ids_between(r, lo, hi) if rid.startswith(prefix)]
    if found:
        pipe = r.pipeline(transaction=False)
        for rid in found:
            pipe.exists(keys.record(rid))
        found = [rid for rid, there in zip(found, pipe.execute()) if there]
    if not found:
        raise NotFound(f"no remediation with id {text!r}")
    if len(found) > 1:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise BadRequest(f"{text!r} is the start of {len(found)} remediation ids ({shown}): give more of it")
    return found[0]


def _ids_between(r: Any, lo: str, hi: str) -> Iterator[str]:
    """Listed record ids from about the first whose head is `lo` or more, until one's is `hi` or more."""
    # The ranks are narrowed as in a binary search, 16 a round trip. Ids out of time order by less than half
    # of PREFIX_SLACK_US cannot make it start after, or stop before, a record made within the prefix's time.
    below, above = -1, int(r.zcard(keys.HISTORY))  # every rank <= below has a head < lo; `above` has not
    while above - below > 1:
        probes = sorted({below + 1 + (above - below - 1) * k // _PROBES for k in range(_PROBES)})
        pipe = r.pipeline(transaction=False)
        for rank in probes:
            pipe.zrange(keys.HISTORY, rank, rank)
        for rank, got in zip(probes, pipe.execute()):
            if got and str(got[0])[:_HEAD] < lo:
                below = rank
            else:  # at or past lo (or trimmed meanwhile: the scan starts early, which only costs a read)
                above = rank
                break
    start = above
    while True:
        batch = [str(x) for x in r.zrange(keys.HISTORY, start, start + _SCAN_BATCH - 1)]
        for rid in batch:
            if rid[:_HEAD] >= hi:
                return
            yield rid
        if len(batch) < _SCAN_BATCH:
            return
        start += _SCAN_BATCH
