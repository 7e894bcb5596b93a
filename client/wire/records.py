"""The remediation record in one place: its statuses, its shape, reading it, and the scripts that write it.

A record is one Redis hash in its target's hash slot. Every writer goes through a Lua script of
`lua/` (each names its KEYS and ARGV at the top), called through the typed wrappers below; a reader parses
the hash once into a `StoredRecord` (its `view()` is the contract's record, a `RecordView`). The OpenAPI
schema, `SCHEMA`, is derived from the view's types.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import StrEnum
from functools import cache, cached_property
from hashlib import sha1
from importlib import resources
from typing import Any, Literal
from collections.abc import Callable, Iterable, Mapping

from . import keys
from .cluster import is_cluster
from .protocol import Ack, compact_json, dumps, fence, rfc3339
from .redis import GuardedScript
from .views import TIME, View, schema_of, view


# Statuses, outcomes and reasons are StrEnums: a member equals its string, so what Redis and JSON hold is the
# plain value, and code compares with members instead of string literals. The Lua scripts write the same values.

class RecordStatus(StrEnum):
    """A record's status (README: HTTP API, a record)."""

    PENDING_APPROVAL = "pending_approval"
    DISPATCHED = "dispatched"
    APPLIED = "applied"
    PARTIALLY_APPLIED = "partially_applied"
    FAILED = "failed"
    LOST = "lost"
    SKIPPED = "skipped"
    DRY_RUN = "dry_run"
    EXPIRED = "expired"

    @property
    def final(self) -> bool:
        """Whether a record in this status changes no more (its outcome still may)."""
        return self not in (RecordStatus.PENDING_APPROVAL, RecordStatus.DISPATCHED)


class ActionStatus(StrEnum):
    """An action's status within its record: open (pending, delivered), an ack's status, or lost."""

    PENDING = "pending"
    DELIVERED = "delivered"
    APPLIED = "applied"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"
    EXPIRED = "expired"
    SKIPPED = "skipped"
    LOST = "lost"

    @property
    def open(self) -> bool:
        """Whether the action still waits for its applier."""
        return self in (ActionStatus.PENDING, ActionStatus.DELIVERED)


class Outcome(StrEnum):
    """Whether a record's remediation worked: decided when its alert resolves or its verify time passes."""

    PENDING = "pending"
    EFFECTIVE = "effective"
    INEFFECTIVE = "ineffective"
    UNKNOWN = "unknown"


class Reason(StrEnum):
    """Why a record was skipped or expired, or what it says while dispatched (no_live_target)."""

    COOLDOWN = "cooldown"
    BUDGET_EXHAUSTED = "budget_exhausted"
    NO_ACTIONS = "no_actions"
    NO_TARGET = "no_target"
    BAD_LABEL = "bad_label"
    REJECTED = "rejected"
    TAMPERED = "tampered"
    BREAKER_OPEN = "breaker_open"
    NO_LIVE_TARGET = "no_live_target"
    APPROVAL_EXPIRED = "approval_expired"
    RESOLVED_BEFORE_APPROVAL = "resolved_before_approval"
    RESOLVED_NOT_NOTIFIED = "resolved_not_notified"


class ActionReason(StrEnum):
    """Why an action ended as it did, where the service or a script decided it (an applier may give its own,
    such as no_cuda)."""

    UNSUPPORTED = "unsupported"
    TARGET_CANNOT = "target_cannot"
    CONDITION_FALSE = "condition_false"
    CONDITION_UNKNOWN = "condition_unknown"
    EXPIRED = "expired"
    LOST = "lost"
    TAMPERED = "tampered"
    REJECTED = "rejected"
    APPROVAL_EXPIRED = "approval_expired"
    RESOLVED_BEFORE_APPROVAL = "resolved_before_approval"


class Mode(StrEnum):
    """What a record answers: a firing alert, a resolve (on_resolved; timeout when none came), a person, or a
    stage of an escalation ladder."""

    FIRING = "firing"
    RESOLVED = "resolved"
    TIMEOUT = "timeout"
    MANUAL = "manual"
    STAGE = "stage"


class Requester(StrEnum):
    """Who asked for a record (a person acting with their own token is operator:NAME)."""

    WEBHOOK = "webhook"
    OPERATOR = "operator"
    RECONCILER = "reconciler"
    DETECTOR = "detector"
    RESYNC = "resync"


def values(enum: type[StrEnum]) -> list[str]:
    """An enum's values, in order (the OpenAPI schema's enums)."""
    return [m.value for m in enum]


# Annotations are free text of any size: a record keeps up to this much of them (labels are kept whole).
ANNOTATION_VALUE_MAX = 1024
ANNOTATIONS_MAX = 4096
# Upper bounds (seconds) of the dispatch-to-ack latency histogram kept in each target's ack stats hash.
ACK_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
STATS_TTL_MS = 30 * 86400 * 1000
LEDGER_MAX = 200
REAPPLIED_MAX = 20


# -- the scripts ----------------------------------------------------------------------------------------

