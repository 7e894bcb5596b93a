"""Which (alert, playbook) pairs a notification asks to decide on; each alert is matched on its own labels."""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from collections.abc import Iterable

from ...client.wire import keys
from ...client.wire.protocol import rfc3339
from ..store.decision import Step

from ..rules.alerts import Alert, AlertGroup, parse_alert
from ..rules.playbooks import Playbook
from ..rules.targets import Resolution, resolve


@dataclass(frozen=True)
class Decision:
    """One (alert, playbook) pair to decide on, with the target already resolved."""

    playbook: Playbook
    mode: str  # firing | resolved | timeout | manual
    alert: Alert
    resolution: Resolution
    requested_by: str = "webhook"
    # 0 for the playbook's own actions; 1, 2, ... for its `escalate` stages (mode stage).
    stage: int = 0

    @property
    def steps(self) -> tuple[Step, ...]:
        if self.mode in ("resolved", "timeout"):
            return self.playbook.on_resolved
        return self.playbook.steps_of(self.stage)

    @property
    def answers_for_alert(self) -> bool:
        """Records of a firing alert and of its ladder get an outcome (manual and on_resolved ones do not)."""
        return self.mode in ("firing", "stage")

    @property
    def target(self) -> keys.Target:
        # Records of unusable labels are kept under an empty-named target of the playbook's kind.
        return self.resolution.target or keys.Target(self.playbook.target, "")


def plan(group: AlertGroup, playbooks: Iterable[Playbook]) -> list[Decision]:
    """Every (alert, matching playbook) pair of a notification, in the playbooks' order for each alert."""
    by_name, others = index(playbooks)
    out = []
    for alert in group.alerts:
        named = by_name.get(alert.alertname, ())
        candidates = sorted((*named, *others)) if named and others else named or others
        for _, pb in candidates:
            if pb.matches(alert.labels):
                out.append(Decision(pb, alert.status, alert, resolve(pb.target, alert.labels)))
    return out


Indexed = tuple[int, Playbook]


def index(playbooks: Iterable[Playbook]) -> tuple[dict[str, tuple[Indexed, ...]], tuple[Indexed, ...]]:
    """Playbooks by the alert name an `alertname="X"` matcher pins them to, and those without one; each with its
    place in the list. An alert is matched against its name's playbooks and the others only."""
    by_name: dict[str, list[Indexed]] = {}
    others: list[Indexed] = []
    for i, pb in enumerate(playbooks):
        names = {m.value for m in pb.matchers if m.name == "alertname" and m.op == "="}
        if len(names) == 1:
            by_name.setdefault(names.pop(), []).append((i, pb))
        elif not names:
            others.append((i, pb))
        # Two different alertname= matchers can never both hold: such a playbook matches nothing.
    return {k: tuple(v) for k, v in by_name.items()}, tuple(others)


def manual(playbook: Playbook, labels: dict, annotations: dict | None, requested_by: str) -> Decision:
    """A person's trigger of a playbook (or of one ad-hoc action): a firing alert of its own, never a resend."""
    now = rfc3339()
    alert = parse_alert({
        "status": "firing", "labels": {"alertname": f"manual:{playbook.name}", **labels},
        "annotations": annotations, "startsAt": now,
        "fingerprint": hashlib.sha256(f"{now}{time.perf_counter_ns()}".encode()).hexdigest()[:16],
    }, "body")
    return Decision(playbook, "manual", alert, resolve(playbook.target, alert.labels), requested_by)
