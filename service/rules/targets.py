"""Targets from alert labels (README: Playbooks, targets), validated before any use."""
from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Mapping

from ...client.wire.keys import TARGET_NAME_RE, Target

_GPU_ID = re.compile(r"^[0-9]{1,3}\Z")
_GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]{1,80}\Z")


@dataclass(frozen=True)
class Resolution:
    """A valid target with its action context, or why there is none."""

    target: Target | None
    context: dict
    reason: str | None = None  # "no_target" | "bad_label"
    detail: str | None = None


def _host(instance: str) -> str:
    if instance.startswith("["):  # [::1]:9100
        return instance[1:].split("]", 1)[0]
    return instance.rsplit(":", 1)[0] if instance.count(":") == 1 else instance


def resolve(kind: str, labels: Mapping[str, str]) -> Resolution:
    """The job or node an alert points at; hostile label values never get past here."""
    if kind == "job":
        source = "job_name" if "job_name" in labels else "job"
        name = labels.get(source)
    else:
        source = "node" if "node" in labels else "instance"
        name = labels.get("node") if "node" in labels else (_host(labels["instance"]) if "instance" in labels else None)
    if name is None:
        wanted = "job_name or job" if kind == "job" else "node or instance"
        return Resolution(None, {}, "no_target", f"the alert has no {wanted} label")
    if not TARGET_NAME_RE.match(name):
        return Resolution(None, {}, "bad_label", f"label {source} is not a valid target name")
    context: dict = {}
    for label, rx in (("gpu_id", _GPU_ID), ("gpu_uuid", _GPU_UUID)):
        if label in labels:
            if not rx.match(labels[label]):
                return Resolution(None, {}, "bad_label", f"label {label} is not a valid GPU id")
            context[label] = labels[label]
    return Resolution(Target(kind, name), context)