@cache
def lua(name: str) -> str:
    """The text of lua/NAME.lua, with the shared functions of lua/common.lua before it."""
    folder = resources.files(__package__).joinpath("lua")
    body = folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    if name == "decide_many":
        # DECIDE_MANY runs DECIDE's body once per pair: as a function of its own KEYS and ARGV (and the
        # writes the pairs share, its `...`).
        decide = folder.joinpath("decide.lua").read_text(encoding="utf-8")
        body = f"local function decide_one(KEYS, ARGV, ...)\n{decide}\nend\n{body}"
    return folder.joinpath("common.lua").read_text(encoding="utf-8") + "\n" + body


def ms(seconds: float) -> int:
    """Whole milliseconds (what the scripts count in)."""
    return int(seconds * 1000)


# The scripts that may journal a history change (lua/common.lua hist_touch: they make a record, or change its
# status or outcome).
JOURNALING = frozenset({"decide_many", "approve", "claim", "ack", "reconcile", "verdict", "deferred"})
# lua/decide.lua runs inside DECIDE_MANY (see lua()), never on its own.
SCRIPTS = ("decide_many", "approve", "claim", "ack", "reconcile", "release", "reapply", "verdict", "deferred",
           "breaker", "mark")


class Scripts:
    """The record's scripts registered on one Redis client (EVALSHA, loaded again after a restart)."""

    def __init__(self, r: Any):
        # Where the scripts keep the metrics counts (keys.metrics): per target on a cluster.
        self.cluster = is_cluster(r)
        for name in SCRIPTS:
            setattr(self, name, GuardedScript(r.register_script(lua(name)), journals=name in JOURNALING))

    decide_many: Any
    approve: Any
    claim: Any
    ack: Any
    reconcile: Any
    release: Any
    reapply: Any
    verdict: Any
    deferred: Any
    breaker: Any
    mark: Any


Call = tuple[Any, list[str], list[Any]]


def load_scripts(r: Any, only_if_missing: bool = True) -> bool:
    """Load every script into Redis (each primary of a cluster), by default only when Redis has lost them
    (a restart empties its script cache); True when it loaded them. The service does this at start and every
    reconciler tick, since trainers and agents may only run scripts, not load them."""
    texts = [lua(name) for name in SCRIPTS]
    if only_if_missing and all(r.script_exists(*[sha1(t.encode()).hexdigest() for t in texts])):
        return False
    for text in texts:
        r.script_load(text)
    return True


# -- writing --------------------------------------------------------------------------------------------

def capped_alert(alert: dict[str, Any]) -> dict[str, Any]:
    """The alert as a record keeps it: labels whole, annotations up to a few KB, `truncated` when cut."""
    notes, used, truncated = {}, 0, False
    for k, v in (alert.get("annotations") or {}).items():
        if used >= ANNOTATIONS_MAX:
            truncated = True
            break
        room = min(ANNOTATION_VALUE_MAX, ANNOTATIONS_MAX - used)
        if len(v) > room:
            v, truncated = v[:room], True
        notes[k] = v
        used += len(k) + len(v)
    return {**alert, "annotations": notes, "truncated": truncated}


# What a stored alert leaves out when it holds the usual value (shown_alert puts it back): Alertmanager's
# "not ended" time, an untruncated alert's flag, a firing alert's status, and the alertname label (the alert's
# own alertname says it).
NOT_ENDED = "0001-01-01T00:00:00Z"


def stored_alert(alert: dict[str, Any]) -> str:
    """The alert as the record's hash holds it: capped, and without the values shown_alert puts back."""
    d = capped_alert(alert)
    if d.get("ends_at") == NOT_ENDED:
        del d["ends_at"]
    if d.get("truncated") is False:
        del d["truncated"]
    if d.get("status") == "firing":
        del d["status"]
    labels = d.get("labels")
    if isinstance(labels, dict) and d.get("alertname") and labels.get("alertname") == d["alertname"]:
        d["labels"] = {k: v for k, v in labels.items() if k != "alertname"}
    return compact_json(d)


def alert_second(starts_at: str) -> str:
    """An Alertmanager startsAt ("...T01:25:24.115Z") to the second, as an episode starts: the record's `start`
    when it is left out ("" for a time in another form: then the record stores its start)."""
    return starts_at[:19] + "Z" if len(starts_at) >= 20 and starts_at.endswith("Z") else ""


def shown_alert(text: str) -> dict[str, Any]:
    """The record's alert as the contract shows it, from what stored_alert kept (or a whole one)."""
    d: dict[str, Any] = json.loads(text)
    d.setdefault("ends_at", NOT_ENDED)
    d.setdefault("truncated", False)
    d.setdefault("status", "firing")
    labels = d.get("labels")
    if isinstance(labels, dict) and d.get("alertname") and "alertname" not in labels:
        d["labels"] = {"alertname": d["alertname"], **labels}
    return d


@dataclass(frozen=True)
class Step:
    """One action of a record as written into it: what the applier is asked, and how the record shows it."""

    action: str
    params: dict[str, Any]
    optional: bool = False
    when: str | None = None

    def spec(self) -> str:
        """The step as the record keeps it (JSON); made once, since playbook steps are shared by decisions."""
        return self._spec

    @cached_property
    def _spec(self) -> str:
        d: dict[str, Any] = {"action": self.action, "params": self.params}
        if self.optional:
            d["optional"] = True
        if self.when:
            d["when"] = self.when
        return dumps(d)


