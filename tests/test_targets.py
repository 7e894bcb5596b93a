"""Targets resolved from alert labels with the README's label rules."""
from __future__ import annotations

import pytest

from trainmedic.client.wire.keys import Target
from trainmedic.service.rules.targets import resolve


@pytest.mark.parametrize("kind, labels, expected", [
    ("job", {"job_name": "llama-ft-01", "job": "scrape"}, Target("job", "llama-ft-01")),
    ("job", {"job": "trainer-7"}, Target("job", "trainer-7")),
    ("node", {"node": "gpu-node-01", "instance": "x:1"}, Target("node", "gpu-node-01")),
    ("node", {"instance": "gpu-node-02:9445"}, Target("node", "gpu-node-02")),
    ("node", {"instance": "[::1]:9100"}, Target("node", "::1")),
    ("node", {"instance": "10.0.0.7"}, Target("node", "10.0.0.7")),
])
def test_targets_come_from_the_contract_labels(kind: str, labels: dict, expected: Target) -> None:
    assert resolve(kind, labels).target == expected


def test_gpu_labels_become_context() -> None:
    res = resolve("node", {"instance": "n1:9445", "gpu_id": "3", "gpu_uuid": "GPU-1234-abcd"})
    assert res.context == {"gpu_id": "3", "gpu_uuid": "GPU-1234-abcd"}


@pytest.mark.parametrize("labels", [
    {"job_name": "x; rm -rf /"}, {"job_name": "../../etc/passwd"}, {"job_name": "a\nb"},
    {"job_name": "a" * 5000}, {"job_name": ""}, {"job_name": "$(reboot)"}, {"job_name": "ok", "gpu_id": "0; ls"},
    # Python's $ also matches before a final newline: the patterns end in \Z.
    {"job_name": "llama-ft-01\n"}, {"job_name": "ok", "gpu_id": "0\n"}, {"job_name": "..\n"},
])
def test_hostile_labels_are_bad_labels(labels: dict) -> None:
    res = resolve("job", labels)
    assert res.target is None and res.reason == "bad_label" and res.detail


def test_no_label_means_no_target() -> None:
    res = resolve("job", {"alertname": "X"})
    assert res.target is None and res.reason == "no_target"
