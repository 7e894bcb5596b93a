"""Every Redis key and channel name trainmedic uses, built in one place."""
from __future__ import annotations

from typing import Any

import re
from dataclasses import dataclass

PREFIX = "trainmedic:"

# A label value used as a target name must match this (README: Playbooks); names of dots only ("..") are refused
# too, so a name can never walk a path even if some future code joins it into one.
TARGET_NAME_RE = re.compile(r"^(?!\.+\Z)[A-Za-z0-9_.:@-]{1,128}\Z")
TARGET_KINDS = ("job", "node")
# Record ids are "<26-char time-sortable id>~<kind>~<name>"; name is empty for bad-label records.
RECORD_ID_RE = re.compile(r"^[0-9A-Z]{26}~(job|node)~([A-Za-z0-9_.:@-]{0,128})\Z")


@dataclass(frozen=True)
class Target:
    """A job (training process) or node (GPU host) that receives commands."""

    kind: str
    name: str

    @property
    def tag(self) -> str:
        # Every key of one target shares this Redis Cluster hash tag, so scripts stay in one slot.
        return f"{{{self.kind}:{self.name}}}"

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.name}"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name or None}


def target_of_record(record_id: str) -> Target:
    """The target encoded in a record id (raises ValueError on a malformed id)."""
    m = RECORD_ID_RE.match(record_id)
    if not m:
        raise ValueError("not a remediation id")
    return Target(m.group(1), m.group(2))


def mailbox(t: Target) -> str:
    return f"{PREFIX}{t.tag}:mailbox"


def up_channel(t: Target) -> str:
    """Channel: the target's applier tells the service something (protocol.DETECTED, ACKS, BEAT); the service
    listens on every target's (UP_PATTERN). Commands need no channel: an applier blocks on its mailbox."""
    return f"{PREFIX}{t.tag}:up"


def detections(t: Target) -> str:
    """Stream: the job's detections (firing and resolved), written by its training client, read by the service."""
    return f"{PREFIX}{t.tag}:detections"


def detections_cursor(t: Target) -> str:
    """String: the id of the job's last detection the service decided."""
    return f"{PREFIX}{t.tag}:detections:cursor"


def detection_claim(t: Target, entry_id: str) -> str:
    """String: which service process decides one detection (the first to set it)."""
    return f"{PREFIX}{t.tag}:detections:claim:{entry_id}"


def detection_limit(t: Target, alertname: str) -> str:
    """String with a TTL: the job's detector raised an alert within its playbooks' cooldown (its episode's start);
    outside the job's own keys, so that only the service sets it."""
    return f"{PREFIX}detect:{t.tag}:{alertname}"


def signals(t: Target) -> str:
    """String: the job's latest training signals, as its heartbeat wrote them (GET /metrics, hang checks)."""
    return f"{PREFIX}{t.tag}:signals"


def up_target(channel: str) -> Target | None:
    """The target whose channel to the service this is (up_channel's inverse), or None."""
    if not (channel.startswith(PREFIX + "{") and channel.endswith("}:up")):
        return None
    return parse_label(channel[len(PREFIX) + 1:-len("}:up")])


# Every target's channel to the service, for PSUBSCRIBE.
UP_PATTERN = PREFIX + "{*}:up"


def cursor(t: Target) -> str:
    return f"{PREFIX}{t.tag}:cursor"


def heartbeat(t: Target) -> str:
    return f"{PREFIX}{t.tag}:heartbeat"


def record_prefix(t: Target) -> str:
    """The part of a record key before its id (scripts build record keys of one target from it)."""
    return f"{PREFIX}{t.tag}:rec:"


def record(record_id: str) -> str:
    return record_prefix(target_of_record(record_id)) + record_id


def target_state(t: Target) -> str:
    """Hash: what the target's decisions read and write (lua/decide.lua says each field): each playbook's guards
    (`PLAYBOOK|cool`, `PLAYBOOK|runs`) and its alerts' episodes (episode_fields), and the mailbox's count (`q`)."""
    return f"{PREFIX}{t.tag}:state"


def episode_fields(playbook: str, fingerprint: str, *names: str) -> list[str]:
    """The fields of an alert's episode in its target's state: its open episode's start and record, its
    latest closed one (a tombstone), its held records, and the resolve it last saw."""
    return [f"{playbook}|{fingerprint}|{name}" for name in names]


def playbook_state(t: Target, playbook: str) -> str:
    """Hash: a playbook's guards and episodes on a target as the previous version kept them (service/upgrade.py
    folds them into target_state)."""
    return f"{PREFIX}{t.tag}:playbook:{playbook}"


def obligation(t: Target, playbook: str, fingerprint: str) -> str:
    """Hash: what on_resolved must undo for this alert, whichever episode changed it."""
    return f"{PREFIX}{t.tag}:undo:{playbook}:{fingerprint}"