def state_ttl(episode_ttl: float, cooldown: float, budget_window: float) -> float:
    """How long a playbook's state on a target (keys.playbook_state) lives after a write: as long as the
    longest of its episodes' tombstones, its cooldown and its budget's window."""
    return max(episode_ttl, cooldown, budget_window)


# Actions decided before anything is sent: (index, status, reason, message) each.
Early = tuple[tuple[int, str, str, str], ...]


def early_arg(early: Early) -> dict[str, list[str]]:
    """Early decisions as the scripts take them (a JSON object keyed by action index)."""
    return {str(i): [status, reason, message] for i, status, reason, message in early}


@dataclass(frozen=True)
class Guards:
    """What may hold a record back: the playbook's cooldown, max_runs, approval and dry run."""

    cooldown: float = 0.0
    budget: tuple[int, float] = (0, 0.0)  # max_runs: (count, window in seconds); 0 for none
    approval: bool = False
    approval_timeout: float = 3600.0
    dry_run: bool = False


@dataclass(frozen=True)
class Retention:
    """How long, and how much, of what DECIDE writes is kept (seconds)."""

    expire_after: float = 3600.0  # the command
    record_ttl: float = 30 * 86400.0
    # Refreshed by every resend, so a long episode stays one episode; a closed one is kept this long too.
    episode_ttl: float = 2 * 86400.0
    obligation_due: float = 12 * 3600.0  # an on_resolved obligation with no resolve
    mailbox_maxlen: int = 100


@dataclass(frozen=True)
class Ladder:
    """Where a record stands in its escalation ladder (or the node record a job's checkpoint belongs to)."""

    stage: int = 0
    parent: str = ""
    prev: str = ""  # the previous stage's record (mode stage)


@dataclass(frozen=True)
class Delivery:
    """What goes out now, and how the reconciler follows the record afterwards."""

    command: str = ""  # the signed command's exact bytes ("" when nothing goes out now)
    signature: str = ""
    early: Early = ()
    no_live: bool = False
    # `when:` conditions first: the reconciler evaluates them and sends the command.
    defer: bool = False
    # DECIDE reads the target's heartbeat itself (no_live, or 'reach' when the command does not fit it): the
    # command was made with every step, and `need` are their actions.
    check_reach: bool = False
    need: tuple[str, ...] = ()
    # The reconciler follows the record after it is decided (outcome, ladder, silence, notifications).
    follow: bool = False
    # A new followed record needs the reconciler now (a silence, a notification, conditions to evaluate);
    # otherwise one still dispatched or held waits for its ack, expiry or approval deadline like any other.
    visit_now: bool = True
    undo: bool = False  # the playbook has on_resolved actions: a firing record leaves an obligation
    # Set for records that answer for their alert (firing and stages): they get an outcome.
    verify: float | None = None


@dataclass(frozen=True)
class NewRecord:
    """Everything DECIDE needs to guard, record and dispatch one (alert, playbook) pair."""

    rid: str
    target: keys.Target
    playbook: str
    mode: str
    steps: tuple[Step, ...]
    alert: dict[str, Any]
    episode_start: str
    fingerprint: str
    now: float
    context: dict[str, Any]
    guards: Guards
    keep: Retention
    delivery: Delivery
    ladder: Ladder = Ladder()
    detail: str = ""
    forced_reason: str = ""
    requested_by: str = Requester.WEBHOOK
    ends_at: str = ""
    ends_ms: int = 0
    extra: tuple[tuple[str, str], ...] = ()
    # The service's seal (Signer.seal): it covers what the record decided (see seal_text).
    sealer: Callable[[bytes], str] | None = None

    @property
    def state_ttl(self) -> float:
        return state_ttl(self.keep.episode_ttl, self.guards.cooldown, self.guards.budget[1])

    @property
    def later(self) -> float:
        """When a dispatched or held record is next due, unless something needs the reconciler sooner."""
        return self.now + min(self.keep.expire_after, self.guards.approval_timeout, self.keep.obligation_due)

    def keys_block(self, cluster: bool) -> tuple[list[str], list[Any]]:
        """DECIDE's eight KEYS and its ARGV block, by position (lua/decide.lua names each)."""
        t = self.target
        now_ms = ms(self.now)
        # The record's created_at is created_ms as RFC 3339 (derived on read, like its id and target).
        fields: dict[str, Any] = {
            "created_ms": now_ms, "playbook": self.playbook, "n": len(self.steps),
            "alert": stored_alert(self.alert), **dict(self.extra),
        }
        # Left out when the record's other fields give them (start_of, derived()), when only a hold needs them
        # (the release signs its command anew), when empty; the applier's fence is derived too (fence_of). With
        # DECIDE leaving out a skip's action statuses, a cooldown skip (most of a storm's records) fits
        # jemalloc's 768-byte class instead of 1,024.
        if self.episode_start != alert_second(str(self.alert.get("starts_at") or "")):
            fields["start"] = self.episode_start
        if self.mode != Mode.FIRING:
            fields["mode"] = self.mode
        if self.requested_by != Requester.WEBHOOK:
            fields["requested_by"] = self.requested_by
        if self.guards.approval:
            # A string, so that the hash holds exactly what the seal covered.
            fields["expire_after"] = repr(float(self.keep.expire_after))
        if self.detail:
            fields["detail"] = self.detail
        if self.context:
            fields["context"] = dumps(self.context)
        if self.ladder.stage:
            fields.update(stage=self.ladder.stage, parent=self.ladder.parent)
        elif self.ladder.parent:
            # A job's checkpoint made for a node record's checkpoint_jobs: stage 0, linked to that record.
            fields["parent"] = self.ladder.parent
        for i, st in enumerate(self.steps):
            fields[f"a:{i}:spec"] = st.spec()
        if self.sealer is not None:
            fields["seal"] = self.sealer(seal_text(self.rid, fields))
        g, k, x = self.guards, self.keep, self.delivery
        block: list[Any] = [
            now_ms, rfc3339(now_ms / 1000), self.mode, self.episode_start, self.rid, self.forced_reason,
            ms(g.cooldown), g.budget[0], ms(g.budget[1]), int(g.approval), int(g.dry_run),
            int(x.undo), ms(k.record_ttl), ms(k.episode_ttl), k.mailbox_maxlen, keys.wake_channel(t),
            x.command, x.signature, now_ms + ms(k.expire_after), now_ms + ms(g.approval_timeout),
            keys.obligation_member(self.playbook, self.fingerprint), now_ms + ms(k.obligation_due),
            len(self.steps), int(x.follow), self.ends_at, self.ends_ms,
            dumps(early_arg(x.early)) if x.early else "", int(x.no_live), int(x.defer),
            int(x.check_reach), " ".join(x.need), t.label, int(x.visit_now), ms(self.later),
            repr(self.now + g.approval_timeout), "" if x.verify is None else ms(x.verify),
            self.fingerprint, ms(self.state_ttl),
        ]
        for kv in fields.items():
            block += kv
        ks = [keys.record(self.rid), keys.mailbox(t), keys.playbook_state(t, self.playbook),
              keys.obligation(t, self.playbook, self.fingerprint), keys.due_items(t)]
        # The ladder's previous record (mode stage), else the record again (DECIDE reads it only in a stage).
        ks.append(keys.record(self.ladder.prev) if self.ladder.prev else ks[0])
        ks.append(keys.metrics(t, cluster))
        ks.append(keys.heartbeat(t))
        return ks, block


