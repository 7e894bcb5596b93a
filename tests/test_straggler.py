"""Stragglers: the comparison of ranks' probe times, its settings, the probe, and the service's side."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import write_playbooks
from tests.support.stragglers import STRAGGLER_PLAYBOOK
from trainmedic.client.trainer.detect import DetectSettings
from trainmedic.client.trainer.straggler import NEVER, Probe, ProbeClock, Straggler, Stragglers, slowest
from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import rfc3339

JOB = "straggler-job"


def test_a_rank_slower_than_one_and_a_half_times_the_median_three_times_in_a_row_is_a_straggler() -> None:
    judge = Stragglers()
    calm = [0.0051, 0.0049, 0.0050, 0.0052]
    assert not judge.compare(calm)
    slow = [0.0051, 0.0049, 0.0050, 0.0160]
    assert [judge.compare(slow) for _ in range(3)] == [False, False, True]
    assert judge.found == Straggler(3, pytest.approx(0.0160 / 0.0051))
    assert not judge.compare(slow) and judge.found is not None and judge.found.rank == 3  # raised once
    # Back within the ratio: it resolves at once.
    assert judge.compare([0.0051, 0.0049, 0.0050, 0.0074]) and judge.found is None
    assert judge.compared == 6


def test_a_rank_slow_now_and_then_is_no_straggler() -> None:
    judge = Stragglers()
    pattern = [[0.005, 0.005, 0.005, 0.011], [0.005, 0.005, 0.005, 0.011], [0.005, 0.005, 0.005, 0.006]]
    assert not any(judge.compare(times) for times in pattern * 10)
    # Just at the ratio is within it; just above, three times, is not.
    assert not any(judge.compare([0.004, 0.004, 0.006]) for _ in range(5))
    assert [judge.compare([0.004, 0.004, 0.00601]) for _ in range(3)] == [False, False, True]


def test_non_finite_negative_or_zero_times_are_ignored() -> None:
    judge = Stragglers()
    for bad in (math.nan, math.inf, -math.inf, -0.02, 0.0):
        # The bad time is left out: rank 2 neither counts as slow nor makes the others look slow.
        assert not judge.compare([0.005, 0.005, bad, 0.005])
        assert not judge.compare([bad, 0.005, 0.005, 0.005])
    assert judge.found is None
    # An ignored time neither grows nor restarts a rank's count: two slow, one unmeasured, one slow.
    judge = Stragglers()
    times = [[0.005, 0.005, 0.02], [0.005, 0.005, 0.02], [0.005, 0.005, math.nan], [0.005, 0.005, 0.02]]
    assert [judge.compare(t) for t in times] == [False, False, False, True]
    assert judge.found is not None and judge.found.rank == 2
    # While raised, an unmeasured straggler does not resolve; only a time back within the ratio does.
    assert not judge.compare([0.005, 0.005, -1.0]) and judge.found is not None
    # One valid time alone compares with nothing.
    assert not Stragglers(after=1).compare([0.005, math.nan, -1.0])


def test_half_the_ranks_slowed_together_are_nobodys_stragglers() -> None:
    judge = Stragglers(after=1)
    # Two ranks of four on a host that got busy: the median is the upper middle time, a slowed rank's.
    assert not any(judge.compare([0.005, 0.014, 0.005, 0.015]) for _ in range(5))
    # Three of six likewise; one of three is a straggler at once (after=1).
    assert not judge.compare([0.005, 0.02, 0.005, 0.021, 0.005, 0.019])
    assert judge.compare([0.005, 0.005, 0.02]) and judge.found is not None and judge.found.rank == 2


def test_of_two_ranks_the_slower_one_is_judged_against_the_faster() -> None:
    judge = Stragglers(after=1)
    assert judge.compare([0.004, 0.0125]) and judge.found == Straggler(1, pytest.approx(3.125))


def test_of_several_slow_ranks_the_slowest_is_raised_once() -> None:
    judge = Stragglers(ratio=2.0, after=2)
    times = [0.005, 0.005, 0.005, 0.011, 0.005, 0.03]
    assert [judge.compare(times) for _ in range(3)] == [False, True, False]
    assert judge.found is not None and judge.found.rank == 5


def test_the_slowest_valid_time_is_what_the_ranks_waited_for() -> None:
    assert slowest([0.004, math.nan, 0.009, -1.0, math.inf]) == 0.009
    assert slowest([math.nan]) == 0.0


def test_straggler_settings_are_checked() -> None:
    s = DetectSettings.of({"straggler_ratio": 2, "straggler_after": 5, "probe_steps": 50, "probe_seconds": 10,
                           "probe_share": 0.01, "straggler": True})
    assert s == DetectSettings(straggler_ratio=2.0, straggler_after=5, probe_steps=50, probe_seconds=10.0,
                               probe_share=0.01)
    assert DetectSettings() == DetectSettings(straggler=True, straggler_ratio=1.5, straggler_after=3,
                                              probe_steps=300, probe_seconds=60.0, probe_share=0.005)
    bad = [({"straggler_ratio": 1}, "straggler_ratio.*above 1"), ({"straggler_ratio": math.nan}, "finite"),
           ({"probe_seconds": 0}, "probe_seconds.*above 0"), ({"probe_seconds": math.inf}, "finite"),
           ({"probe_share": 1.5}, "at most 1"), ({"probe_share": 0}, "above 0"),
           ({"straggler_after": 0}, "whole number"), ({"probe_steps": 2.5}, "whole number"),
           ({"straggler": 1}, "True or False")]
    for given, message in bad:
        with pytest.raises(ValueError, match=message):
            DetectSettings.of(given)


def test_the_probe_times_the_same_fixed_work_on_the_cpu() -> None:
    probe = Probe(torch.device("cpu"))
    times = [probe.run() for _ in range(3)]
    assert all(math.isfinite(t) and t > 0 for t in times)
    assert probe.reps * probe._a.shape[0] ** 3 * 2 == 128 * 128 ** 3 * 2  # the work is fixed, not calibrated


def test_the_clock_spaces_probes_to_keep_their_share_of_the_time() -> None:
    clock = ProbeClock(DetectSettings(probe_steps=10, probe_seconds=60.0, probe_share=0.01), 2, lambda: None)
    try:
        assert clock.every == 5  # every 10 steps, one collective in 2 steps
        assert clock.started(0) == NEVER  # no other probe until this one's times are compared
        time.sleep(0.06)  # 6 collectives in 60 ms: 10 ms each
        left = clock.compared(0.005)  # a 5 ms probe at most 1 % of the time: at least 0.5 s, 50 collectives
        assert 40 <= left <= 60, left
        clock.started(0)
        time.sleep(0.01)
        assert clock.compared(0.0) == 5  # nothing measured: back to every 10 steps
    finally:
        clock.close()


def test_the_clock_asks_for_a_probe_when_its_time_is_up_and_again_while_none_began() -> None:
    asked: list[float] = []
    begun = time.monotonic()
    clock = ProbeClock(DetectSettings(probe_seconds=1.5), 1, lambda: asked.append(time.monotonic()))
    try:
        deadline = begun + 10
        while len(asked) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(asked) >= 2 and asked[0] - begun >= 1.5 and asked[1] - asked[0] >= 0.9  # again after 1 s
        clock.started(0)
        n = len(asked)
        time.sleep(0.3)
        assert len(asked) == n  # a probe began: no more asks until its times are compared
    finally:
        clock.close()


def straggler_entry(node: str, rank: str, status: str = "firing", starts_at: str | None = None) -> dict[str, str]:
    return {"alertname": "TrainingStraggler", "status": status, "starts_at": starts_at or rfc3339(),
            "ends_at": rfc3339() if status == "resolved" else "", "step": "900", "value": "3.2",
            "label:node": node, "label:rank": rank}


def test_the_service_decides_a_straggler_for_its_node_with_the_rank(make_app: Any, r: Any, tmp_path: Path) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "straggler.yaml", STRAGGLER_PLAYBOOK)))
    detections = app.extensions["trainmedic"].reconciler.detections
    t = keys.Target("job", JOB)
    start = rfc3339()
    r.xadd(keys.detections(t), straggler_entry("gpu-b7", "3", starts_at=start))
    [out] = detections.handle(t)
    rec = app.test_client().get(f"/remediations/{out.record_id}").get_json()
    assert rec["target"] == {"kind": "node", "name": "gpu-b7"} and rec["requested_by"] == "detector"
    assert rec["alert"]["labels"] == {"alertname": "TrainingStraggler", "job_name": JOB, "node": "gpu-b7",
                                      "rank": "3", "severity": "warning", "source": "trainmedic"}
    assert "Rank 3 of job straggler-job on node gpu-b7 was 3.2 times slower" in rec["alert"]["annotations"][
        "summary"]
    r.xadd(keys.detections(t), straggler_entry("gpu-b7", "3", "resolved", start))
    detections.handle(t)


def test_a_straggler_entry_with_a_bad_node_or_rank_is_ignored(make_app: Any, r: Any, tmp_path: Path) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "straggler.yaml", STRAGGLER_PLAYBOOK)))
    detections = app.extensions["trainmedic"].reconciler.detections
    t = keys.Target("job", JOB)
    for node, rank in (("", "1"), ("../etc", "1"), ("gpu-a1", "-1"), ("gpu-a1", "01"), ("gpu-a1", "x"),
                       ("a" * 129, "1"), ("gpu-a1", "")):
        r.xadd(keys.detections(t), straggler_entry(node, rank))
    assert detections.handle(t) == []
    assert app.test_client().get("/history").get_json()["items"] == []
