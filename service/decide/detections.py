"""Detections: what training clients detect in the loop, and the hangs the service sees, decided at once.

A client appends a detection to its job's own stream (keys.detections) and says so on its job's own channel;
the service's listener (service/listener.py) hears it at once and decides it as if Alertmanager had delivered
it, with `requested_by: detector`. The job name always comes from the stream's key, never from what the job
wrote, so a job can raise alerts only about itself. The reconciler also looks at the detections of every job it
visits, so one said while no listener ran is decided within its next look at the job.
"""
from __future__ import annotations

import logging
import math
import os
import secrets
import time
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...client.wire import keys
from ...client.wire.protocol import parse_rfc3339, rfc3339

from .. import signals
from ..http import HttpError
from ..rules.alerts import Alert, episode_start
from ..rules.playbooks import Playbook
from ..rules.targets import resolve
from .alertmanager import Alertmanager
from .dispatch import Dispatcher, Outcome
from .plan import Decision

log = logging.getLogger("trainmedic.detections")

NAN, SPIKE, HANG = "TrainingLossNaN", "TrainingLossSpike", "TrainingHang"
STRAGGLER = "TrainingStraggler"
# The alerts a job's client may raise about itself, and their severity (README: the training client).
CLIENT_ALERTS = {NAN: "critical", SPIKE: "critical", STRAGGLER: "warning"}
# The labels a detection names besides the job, each with the rule its value must follow (a straggler names the
# slow rank's node, which its playbook acts on, and the rank's number).
EXTRA_LABELS: dict[str, dict[str, re.Pattern[str]]] = {
    STRAGGLER: {"node": keys.TARGET_NAME_RE, "rank": re.compile(r"^(0|[1-9][0-9]{0,6})\Z")}}
SEVERITY = {**CLIENT_ALERTS, HANG: "warning"}
# One detection is decided by the first service process that claims it; the claim outlives any retry.
CLAIM_TTL = 600.0
CURSOR_TTL = 2 * 86400.0
# A firing detection posted to Alertmanager ends by itself this long after, if no resolve is posted (the
# client that would resolve it may be gone); as long as the playbooks' default resolve_timeout.
POST_ENDS_AFTER = 12 * 3600.0
HANG_SCAN_INTERVAL = 10.0

# Alertmanager's fingerprint of a label set (prometheus/common model.LabelSet.Fingerprint): 64-bit FNV-1a
# over each label, sorted by name, as name, 0xff, value, 0xff; printed as 16 hex digits (0xcbf29ce484222325,
# the offset itself, for no labels).
_FNV_OFFSET, _FNV_PRIME, _MASK = 14695981039346656037, 1099511628211, (1 << 64) - 1


def fingerprint(labels: Mapping[str, str]) -> str:
    """The fingerprint Alertmanager gives an alert with these labels."""
    h = _FNV_OFFSET
    # A label with an empty value is no label at all to Alertmanager (it drops it from the alert).
    for name in sorted(n for n, v in labels.items() if v):
        for byte in name.encode() + b"\xff" + labels[name].encode() + b"\xff":
            h = ((h ^ byte) * _FNV_PRIME) & _MASK
    return f"{h:016x}"