# What a record's seal covers: every field that the service reads back to build the command it signs later
# (an approval's release, a deferred record's conditions, a ladder's next stage, an on_resolved), besides
# its id (which names its target) and its steps. Trainers and agents may write their own target's hashes; a
# seal that no longer matches makes the service refuse to act on what the hash now says.
SEALED = ("playbook", "mode", "n", "alert", "start", "fence", "expire_after", "context", "stage", "parent")


def seal_text(record_id: str, h: Mapping[str, Any]) -> bytes:
    """The bytes a record's seal covers, from its hash (or from the fields DECIDE is about to write)."""
    n = int(h.get("n") or 0)
    values = [record_id, *(None if h.get(k) is None else str(h[k]) for k in SEALED),
              *(h.get(f"a:{i}:spec") for i in range(n))]
    if values[2] == Mode.FIRING:  # derived() puts back a firing record's mode, which DECIDE does not store
        values[2] = None
    return dumps(values).encode()


def intact(record_id: str, h: Mapping[str, Any], signer: Any) -> bool:
    """Whether the record's hash still holds what the service decided (its seal matches; Signer.sealed)."""
    return bool(h) and signer.sealed(seal_text(record_id, h), h.get("seal"))


def silence_text(record_id: str, silence_id: str) -> bytes:
    """The bytes the seal of a record's silence covers (its `silence_seal`): the silence the service made for
    it, which it alone may expire when the ladder ends."""
    return dumps([record_id, "silence", silence_id]).encode()


# Pairs per DECIDE_MANY call: one call holds Redis for the whole batch, so a 1,000-alert notification is
# cut into a few (all still in one pipeline, one round trip).
DECIDE_BATCH = 100


def decide_many_calls(scripts: Scripts, made: list[NewRecord], index: bool) -> list[Call]:
    """DECIDE_MANY calls for pairs whose keys share one slot (all pairs, on a single Redis), in order;
    with index, each call also writes the history, approvals and due-target indexes of what it made."""
    calls: list[Call] = []
    for start in range(0, len(made), DECIDE_BATCH):
        chunk = made[start:start + DECIDE_BATCH]
        ks: list[str] = []
        argv: list[Any] = [len(chunk), int(index)]
        for n in chunk:
            k, block = n.keys_block(scripts.cluster)
            ks += k
            argv.append(len(block))
            argv += block
        if index:
            ks += [keys.HIST_JOURNAL, keys.APPROVALS, keys.DUE]
        calls.append((scripts.decide_many, ks, argv))
    return calls