def obligation_member(playbook: str, fingerprint: str) -> str:
    """An obligation's name among its target's due items."""
    return f"ob|{playbook}|{fingerprint}"


def due_items(t: Target) -> str:
    """Sorted set: the target's records and obligations the reconciler must look at, by due time (ms)."""
    return f"{PREFIX}{t.tag}:due"


def ledger(t: Target) -> str:
    """List: the job's applied scale_lr / set_lr, oldest first, for resumes (README: Guarantees, 5)."""
    return f"{PREFIX}{t.tag}:ledger"


def target_metrics(t: Target) -> str:
    """Hash of counts its appliers' scripts (and on Redis Cluster every script) keep for the target: acks by
    action and status, their latency, the backlog's moves, refused commands. The service folds it into METRICS
    (service/fold.py) when it looks at the target, and deletes it."""
    return f"{PREFIX}{t.tag}:metrics"


def power_memory(node: str) -> str:
    """Hash gpu-key -> remembered power limit (mW) before trainmedic lowered it."""
    return f"{PREFIX}{{node:{node}}}:power"


def parse_label(label: str) -> Target | None:
    """The target of a "kind:name" label, or None when it is not one."""
    kind, _, name = label.partition(":")
    if kind in TARGET_KINDS and TARGET_NAME_RE.match(name):
        return Target(kind, name)
    return None


def live(kind: str) -> str:
    """Sorted set: targets of a kind by the time their latest heartbeat stops counting as live (ms); the service
    keeps it from the heartbeats it reads itself (service/beats.py)."""
    return f"{PREFIX}live:{kind}"


# Alerts no playbook matched (service/unmatched.py): counts by alert name (at most 100 names and `other`), and
# per name a mark that lives a minute once its log line is written. One hash tag: one script writes both.
UNMATCHED = PREFIX + "{unmatched}:counts"


def unmatched_logged(name_digest: str) -> str:
    """String with a TTL: an unmatched alert name (as a digest) was logged within the last minute."""
    return f"{PREFIX}{{unmatched}}:logged:{name_digest}"


# Global keys (their own slot), written by the service only.
# The counts GET /metrics shows: backlog by kind, acks by action and status, ack latency, refused commands.
METRICS = PREFIX + "metrics"
# Record ids scored by their history sequence number (service/history.py assigns it when it indexes them).
HISTORY = PREFIX + "history"
# The history index (service/history.py): the journal of record changes not yet indexed (on a single Redis the
# service's scripts push there; on Redis Cluster, and for appliers' scripts, each target's own journal), the
# sequence counter, the indexer's lock, the per-segment bitmaps and the facets (playbook and alert name) seen.
HIST_JOURNAL = PREFIX + "hist:journal"
HIST_SEQ = PREFIX + "hist:seq"
HIST_LOCK = PREFIX + "hist:lock"
HIST_PREFIX = PREFIX + "hist:"
HIST_FACETS = PREFIX + "hist:facets"
# Labels of targets whose own journal (journal(t)) may hold entries not yet moved to HIST_JOURNAL: the service
# names them when it learns of their changes (an applier's ack, a script it ran on Redis Cluster).
HIST_DIRTY = PREFIX + "hist:dirty"


def hist_bitmap(segment: int, field: str, value: str) -> str:
    """String: a bit per record of a segment of 2^16 sequence numbers whose FIELD has VALUE."""
    return f"{HIST_PREFIX}bm:{segment}:{field}:{value}"


def hist_segment_keys(segment: int) -> str:
    """Set: the bitmap keys of a segment (retention drops them whole)."""
    return f"{HIST_PREFIX}seg:{segment}"


def target_history(t: Target) -> str:
    """Sorted set: the target's record ids by history sequence number (target= filters)."""
    return f"{PREFIX}{t.tag}:hist"


def journal(t: Target) -> str:
    """List: the target's own journal of record changes (the service moves it to HIST_JOURNAL)."""
    return f"{PREFIX}{t.tag}:hj"


APPROVALS = PREFIX + "approvals"
# Targets the service knows (label -> when it last saw their heartbeat, s): an applier announces itself on its
# channel, and the service alone writes this.
TARGETS = PREFIX + "targets"
# Target labels by the earliest due time (ms) of their due items: what the reconciler visits next.
DUE = PREFIX + "due"
# The reconcilers' lease: one of them ticks at a time (correct without it, just wasteful).
RECONCILER_LEASE = PREFIX + "reconciler"
# Written once into a keyspace; its absence later means Redis came back without trainmedic's data.
EPOCH = PREFIX + "epoch"
# A count (hash field n) that only a script writes (lua/mark.lua), and the service's copy of it written with a
# plain SET: a count below its copy means Redis came back without what the scripts wrote (records, episodes...).
MARK = PREFIX + "mark"
MARK_SEEN = PREFIX + "mark:seen"
RESETS = PREFIX + "resets"
# When the reconciler last found the keyspace empty (the page shows a banner while it lives).
RESET_AT = RESETS + ":at"
# Jobs the service judged hung (label -> the hang's start, ms): TrainingHang is open for them.
HUNG = PREFIX + "hung"
# Commands refused by appliers, by reason (bad_signature, unsigned, replayed): a hash of counts the service
# folds in from the targets' own (target_metrics).
REJECTED = PREFIX + "rejected"
# Keys of a wrong type or values that did not parse, that the service repaired or skipped (a count).
REPAIRS = PREFIX + "repairs"
# Records the service refused to act on because their hash no longer matched its seal (only it writes this).
TAMPERED = PREFIX + "tampered"
# Alerts the resync decided (Alertmanager listed them active; Redis had no episode), and its lease.
RESYNCED = PREFIX + "resynced"
RESYNC_LEASE = PREFIX + "resync"


