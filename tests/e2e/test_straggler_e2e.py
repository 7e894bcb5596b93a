"""End to end: real gloo ranks on the CPU, one slowed by sharing its core with busy processes; the client raises
TrainingStraggler naming its node and rank, the real service decides it, the real Alertmanager lists it, and
it resolves when the rank has its core back. A calm job raises nothing."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import requests

from tests.conftest import write_playbooks
from tests.support.stragglers import STRAGGLER_PLAYBOOK, StragglerJob
from trainmedic.client.wire import keys

from .test_alertmanager import wait_for
from .test_detections_e2e import am_alerts, stack

# Probes every 20 steps (a comparison every second or so here), and up to a fifth of the time for them: the
# tests want many comparisons in a few seconds; the defaults space them by minutes.
FAST = {"probe_steps": 20, "probe_share": 0.2}


def entries(r: Any, job: str) -> list[dict[str, str]]:
    return [fields for _, fields in r.xrange(keys.detections(keys.Target("job", job)))]


def test_a_rank_sharing_its_core_is_raised_with_its_node_and_rank_and_resolves_when_it_has_it_back(
        gunicorn: Any, redis_url: str, r: Any, tmp_path: Path) -> None:
    playbooks = write_playbooks(tmp_path / "straggler.yaml", STRAGGLER_PLAYBOOK)
    server, am = stack(gunicorn, tmp_path, TRAINMEDIC_PLAYBOOKS=str(playbooks))
    # Ranks 0 and 1 share core 0; rank 2 gets core 1, then shares it with two busy processes at a lower priority.
    job = StragglerJob(tmp_path, 3, redis_url, "slow-job", cores=[{0}, {0}, {1}], detect=FAST)
    try:
        job.started()
        slowed_at = time.time()
        job.slow_down(2, busy=2)
        [rec] = wait_for(lambda: requests.get(server.url + "/history", timeout=5).json()["items"], 120,
                         "the TrainingStraggler record")
        labels = {"alertname": "TrainingStraggler", "job_name": "slow-job", "node": "node-2", "rank": "2",
                  "severity": "warning", "source": "trainmedic"}
        assert rec["alert"]["labels"] == labels
        assert (rec["playbook"], rec["requested_by"], rec["target"]) == (
            "straggler", "detector", {"kind": "node", "name": "node-2"})
        listed = wait_for(lambda: am_alerts(am, "TrainingStraggler"), 15, "the straggler in Alertmanager")
        assert [a["labels"] for a in listed] == [labels]
        assert [a["fingerprint"] for a in listed] == [rec["alert"]["fingerprint"]]
        job.restore(2)
        wait_for(lambda: [e["status"] for e in entries(r, "slow-job")] == ["firing", "resolved"], 120,
                 "the straggler to resolve")
        job.stop()
        results = job.results()
    finally:
        job.kill()
        am.stop()
    comparisons = results[0]["comparisons"]
    before = sum(1 for c in comparisons if c["at"] < slowed_at)
    assert results[0]["detected_at"] is not None and results[0]["detected_at"] - before <= 3, comparisons
    fired, resolved = entries(r, "slow-job")
    assert (fired["label:node"], fired["label:rank"]) == (resolved["label:node"], resolved["label:rank"]) == (
        "node-2", "2")
    assert fired["starts_at"] == resolved["starts_at"] == rec["alert"]["starts_at"]
    # Every comparison after the first found rank 2, until it had its core back: raised once.
    assert all(c["found"] is None or c["found"][0] == 2 for c in comparisons)
    assert results[0]["detected"] == []


def test_four_calm_ranks_raise_no_straggler_over_many_comparisons(redis_url: str, r: Any, tmp_path: Path) -> None:
    # Two ranks to a core, as a node's ranks each have their share of it; the machine is shared with other work.
    job = StragglerJob(tmp_path, 4, redis_url, "calm-job", cores=[{0}, {0}, {1}, {1}],
                       detect={"probe_steps": 40, "probe_share": 0.2})
    try:
        job.started()
        time.sleep(30)
        job.stop()
        results = job.results()
    finally:
        job.kill()
    comparisons = results[0]["comparisons"]
    assert len(comparisons) >= 20, comparisons
    assert all(c["found"] is None for c in comparisons), [c for c in comparisons if c["found"]]
    assert entries(r, "calm-job") == []
    assert all(res["detected"] == [] for res in results)