def approve_call(scripts: Scripts, rid: str, *, verb: str, now: float, by: str, comment: str, command: str,
                 signature: str, expires_at: float, playbook: str, fingerprint: str, firing: bool, undo: bool,
                 obligation_due: float, episode_ttl: float, maxlen: int, early: Early = (),
                 defer: bool = False) -> Call:
    """The APPROVE call: release (verb approve) or refuse (verb reject) a held record."""
    t = keys.target_of_record(rid)
    args = {"now": int(now * 1000), "at": rfc3339(now), "verb": verb, "by": by, "comment": comment,
            "early": early_arg(early), "defer": int(defer),
            "maxlen": maxlen, "channel": keys.wake_channel(t), "command": command, "signature": signature,
            "expires_ms": int(expires_at * 1000), "undo": int(undo and firing),
            "ob_member": keys.obligation_member(playbook, fingerprint),
            "ob_due_ms": int((now + obligation_due) * 1000), "episode_ttl_ms": int(episode_ttl * 1000), "rid": rid,
            "holds": keys.episode_fields(fingerprint, "holds")[0]}
    ks = [keys.record(rid), keys.mailbox(t), keys.playbook_state(t, playbook),
          keys.obligation(t, playbook, fingerprint), keys.due_items(t), keys.metrics(t, scripts.cluster)]
    return scripts.approve, ks, [dumps(args)]


# How long after a claim the reconciler looks whether the claiming process is still the one alive.
CLAIM_RECHECK = 10.0


def claim(scripts: Scripts, target: keys.Target, entry_id: str, record_id: str | None, identity: str,
          now: float, cursor_ttl: float) -> str:
    """Take a mailbox entry: 'ok', 'taken', 'missing', 'expired', 'replayed' or 'gone' (see lua/claim.lua)."""
    # A malformed entry names no record: it still moves the cursor, under a key that never exists.
    rec = keys.record(record_id) if record_id else keys.record_prefix(target) + "-"
    answer = scripts.claim(keys=[keys.cursor(target), rec, keys.due_items(target),
                                 keys.metrics(target, scripts.cluster)],
                           args=[entry_id, identity, ms(now), ms(cursor_ttl), rfc3339(now), record_id or "-",
                                 ms(now + CLAIM_RECHECK)])
    return answer.decode() if isinstance(answer, bytes) else str(answer)


def ack_calls(scripts: Scripts, acks: Iterable[Ack], now: float) -> list[Call]:
    """One ACK call per action answer."""
    from .actions import CATALOGUE

    calls = []
    for a in acks:
        t = keys.target_of_record(a.record_id)
        spec = CATALOGUE.get(a.action)
        args = {"index": a.index, "status": a.status, "reason": a.reason or "", "result": dumps(a.result),
                "acked_at": a.acked_at, "acked_by": a.acked_by, "now": int(now * 1000), "replayed": int(a.replayed),
                "stats_ttl_ms": STATS_TTL_MS, "ledger": int(bool(spec and spec.sticky and t.kind == "job")),
                "ledger_max": LEDGER_MAX, "rid": a.record_id, "buckets": list(ACK_LATENCY_BUCKETS)}
        calls.append((scripts.ack, [keys.record(a.record_id), keys.ack_stats(t), keys.ledger(t), keys.due_items(t),
                                    keys.metrics(t, scripts.cluster)], [dumps(args)]))
    return calls


def release(scripts: Scripts, record_id: str, maxlen: int) -> bool:
    """Hand a claimed, unapplied command back to the target's next process."""
    t = keys.target_of_record(record_id)
    return bool(scripts.release(keys=[keys.record(record_id), keys.mailbox(t)],
                                args=[keys.wake_channel(t), maxlen, record_id]))


def reapply(scripts: Scripts, record_id: str, index: int, at: str, step: int | None, by: str) -> Any:
    """Note on an action that a resumed job applied it again."""
    return scripts.reapply(keys=[keys.record(record_id)],
                           args=[index, dumps({"at": at, "step": step, "by": by}), REAPPLIED_MAX])


@dataclass(frozen=True)
class Reconciled:
    """What RECONCILE did for one target."""

    next_due_ms: int | None
    changed: tuple[tuple[str, str], ...]
    obligations: tuple[str, ...]
    follow: tuple[str, ...] = ()


def reconcile_call(scripts: Scripts, target: keys.Target, now: float, *, grace: float, recheck: float, maxlen: int,
                   limit: int = 200) -> Call:
    """The RECONCILE call that brings one target's due records to the truth (see lua/reconcile.lua); the
    reconciler runs many targets' calls in one pipeline, and reads each answer with `reconciled`."""
    args = {"now": int(now * 1000), "at": rfc3339(now), "grace_ms": int(grace * 1000),
            "recheck_ms": int(recheck * 1000), "maxlen": maxlen, "channel": keys.wake_channel(target),
            "rec_prefix": keys.record_prefix(target), "limit": limit}
    return (scripts.reconcile, [keys.due_items(target), keys.mailbox(target), keys.heartbeat(target),
                                keys.metrics(target, scripts.cluster)], [dumps(args)])


def reconciled(answer: Any) -> Reconciled:
    """What RECONCILE answered for one target."""
    nxt, changed, obligations, follow = answer
    flat = [str(x) for x in changed]
    due = int(float(nxt))
    return Reconciled(None if due < 0 else due, tuple(zip(flat[::2], flat[1::2])), tuple(map(str, obligations)),
                      tuple(map(str, follow)))