def labels_of(target: keys.Target, alertname: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The labels of a detection: alertname, job_name, what else it names (a straggler: node, rank), severity,
    source."""
    return {"alertname": alertname, "job_name": target.name, **(extra or {}), "severity": SEVERITY[alertname],
            "source": "trainmedic"}


class Detections:
    """Decides jobs' detections and hangs; its listener thread hears detections as they are written."""

    def __init__(self, r: Any, dispatcher: Dispatcher, playbooks: Sequence[Playbook],
                 alertmanager: Alertmanager | None = None, hang_after: float = 600.0, public_url: str = "",
                 on_outcomes: Callable[[list[Outcome]], None] | None = None):
        self.r = r
        self.dispatcher = dispatcher
        self.playbooks = list(playbooks)
        self.alertmanager = alertmanager
        self.hang_after = hang_after
        self.public_url = public_url
        self.on_outcomes = on_outcomes
        self.identity = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._next_scan = 0.0

    # -- deciding one detection
    def decide(self, target: keys.Target, alertname: str, status: str, starts_at: str, ends_at: str = "",
               summary: str = "", extra: Mapping[str, str] | None = None) -> list[Outcome]:
        """Decide a detection of `target` as Alertmanager's notification of it would be, then post it there.

        At most one firing detection of a detector and job is decided (and posted) per cooldown of the
        playbooks that answer it: a detector that flaps makes one record, not one a flap. A resolve is decided
        (it closes the episode, and runs on_resolved) and posted only for the episode that was."""
        labels = labels_of(target, alertname, extra)
        if not self._let_through(target, alertname, status, starts_at, labels):
            return []
        notes = {"summary": summary} if summary else {}
        alert = Alert(status=status, labels=labels, annotations=notes, starts_at=starts_at,
                      ends_at=ends_at, fingerprint=fingerprint(labels), episode_start=episode_start(starts_at),
                      generator_url=self.public_url)
        decisions = [Decision(pb, status, alert, resolve(pb.target, labels), requested_by="detector")
                     for pb in self.playbooks if pb.matches(labels)]
        outcomes = self.dispatcher.execute(decisions)
        for o in outcomes:
            if o.new:
                log.info("remediation %s: playbook %s on %s for %s detected (%s): %s%s", o.record_id, o.playbook,
                         target.label, alertname, status, o.status, f" ({o.reason})" if o.reason else "",
                         extra={"remediation_id": o.record_id, "fingerprint": o.fingerprint,
                                "target": target.label, "alertname": alertname})
        if self.on_outcomes is not None and outcomes:
            self.on_outcomes(outcomes)
        self._post(alert)
        return outcomes

    def _let_through(self, target: keys.Target, alertname: str, status: str, starts_at: str,
                     labels: Mapping[str, str]) -> bool:
        """Whether this detection is decided: a firing one when none of the detector was within the cooldown
        (it then holds the limit, naming its episode), a resolve when it names that episode."""
        limit = keys.detection_limit(target, alertname)
        if status == "firing":
            cooldown = max([pb.cooldown for pb in self.playbooks if pb.matches(labels)] or [0.0])
            return bool(self.r.set(limit, starts_at, nx=True, px=max(1000, int(cooldown * 1000))))
        held = self.r.get(limit)
        return held is None or episode_start(str(held)) == episode_start(starts_at)

    def _post(self, alert: Alert) -> None:
        """Show the detection in Alertmanager with the same labels and start, so its notification of it is a
        resend of the episode decided here (one remediation per firing episode). Never holds up a decision for long."""
        if self.alertmanager is None:
            return
        ends = alert.ends_at if alert.status == "resolved" else rfc3339(time.time() + POST_ENDS_AFTER)
        body = {"labels": dict(alert.labels), "annotations": dict(alert.annotations), "startsAt": alert.starts_at,
                "endsAt": ends}
        if alert.generator_url:
            body["generatorURL"] = alert.generator_url
        try:
            self.alertmanager.post_alerts([body])
        except HttpError as exc:
            log.warning("could not post %s of %s to Alertmanager: %s", alert.alertname,
                        alert.labels.get("job_name"), exc.message)

    # -- a job's detections stream
    def waiting(self, targets: Sequence[keys.Target]) -> list[keys.Target]:
        """The jobs whose detections stream holds an entry after the last one decided (one round trip for all:
        the reconciler asks this of every job it visits, and a burst visits thousands)."""
        jobs = [t for t in targets if t.kind == "job" and t.name]
        if not jobs:
            return []
        pipe = self.r.pipeline(transaction=False)
        for t in jobs:
            pipe.get(keys.detections_cursor(t))
            pipe.xrevrange(keys.detections(t), "+", "-", count=1)
        answers = pipe.execute()
        return [t for t, cursor, last in zip(jobs, answers[::2], answers[1::2])
                if last and _stream_id(last[0][0]) > _stream_id(cursor or "0-0")]

    def handle(self, target: keys.Target) -> list[Outcome]:
        """Decide the job's detections written since the last one decided (each by one service process)."""
        if target.kind != "job" or not target.name:
            return []
        cursor = self.r.get(keys.detections_cursor(target)) or "0-0"
        entries = self.r.xrange(keys.detections(target), f"({cursor}", "+", count=100)
        out: list[Outcome] = []
        for eid, fields in entries:
            if not self.r.set(keys.detection_claim(target, eid), self.identity, nx=True, px=int(CLAIM_TTL * 1000)):
                continue  # another process decides it
            parsed = _parse(fields)
            if parsed is None:
                log.warning("ignored a malformed detection of %s (entry %s)", target.label, eid)
                continue
            alertname, status, starts_at, ends_at, summary, extra = parsed
            out.extend(self.decide(target, alertname, status, starts_at, ends_at, summary.format(job=target.name),
                                   extra))
        if entries:
            self.r.set(keys.detections_cursor(target), entries[-1][0], px=int(CURSOR_TTL * 1000))
        return out

    # -- hangs
    def scan_hangs(self, now: float | None = None, force: bool = False) -> list[Outcome]:
        """Raise TrainingHang for live jobs whose step has not moved for hang_after, resolve it for those whose
        step moved (or whose heartbeats stopped). Runs at most every HANG_SCAN_INTERVAL unless forced."""
        now = time.time() if now is None else now
        if not force and now < self._next_scan:
            return []
        self._next_scan = now + HANG_SCAN_INTERVAL
        # Live now: a heartbeat within its TTL (keys.live scores when it stops counting).
        jobs = signals.recent_jobs(self.r, now, 0.0)
        hung: dict[str, float] = {}
        steps: dict[str, float] = {}
        for t, values in signals.read(self.r, jobs):
            step, since = values[0], values[1]
            if step is None or since is None:
                continue  # a job that never passes a step is never judged hung
            if now - since / 1000 >= self.hang_after:
                hung[t.label] = since / 1000 + self.hang_after
                steps[t.label] = step
        open_ = {str(label): score / 1000 for label, score in self.r.zrange(keys.HUNG, 0, -1, withscores=True)}
        out: list[Outcome] = []
        for label, start in open_.items():
            if label in hung and abs(hung[label] - start) < 1.0:
                continue  # the same hang, already raised
            gone = keys.parse_label(label)
            if gone is not None:
                out.extend(self.decide(gone, HANG, "resolved", rfc3339(start), rfc3339(now)))
            self.r.zrem(keys.HUNG, label)
        for label, start in hung.items():
            if label in open_ and abs(open_[label] - start) < 1.0:
                continue
            job = keys.parse_label(label)
            if job is None:
                continue
            self.r.zadd(keys.HUNG, {label: int(start * 1000)})
            out.extend(self.decide(job, HANG, "firing", rfc3339(start), "",
                                   f"Job {job.name} heartbeats but its step has stayed at {steps[label]:.0f} for "
                                   f"{self.hang_after:.0f} seconds."))
        return out


_SUMMARY = {NAN: "The training loss of job {{job}} was {value} at step {step} (detected in the training loop).",
            SPIKE: "The training loss of job {{job}} was {value} at step {step}, above twice its recent median "
                   "(detected in the training loop).",
            STRAGGLER: "Rank {rank} of job {{job}} on node {node} was {value} times slower than the job's median "
                       "rank at step {step} (detected in the training loop)."}


def _parse(f: Mapping[str, str]) -> tuple[str, str, str, str, str, dict[str, str]] | None:
    """A detection entry's alertname, status, start, end, summary and the labels it names besides the job;
    None for one that is not valid."""
    alertname, status = f.get("alertname", ""), f.get("status", "")
    starts_at, ends_at = f.get("starts_at", ""), f.get("ends_at", "")
    if alertname not in CLIENT_ALERTS or status not in ("firing", "resolved"):
        return None
    extra = {name: f.get(f"label:{name}", "") for name in EXTRA_LABELS.get(alertname, {})}
    if any(not rule.match(extra[name]) for name, rule in EXTRA_LABELS.get(alertname, {}).items()):
        return None
    start = parse_rfc3339(starts_at)
    if start is None or start > time.time() + 300:
        return None
    if status == "resolved" and parse_rfc3339(ends_at) is None:
        return None
    try:
        value = float(f.get("value") or "nan")
        step = int(f.get("step") or -1)
    except ValueError:
        return None
    shown = f"{value:.4g}" if math.isfinite(value) else str(value)
    summary = _SUMMARY[alertname].format(value=shown, step=step if step >= 0 else "?", **extra) \
        if status == "firing" else ""
    return alertname, status, starts_at, ends_at if status == "resolved" else "", summary, extra


def _stream_id(text: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as numbers, for comparing ids."""
    ms, _, seq = str(text).partition("-")
    return int(ms or 0), int(seq or 0)