def outcomes(status: str, playbook: str) -> str:
    """Sorted set: a playbook's records by the time they got this outcome (GET /playbooks, 30 days)."""
    return f"{PREFIX}outcomes:{status}:{playbook}"


def resolve_times(playbook: str) -> str:
    """Sorted set: "<record id>|<seconds>" of a playbook's effective records, by decision time."""
    return f"{PREFIX}ttr:{playbook}"


# Hashes of counts for /metrics: outcomes by "playbook|outcome", and the time-to-resolve histogram by
# "playbook|bucket index", "playbook|sum" and "playbook|count".
OUTCOME_COUNTS = PREFIX + "outcome_counts"
RESOLVE_HISTOGRAM = PREFIX + "ttr_histogram"


def breaker_open(playbook: str) -> str:
    """Sorted set: the open remediations a playbook's max_active counts (lua/breaker.lua), in its own slot."""
    return f"{PREFIX}{{breaker:{playbook}}}:open"


def breaker_targets(playbook: str) -> str:
    """Hash: how many of the playbook's open claims each target has (lua/breaker.lua counts targets with it)."""
    return f"{PREFIX}{{breaker:{playbook}}}:targets"


def breaker_state(playbook: str) -> str:
    """String: set while the playbook's breaker holds new remediations back (trainmedic_breaker_open)."""
    return f"{PREFIX}{{breaker:{playbook}}}:state"


def chart_cache(t: Target, record_id: str) -> str:
    """String: Prometheus's answer for a record's metric chart, for a short while (its TTL)."""
    return f"{PREFIX}{t.tag}:chart:{record_id}"


# Goodput (service/goodput.py): the service's own accounting of each job's time. Its keys keep the job's hash
# tag but sit outside `trainmedic:{job:NAME}:*`, which the job's own Redis user may write.
def goodput(t: Target) -> str:
    """String: one job's accounting, one line (service/goodput.py Account), kept 30 days after its last write."""
    return f"{PREFIX}goodput:{t.tag}"


def goodput_incidents(t: Target) -> str:
    """Hash: record id -> "HIGH RECOVERED": the job's highest step when the record's alert began, and when its
    step first passed it ("-" until then), for its newest records."""
    return f"{PREFIX}goodput:incidents:{t.tag}"


# Lemon nodes (service/lemons.py): the firing remediations dispatched to each node, kept by the scripts
# that dispatch them (lua/decide.lua, lua/approve.lua) in the node's hash slot, outside `trainmedic:{node:NAME}:*`
# (which the node's own Redis user may write).
def node_incidents(t: Target) -> str:
    """Hash: playbook -> how many firing remediations of it were dispatched to the node, ever
    (trainmedic_node_incidents_total)."""
    return f"{PREFIX}incidents:{t.tag}"


def node_incident_times(t: Target) -> str:
    """Sorted set: the node's incidents of the last 7 days, record id -> when dispatched (ms) (GET /targets)."""
    return f"{PREFIX}incidents:{t.tag}:times"


# Sorted set: the nodes the service has seen (an agent's heartbeat, an incident), name -> when last seen (s):
# each has trainmedic_node_incidents_total series, at 0 until its first incident.
NODES_SEEN = PREFIX + "incidents:nodes"


# Sorted set, every score 0: "l:NAME" for live jobs and "n:NAME" for the others, so that names in order list
# live jobs first, then the rest, both by name (GET /jobs pages through it).
GOODPUT_JOBS = PREFIX + "goodput:jobs"
# Sorted set: jobs whose process ended without close() and none followed, by when their down time stops
# growing (ms): with the live ones, the jobs /metrics shows.
GOODPUT_DOWN = PREFIX + "goodput:down"
# String: the history sequence number up to which the service looked for jobs' new records (incidents).
GOODPUT_SEQ = PREFIX + "goodput:seq"
# String: where the sweep of jobs past retention out of GOODPUT_JOBS goes on next.
GOODPUT_SWEEP = PREFIX + "goodput:sweep"