def deferred(scripts: Scripts, record_id: str, now: float, command: str, signature: str, early: Early,
             maxlen: int, reason: str = "", results: Mapping[int, str] | None = None) -> str | None:
    """Send a record's command after its conditions (see lua/deferred.lua); its status, or None if not waiting.
    reason: the record's own reason, when it is set aside whole (tampered); results: the JSON result of early
    steps the service carried out itself (checkpoint_jobs), instead of their message."""
    t = keys.target_of_record(record_id)
    args = {"now": int(now * 1000), "at": rfc3339(now), "rid": record_id, "command": command, "signature": signature,
            "channel": keys.wake_channel(t), "maxlen": maxlen, "early": early_arg(early), "reason": reason,
            "results": {str(i): text for i, text in (results or {}).items()}}
    answer = scripts.deferred(keys=[keys.record(record_id), keys.mailbox(t), keys.due_items(t),
                                    keys.metrics(t, scripts.cluster)], args=[dumps(args)])
    return str(answer) if answer else None


def verdict(scripts: Scripts, record_id: str, status: str, resolved_at: str | None = None,
            time_to_resolve: float | None = None) -> bool:
    """Decide a pending outcome (see lua/verdict.lua); False when it was not pending any more."""
    args = {"status": status, "resolved_at": resolved_at or "",
            "time_to_resolve_s": -1 if time_to_resolve is None else round(time_to_resolve, 3)}
    t = keys.target_of_record(record_id)
    return bool(scripts.verdict(keys=[keys.record(record_id), keys.metrics(t, scripts.cluster)], args=[dumps(args)]))


# -- reading --------------------------------------------------------------------------------------------

def breaker_call(scripts: Scripts, op: str, playbook: str, now: float, member: str, limit: int,
                 lease: float) -> Call:
    """A BREAKER call (see lua/breaker.lua): claim a place under the playbook's max_active, or release one."""
    args = {"op": op, "now": ms(now), "member": member, "limit": limit, "lease_ms": max(1, ms(lease))}
    return (scripts.breaker, [keys.breaker_open(playbook), keys.breaker_state(playbook),
                             keys.breaker_targets(playbook)], [dumps(args)])


def loads_or(text: str | None, default: Any = None) -> Any:
    return json.loads(text) if text else default


def actions_of(h: Mapping[str, Any]) -> list[ActionView]:
    """The record's actions, as the contract shows them."""
    out = []
    get = h.get
    # A record DECIDE skipped does not store its actions' statuses: each is skipped too.
    usual = ActionStatus.SKIPPED if get("status") == RecordStatus.SKIPPED else ActionStatus.PENDING
    for i in range(int(get("n") or 0)):
        spec = json.loads(h[f"a:{i}:spec"])
        p = f"a:{i}:"
        out.append(ActionView(
            action=spec["action"], params=spec["params"], status=get(p + "status", usual),
            reason=get(p + "reason") or None, result=loads_or(get(p + "result")),
            acked_at=get(p + "acked_at") or None, acked_by=get(p + "acked_by") or None,
            reapplied=loads_or(get(p + "reapplied"), []), optional=True if spec.get("optional") else None,
            when=spec.get("when") or None))
    return out


def derived(record_id: str, h: dict[str, Any]) -> dict[str, Any]:
    """The hash with the fields a record does not store because its id holds them (id, created_at; its target
    is keys.target_of_record) or because they hold the usual value (mode, requested_by)."""
    if h:
        h.setdefault("id", record_id)
        h.setdefault("mode", Mode.FIRING)
        h.setdefault("requested_by", Requester.WEBHOOK)
        if "created_at" not in h:
            h["created_at"] = rfc3339(int(h.get("created_ms") or 0) / 1000)
    return h


def fence_of(h: Mapping[str, Any], alert: Mapping[str, Any] | None = None) -> str:
    """The applier's fence (protocol.fence) of a stored record: from its alert (alert_of(h), passed by a caller
    that read it already), start, playbook, stage and mode (a record written before keeps its own)."""
    if "fence" in h:
        return str(h["fence"])
    alert = alert_of(h) if alert is None else alert
    return fence(alert.get("fingerprint", ""), start_of(h, alert), h.get("playbook", ""), int(h.get("stage") or 0),
                 h.get("mode") or Mode.FIRING)


def start_of(h: Mapping[str, Any], alert: Mapping[str, Any] | None = None) -> str:
    """The start of the record's alert episode: stored, or its alert's startsAt to the second (the alert as
    fence_of says)."""
    if h.get("start"):
        return str(h["start"])
    return alert_second(str((alert_of(h) if alert is None else alert).get("starts_at") or ""))


def alert_of(h: Mapping[str, Any]) -> dict[str, Any]:
    """The record's alert, whole (shown_alert), from its hash; {} if it has none."""
    return shown_alert(h["alert"]) if h.get("alert") else {}


