"""The history: remediation records newest first, with filters and a cursor, answered from indexes.

The index (README "HTTP API", GET /history: full pages, every record within retention listed and filterable):

- Every record gets a sequence number when it is first indexed (HIST_SEQ, INCRBY); `keys.HISTORY` holds record
  ids scored by it.
- Per segment of 2^16 sequence numbers, a bitmap per (field, value) says which records have it: status,
  outcome, and facet (a playbook and an alert name together, digested; keys.HIST_FACETS names each facet).
- Per target, `{tag}:hist` holds the target's record ids by sequence number (the `target=` filter).
- The scripts that make a record or change its status or outcome journal it (lua/common.lua): a new record
  with its playbook and alert name, a change as the status or outcome before and after. The service's own
  scripts journal into the global journal on a single Redis; an applier's scripts, and every script on Redis
  Cluster, into the target's own, which the service takes (service/fold.py) for the targets it learns changed
  (keys.HIST_DIRTY) and for every target the reconciler visits. `catch_up` (one indexer at a time, under a
  lock) takes the dirty targets' journals, then folds the global one into the index: a new record's status and
  outcome as the record holds them then, a change as its bits moved. A change of a record not yet indexed is
  dropped: the record's own entry, folded after it, reads where it stands. Every query catches up before it
  answers, and so does every reconciler tick, so a query sees every change made before it; the webhook itself
  never waits for the indexer.
- Concurrency: the lock (LOCK_MS) is renewed between batches. On a single Redis each batch of FOLD_BATCH
  entries is one script (client/wire/lua/fold.lua) that writes only while the lock holds the indexer's token,
  so an indexer whose lock lapsed writes nothing (the next one does it). On Redis Cluster (no transaction
  across slots) the same fold runs here in Python (`_fold_entries`), the lock checked between batches.
- A query walks candidates newest first (the history, a target's set, or the AND of bitmaps segment by
  segment), reads their records and checks each against the query (a stale bit can only add a candidate,
  never hide one), until the page has `limit` records and one more says there is a next page.
- Retention (`trim`, called by the reconciler) deletes the oldest records beyond the count or the age (a
  record's age is in its id), drops them from the history and their target's list, and drops whole segments
  older than the oldest record left.
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
from ..client.wire.redis import run_scripts
from ..client.wire.scripts import script
from ..client.wire.status import Outcome, RecordStatus

from . import fold as target_fold, repairs
from .errors import BadRequest, NotFound
from .store.record import BadRecord, StoredRecord, created_us

# The filters' choices.
STATUSES = tuple(RecordStatus)
OUTCOMES = tuple(Outcome)
FILTERS = ("alertname", "playbook", "target", "status", "outcome")
MAX_LIMIT = 500
SEG_BITS = 16
SEG = 1 << SEG_BITS
DRAIN_BATCH = 1000
# Journal entries one FOLD script takes on a single Redis (it holds Redis for a few ms).
FOLD_BATCH = 200
LOCK_MS = 10_000
# Records kept at most this long (README: Retention).
MAX_AGE = 30 * 86400.0
# Dirty targets whose journals one catch-up takes at most (the rest at the next).
DIRTY_BATCH = 1000


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

    def accepts(self, rec: StoredRecord) -> bool:
        t = rec.target
        return ((self.status is None or rec.status == self.status)
                and (self.playbook is None or rec.playbook == self.playbook)
                and (self.alertname is None or rec.alert.alertname == self.alertname)
                and (self.outcome is None or (rec.outcome is not None and rec.outcome.status == self.outcome))
                and (self.target is None or self.target in (t.name, t.label)))

    def bitmaps(self, facets: dict[str, tuple[str, str]]) -> list[list[tuple[str, str]]]:
        """The bitmaps this query ANDs, each an OR of one or more (target= has its own index): its status, its
        outcome, and the facets of its playbook or alert name (with the bitmaps an earlier version kept of each)."""
        out = []
        if self.status:
            out.append([("s", self.status)])
        if self.outcome:
            out.append([("o", self.outcome)])
        if self.playbook or self.alertname:
            chosen = [("f", f) for f, (pb, an) in facets.items()
                      if (self.playbook is None or pb == self.playbook)
                      and (self.alertname is None or an == self.alertname)]
            if self.playbook:
                out.append([*chosen, ("p", digest(self.playbook))])
            if self.alertname:
                out.append([*chosen, ("a", digest(self.alertname))])
        return out


def digest(value: str) -> str:
    """The name a value gets in the index's keys: the first 16 hex digits of its SHA-1 (lua/fold.lua does the
    same with redis.sha1hex); a name, not a secret."""
    return hashlib.sha1(value.encode()).hexdigest()[:16]


def facets(r: Any) -> dict[str, tuple[str, str]]:
    """Every facet seen: its digest -> (playbook, alert name)."""
    out = {}
    for f, text in r.hgetall(keys.HIST_FACETS).items():
        pb, _, an = str(text).partition("\n")
        out[str(f)] = (pb, an)
    return out


# -- indexing ---------------------------------------------------------------------------------------------

def catch_up(r: Any, wait: float = 1.0) -> int:
    """Index what the journals hold (records made, statuses and outcomes changed); how many entries it took.
    One indexer at a time: a caller that finds another one at work waits for it (up to `wait` seconds), so
    that what was journaled before the call is indexed when it returns."""
    if not (r.llen(keys.HIST_JOURNAL) or r.scard(keys.HIST_DIRTY)):
        return 0
    token = _lock(r, wait)
    if token is None:
        return 0
    try:
        _take_dirty(r)
        return _fold(r, token)
    finally:
        _unlock(r, token)


def _take_dirty(r: Any) -> None:
    """Take the journals (and counts) of the targets named dirty into the shared keys (service/fold.py)."""
    while True:
        labels = [str(x) for x in (r.spop(keys.HIST_DIRTY, DIRTY_BATCH) or [])]
        if not labels:
            return
        targets = [t for t in map(keys.parse_label, labels) if t is not None]
        if len(targets) < len(labels):
            repairs.note(r, "a name among the targets to fold in was not a target's")
        target_fold.fold(r, targets)
        if len(labels) < DIRTY_BATCH:
            return


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
    single = cluster.scripts_reach_all(r)
    while True:
        n = _fold_script(r, token) if single else _fold_entries(r)
        if n <= 0:  # done, or the lock lapsed (a batch stalled past LOCK_MS): the next indexer goes on
            return done
        done += n
        if r.get(keys.HIST_LOCK) != token:
            return done
        r.pexpire(keys.HIST_LOCK, LOCK_MS)


def _fold_script(r: Any, token: str) -> int:
    """A single Redis: fold a batch in one script (lua/fold.lua); entries it took, or -1 when the lock was not ours."""
    # Atomic: no round trips per record, and nothing written once the lock is no longer ours.
    return int(run_scripts(r, [(script("fold"), [keys.HIST_JOURNAL, keys.HIST_LOCK, keys.HIST_SEQ, keys.HISTORY,
                                                 keys.HIST_FACETS],
                                [token, FOLD_BATCH, SEG, keys.HIST_PREFIX, keys.PREFIX])])[0])


def _entry(entry: str) -> tuple[str, str, list[str]]:
    """(what, record id, the rest) of a journal entry (a bare id, as an earlier version wrote, names a record)."""
    what, bar, rest = entry.partition("|")
    if not bar or len(what) != 1:
        return "h", entry, []
    if what == "n":
        rid, _, facts = rest.partition("|")
        return what, rid, facts.split("|", 1)
    rid, *more = rest.split("|")
    return what, rid, more


def _fold_entries(r: Any) -> int:
    """Redis Cluster: fold up to DRAIN_BATCH journal entries from here (the records live in other slots), as
    lua/fold.lua does on a single Redis."""
    entries = [str(e) for e in r.lrange(keys.HIST_JOURNAL, 0, DRAIN_BATCH - 1)]
    if not entries:
        return 0
    parsed = [(what, rid, more) for what, rid, more in map(_entry, entries) if keys.RECORD_ID_RE.match(rid)]
    rids = list(dict.fromkeys(rid for _, rid, _ in parsed))
    seqs = dict(zip(rids, r.zmscore(keys.HISTORY, rids))) if rids else {}
    # Records to index: every new one, and those an entry only names that are not listed yet.
    new = list(dict.fromkeys(rid for what, rid, _ in parsed if what == "n" or (what == "h" and seqs.get(rid) is None)))
    pipe = r.pipeline(transaction=False)
    for rid in new:
        pipe.hmget(keys.record(rid), "status", "outcome", "d", "playbook", "alert")
    rows = dict(zip(new, pipe.execute())) if new else {}
    top = int(r.incrby(keys.HIST_SEQ, len(new))) if new else 0
    next_seq = top - len(new) + 1
    names = {what_rid[1]: what_rid[2] for what_rid in parsed if what_rid[0] == "n" and len(what_rid[2]) == 2}
    pipe = r.pipeline(transaction=False)
    segments: dict[int, set[str]] = {}
    history: dict[str, int] = {}
    targets: dict[str, dict[str, int]] = {}
    facet_names: dict[str, str] = {}

    def bit(seq: int, field: str, value: str, on: int) -> None:
        k = keys.hist_bitmap(seq >> SEG_BITS, field, value)
        pipe.setbit(k, seq & (SEG - 1), on)
        if on:
            segments.setdefault(seq >> SEG_BITS, set()).add(k)

    for what, rid, more in parsed:
        if rid in rows:
            status, outcome, d, pb, alert = rows.pop(rid)
            if status is None:
                continue  # gone meanwhile
            playbook, alertname = names.get(rid) or _facts(d, pb, alert)
            seq = next_seq
            next_seq += 1
            seqs[rid] = seq
            bit(seq, "s", status, 1)
            o = _outcome_of(outcome)
            if o:
                bit(seq, "o", o, 1)
            f = digest(f"{playbook}\n{alertname}")
            facet_names[f] = f"{playbook}\n{alertname}"
            bit(seq, "f", f, 1)
            history[rid] = seq
            targets.setdefault(keys.target_history(keys.target_of_record(rid)), {})[rid] = seq
        elif what in ("c", "o") and seqs.get(rid) is not None and len(more) == 2:
            seq, field = int(seqs[rid] or 0), "s" if what == "c" else "o"
            old, value = more
            if old != value and old != "-":
                bit(seq, field, old, 0)
            bit(seq, field, value, 1)
    if history:
        pipe.zadd(keys.HISTORY, history)
    for tkey, members in targets.items():
        pipe.zadd(tkey, members)
    for seg, bitmaps in segments.items():
        pipe.sadd(keys.hist_segment_keys(seg), *bitmaps)
    if facet_names:
        pipe.hset(keys.HIST_FACETS, mapping=facet_names)
    pipe.ltrim(keys.HIST_JOURNAL, len(entries), -1)
    pipe.execute()
    return len(entries)


def _outcome_of(text: str | None) -> str | None:
    try:
        o = json.loads(text) if text else None
    except ValueError:
        return None
    status = o.get("status") if isinstance(o, dict) else None
    return status if isinstance(status, str) and status else None


def _facts(d: str | None, playbook: str | None, alert: str | None) -> tuple[str, str]:
    """(playbook, alert name) of a record from its `d` (or an earlier version's fields)."""
    try:
        got = json.loads(d) if d else {"p": playbook, "a": json.loads(alert) if alert else {}}
        a = got.get("a") or {}
        return str(got.get("p") or ""), str(a.get("alertname") or "") if isinstance(a, dict) else ""
    except (ValueError, AttributeError):
        return str(playbook or ""), ""


# -- retention ----------------------------------------------------------------------------------------------

def trim(r: Any, keep: int, cap: int = 10_000, now: float | None = None, max_age: float = MAX_AGE) -> int:
    """Delete the oldest records beyond `keep` or older than `max_age` (up to `cap` a call) and drop them from
    every index. Returns how many records left the history. It holds the indexer's lock meanwhile (after
    folding the journal), so no fold lists again a record it deletes; when another indexer keeps the lock for
    seconds, it leaves retention to the next tick."""
    token = _lock(r, 5.0)
    if token is None:
        return 0
    try:
        _take_dirty(r)
        _fold(r, token)
        return _trim(r, keep, cap, time.time() if now is None else now, max_age)
    finally:
        _unlock(r, token)


def _trim(r: Any, keep: int, cap: int, now: float, max_age: float) -> int:
    excess = max(0, min(int(r.zcard(keys.HISTORY)) - keep, cap))
    oldest_us = int((now - max_age) * 1_000_000)
    first = r.zrange(keys.HISTORY, 0, 0)
    if not excess and (not first or _made_us(str(first[0])) >= oldest_us):
        return 0  # the usual tick: nothing past the count, and the oldest record within the age
    rows = r.zrange(keys.HISTORY, 0, max(excess, 1000) - 1)
    gone = [str(rid) for i, rid in enumerate(rows) if i < excess or _made_us(str(rid)) < oldest_us]
    gone = gone[:cap]
    if not gone:
        return 0
    pipe = r.pipeline(transaction=False)
    for rid in gone:
        if keys.RECORD_ID_RE.match(rid):
            pipe.delete(keys.record(rid))
            pipe.zrem(keys.target_history(keys.target_of_record(rid)), rid)
    pipe.zrem(keys.HISTORY, *gone)
    pipe.execute()
    _drop_segments(r)
    return len(gone)


def _made_us(rid: str) -> int:
    """When a record was made (µs), from its id; 0 for what is not an id (it goes first)."""
    try:
        return created_us(rid) if keys.RECORD_ID_RE.match(rid) else 0
    except KeyError:
        return 0


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


def _bitmap_desc(r: Any, groups: list[list[tuple[str, str]]], hi: int | None) -> Iterator[tuple[int, str | None]]:
    """Sequence numbers whose bit is set in some bitmap of every group, newest first (their ids looked up later)."""
    top = (hi - 1) if hi is not None else int(r.get(keys.HIST_SEQ) or 0)
    if top < 0:
        return
    first = r.zrange(keys.HISTORY, 0, 0, withscores=True)
    low = (int(first[0][1]) >> SEG_BITS) if first else 0
    for seg in range(top >> SEG_BITS, low - 1, -1):
        pipe = r.pipeline(transaction=False)
        for group in groups:
            for field, value in group:
                pipe.execute_command("GET", keys.hist_bitmap(seg, field, value), NEVER_DECODE=True)
        raws = iter(pipe.execute())
        found = [[b for b in (next(raws) for _ in group) if isinstance(b, bytes) and b] for group in groups]
        if not all(found):
            continue
        size = max(len(b) for group in found for b in group)
        width = size * 8
        x = -1
        for bitmaps in found:
            any_of = 0
            for b in bitmaps:  # a bitmap is as long as its highest bit set: offsets line up from the left
                any_of |= int.from_bytes(b.ljust(size, b"\0"), "big")
            x &= any_of
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
    elif q.status or q.outcome or q.playbook or q.alertname:
        cands = _bitmap_desc(r, q.bitmaps(facets(r) if q.playbook or q.alertname else {}), hi)
    else:
        cands = _zset_desc(r, keys.HISTORY, hi, batch)
    items: list[StoredRecord] = []
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
                gone.append(str(rid))  # deleted (retention ran meanwhile): drop it from the listings
                continue
            try:
                rec = StoredRecord.from_hash(str(rid), h)
            except BadRecord as exc:
                repairs.note(r, f"record {rid} does not read as one ({exc}); the history leaves it out")
                continue
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
    shown = [rec.as_dict() for rec in items[:q.limit]]
    if len(items) > q.limit:
        return shown, items[q.limit - 1].id
    return shown, None


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