@dataclass(frozen=True)
class StoredRecord:
    """A record as its Redis hash holds it, parsed once: typed fields for the service, and the contract's
    shape (as_dict). `raw` is the hash itself, with the fields derived from the id put back: a seal check
    (intact, seal_text) and fence_of read it whole."""

    id: str
    raw: Mapping[str, Any]
    status: str
    reason: str | None
    playbook: str
    mode: str
    requested_by: str
    n: int
    stage: int
    parent: str | None
    next: str | None
    follow: bool

    @classmethod
    def from_hash(cls, record_id: str, h: Mapping[str, Any]) -> StoredRecord:
        """The record of a non-empty hash (HGETALL's answer) under this id."""
        raw = derived(record_id, dict(h))
        return cls(id=record_id, raw=raw, status=raw.get("status", ""), reason=raw.get("reason") or None,
                   playbook=raw.get("playbook", ""), mode=raw["mode"], requested_by=raw["requested_by"],
                   n=int(raw.get("n") or 0), stage=int(raw.get("stage") or 0), parent=raw.get("parent") or None,
                   next=raw.get("next") or None, follow=raw.get("follow") == "1")

    @property
    def target(self) -> keys.Target:
        return keys.target_of_record(self.id)

    @cached_property
    def alert(self) -> dict[str, Any]:
        """The record's alert, whole (shown_alert); {} if it has none."""
        return alert_of(self.raw)

    @cached_property
    def context(self) -> dict[str, Any]:
        """What the playbook's actions were given besides the alert (its target's labels, a GPU...)."""
        context: dict[str, Any] = loads_or(self.raw.get("context"), {})
        return context

    @cached_property
    def steps(self) -> tuple[Step, ...]:
        """The record's steps, as DECIDE wrote them."""
        return tuple(Step(**json.loads(self.raw[f"a:{i}:spec"])) for i in range(self.n))

    @property
    def outcome(self) -> dict[str, Any] | None:
        """The record's outcome ({status, resolved_at, time_to_resolve_s}), or None when it has none."""
        outcome: dict[str, Any] | None = loads_or(self.raw.get("outcome"))
        return outcome

    @property
    def expire_after(self) -> float:
        """How long a command of a held record lives once released (seconds)."""
        return float(self.raw.get("expire_after") or 3600)

    def action_status(self, i: int) -> str:
        """Action i's status (a record DECIDE skipped does not store them: each is skipped too)."""
        usual = ActionStatus.SKIPPED if self.status == RecordStatus.SKIPPED else ActionStatus.PENDING
        return str(self.raw.get(f"a:{i}:status", usual))

    def acked_at(self, i: int) -> str | None:
        """When action i was answered (RFC 3339), or None."""
        at = self.raw.get(f"a:{i}:acked_at")
        return str(at) if at else None

    def view(self) -> RecordView:
        """The contract's record, typed."""
        h = self.raw
        get = h.get
        if "target" in h:  # written before records left their target to their id
            t = json.loads(h["target"])
            target = keys.Target(t["kind"], t["name"] or "")
        else:
            target = self.target
        status = h["status"]
        outcome = self.outcome
        return RecordView(
            id=h["id"], created_at=h["created_at"], playbook=h["playbook"], status=status, reason=self.reason,
            alert=AlertView.of(self.alert), target=target, actions=actions_of(h),
            requested_by=get("requested_by") or None, approved_by=get("approved_by") or None,
            approved_at=get("approved_at") or None, rejected_by=get("rejected_by") or None,
            rejected_at=get("rejected_at") or None, approval_comment=get("approval_comment") or None,
            outcome=None if outcome is None else OutcomeView(
                status=outcome["status"], resolved_at=outcome.get("resolved_at"),
                time_to_resolve_s=outcome.get("time_to_resolve_s")),
            escalation=Escalation(stage=self.stage, parent=self.parent, next=self.next),
            silence_id=get("silence_id") or None, silence_error=get("silence_error") or None,
            detail=get("detail") or None,
            on_resolved=True if self.mode in (Mode.RESOLVED, Mode.TIMEOUT) else None,
            approval_expires_at=rfc3339(int(h["approve_by"]) / 1000)
            if get("approve_by") and status == RecordStatus.PENDING_APPROVAL else None,
            expires_at=rfc3339(int(h["expires_ms"]) / 1000)
            if get("expires_ms") and status == RecordStatus.DISPATCHED else None)

    def as_dict(self) -> dict[str, Any]:
        """The contract's record (RecordView's JSON)."""
        return self.view().as_dict()


def get(r: Any, record_id: str) -> dict[str, Any] | None:
    """One record, or None (also for a malformed id)."""
    try:
        key = keys.record(record_id)
    except ValueError:
        return None
    h = r.hgetall(key)
    return StoredRecord.from_hash(record_id, h).as_dict() if h else None


def load(r: Any, record_id: str) -> StoredRecord | None:
    """One stored record, parsed, or None when it is gone."""
    h = r.hgetall(keys.record(record_id))
    return StoredRecord.from_hash(record_id, h) if h else None


# -- the service's own bookkeeping on a record ------------------------------------------------------------
# Besides what the Lua scripts write, the reconciler keeps marks on the record: `follow` (it still follows
# the record), `notified:<event>`, `counted:<outcome>`, `ladder_end`, and `silence_claim` / `silence_id` /
# `silence_seal` (silence_text's seal: only the silence it made is ever expired) / `silence_error`. Marks are
# set with HSETNX so that racing replicas do each thing once.

def stored(r: Any, record_id: str) -> dict[str, str]:
    """The record's hash ({} when it is gone) with its id's fields put back: the service's view (records.alert_of
    reads its alert)."""
    return derived(record_id, dict(r.hgetall(keys.record(record_id))))


def field(r: Any, record_id: str, name: str) -> str | None:
    """One stored field of the record."""
    value = r.hget(keys.record(record_id), name)
    return None if value is None else str(value)


def mark_once(r: Any, record_id: str, name: str, value: str = "1") -> bool:
    """Set a mark unless it is set already: True for the one caller that set it."""
    return bool(r.hsetnx(keys.record(record_id), name, value))


def set_marks(r: Any, record_id: str, **marks: str) -> None:
    """Set (overwrite) bookkeeping marks on the record."""
    r.hset(keys.record(record_id), mapping=marks)


def drop_mark(r: Any, record_id: str, name: str) -> None:
    """Remove a bookkeeping mark (the reconciler stops following a record)."""
    r.hdel(keys.record(record_id), name)


# -- the record as the API shows it, and its OpenAPI schema --------------------------------------------------
# StoredRecord.view() builds a RecordView; SCHEMA is derived from the same classes (views.schema_of), so the
# published schema says what the record holds. A field's metadata holds its OpenAPI extras. Enum-typed fields
# hold the stored string (a member equals its value): a hash someone rewrote is still shown as it is.

@view
class AlertView(View):
    """The alert a record answers (capped_alert: annotations cut to a few KB)."""

    alertname: str
    status: Literal["firing", "resolved"]
    fingerprint: str
    starts_at: str
    ends_at: str
    labels: dict[str, str]
    annotations: dict[str, str]
    generator_url: str
    truncated: bool = dataclasses.field(metadata={"description": "true when annotations were cut to a few KB"})

    @classmethod
    def of(cls, alert: Mapping[str, Any]) -> AlertView:
        """The view of an alert as shown_alert gives it (a record without one shows empty values)."""
        get = alert.get
        return cls(alertname=get("alertname", ""), status=get("status", "firing"),
                   fingerprint=get("fingerprint", ""), starts_at=get("starts_at", ""),
                   ends_at=get("ends_at", NOT_ENDED), labels=get("labels", {}), annotations=get("annotations", {}),
                   generator_url=get("generator_url", ""), truncated=get("truncated", False))


@view
class ActionView(View):
    """One action of a record: what was asked, and how its applier answered."""

    action: str = dataclasses.field(metadata={"example": "scale_lr"})
    params: dict[str, Any]
    status: ActionStatus
    reason: str | None = dataclasses.field(
        metadata={"description": f"{', '.join(ActionReason)}, or the applier's own (no_cuda, ...)"})
    result: dict[str, Any] | None = dataclasses.field(
        metadata={"description": 'What the applier reported, e.g. {"old_lr": [..], "new_lr": [..], "step": 1234}'})
    acked_at: str | None = dataclasses.field(metadata=TIME)
    acked_by: str | None = dataclasses.field(metadata={"description": "host:pid[:rank]"})
    reapplied: list[dict[str, Any]] = dataclasses.field(
        metadata={"description": "Each time a resumed or rolled-back job applied it again"})
    optional: bool | None = None
    when: str | None = None


@view
class OutcomeView(View):
    """Whether the remediation worked, and when its alert resolved."""

    status: Outcome
    resolved_at: str | None = dataclasses.field(metadata=TIME)
    time_to_resolve_s: float | None


@view
class Escalation(View):
    """The record's place in its escalation ladder."""

    stage: int = dataclasses.field(metadata={"minimum": 0})
    parent: str | None
    next: str | None


@view
class RecordView(View):
    """A remediation record, as GET /remediations/{id} and the history show it (README: HTTP API, a record)."""

    id: str = dataclasses.field(metadata={"pattern": keys.RECORD_ID_RE.pattern.replace("\\Z", "$")})
    created_at: str = dataclasses.field(metadata=TIME)
    playbook: str
    status: RecordStatus
    reason: str | None = dataclasses.field(
        metadata={"description": f"Why it was skipped or expired: {', '.join(Reason)}, ..."})
    alert: AlertView
    target: keys.Target
    actions: list[ActionView]
    # A person acting with their own operator token is recorded as operator:NAME.
    requested_by: str | None = dataclasses.field(
        metadata={"pattern": f"^({'|'.join(Requester)}|operator:[A-Za-z0-9_.@-]{{1,64}})$"})
    approved_by: str | None
    approved_at: str | None = dataclasses.field(metadata=TIME)
    rejected_by: str | None
    rejected_at: str | None = dataclasses.field(metadata=TIME)
    approval_comment: str | None
    outcome: OutcomeView | None
    escalation: Escalation
    silence_id: str | None
    silence_error: str | None
    detail: str | None = None
    on_resolved: bool | None = dataclasses.field(
        default=None, metadata={"description": "true for the on_resolved actions of a resolved alert"})
    approval_expires_at: str | None = dataclasses.field(default=None, metadata=TIME)
    expires_at: str | None = dataclasses.field(default=None, metadata=TIME)


# The record's components, by the names the OpenAPI document gives them; a Target is described beside the
# operations (service/web/openapi.py), which show targets elsewhere too.
COMPONENTS: dict[type, str] = {ActionView: "RecordAction", RecordView: "Record", AlertView: "RecordAlert"}
SCHEMA: dict[str, dict[str, Any]] = {
    name: schema_of(cls, {**COMPONENTS, keys.Target: "Target"}) for cls, name in COMPONENTS.items()}
