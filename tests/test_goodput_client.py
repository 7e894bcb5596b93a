"""The training client's share of goodput: rank 0 counts productive, recompute and stall seconds from the steps
it is given, on a clock the test moves, and sends them with its heartbeats; close() sends a last one, closed."""
from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from trainmedic.client import RemediationClient
from trainmedic.client.trainer.goodput import SAMPLE, Accountant, stall_after
from trainmedic.client.wire import keys


class Clock:
    """A clock the test moves, and the step a loop would have given poll()."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.step: Any = None

    def __call__(self) -> float:
        return self.t


def run(acc: Accountant, clock: Clock, seconds: float, step_time: float | None, back: int = 0) -> None:
    """Move the clock through `seconds`, looking every SAMPLE as the thread does: a step each `step_time`
    (None: the step stays), after going back `back` steps first."""
    if back:
        clock.step -= back
    elapsed, since_step = 0.0, 0.0
    while elapsed < seconds - 1e-9:
        clock.t += SAMPLE
        elapsed += SAMPLE
        if step_time is not None:
            since_step += SAMPLE
            while since_step >= step_time - 1e-9:
                clock.step = 0 if clock.step is None else clock.step + 1
                since_step -= step_time
        acc.sample()


@pytest.fixture
def clocked() -> tuple[Accountant, Clock]:
    clock = Clock()
    return Accountant(3.0, lambda: clock.step, clock=clock, wall=clock), clock


def test_time_before_the_first_step_counts_in_no_kind(clocked: tuple[Accountant, Clock]) -> None:
    acc, clock = clocked
    run(acc, clock, 20, None)
    report = acc.report()
    assert (report["productive_s"], report["recompute_s"], report["stall_s"]) == (0, 0, 0)
    assert report["first_step"] is None and report["high"] is None


def test_steps_above_the_highest_are_productive(clocked: tuple[Accountant, Clock]) -> None:
    acc, clock = clocked
    run(acc, clock, 10, 0.05)
    report = acc.report()
    assert report["productive_s"] == pytest.approx(10, abs=2 * SAMPLE)
    assert report["recompute_s"] == 0 and report["stall_s"] == 0
    assert report["first_step"] == 4 and report["high"] == 199  # the first step the first look saw


def test_a_stall_counts_from_the_last_change_once_it_passes_the_threshold_and_grows_until_it_ends(
        clocked: tuple[Accountant, Clock]) -> None:
    acc, clock = clocked
    run(acc, clock, 5, 0.05)
    run(acc, clock, 2, None)
    assert acc.report()["stall_s"] == 0  # not yet past 3 s: it may be a slow step
    run(acc, clock, 10, None)
    during = acc.report()["stall_s"]
    assert during == pytest.approx(12, abs=2 * SAMPLE)
    run(acc, clock, 5, 0.05)
    report = acc.report()
    assert report["stall_s"] == pytest.approx(12, abs=2 * SAMPLE) and report["stall_s"] >= during
    assert report["productive_s"] == pytest.approx(10, abs=2 * SAMPLE)


def test_steps_after_a_rollback_are_recompute_until_the_highest_is_passed(clocked: tuple[Accountant, Clock]) -> None:
    acc, clock = clocked
    run(acc, clock, 10, 0.05)  # steps 0..199
    run(acc, clock, 8, 0.05, back=100)  # 100 steps again (5 s), then 60 new ones (3 s)
    report = acc.report()
    assert report["recompute_s"] == pytest.approx(5, abs=2 * SAMPLE)
    assert report["productive_s"] == pytest.approx(13, abs=2 * SAMPLE)
    assert report["back"] is not None and report["back"][1] == 99 + 5  # where the step went back to (and on)


def test_the_stall_threshold_is_never_less_than_three_median_steps(clocked: tuple[Accountant, Clock]) -> None:
    acc, clock = clocked
    run(acc, clock, 40, 2.0)  # a slow job: 2 s a step, so 6 s without a change is no stall yet
    assert acc.threshold() == pytest.approx(6.0, abs=0.3)
    run(acc, clock, 5, None)
    assert acc.report()["stall_s"] == 0
    run(acc, clock, 5, None)
    assert acc.report()["stall_s"] == pytest.approx(10, abs=1.0)


def test_the_totals_only_ever_grow(clocked: tuple[Accountant, Clock]) -> None:
    acc, clock = clocked
    before = {"productive_s": 0.0, "recompute_s": 0.0, "stall_s": 0.0}
    for seconds, step_time, back in ((4, 0.05, 0), (2, None, 0), (6, None, 0), (3, 0.05, 50), (2, 0.5, 0),
                                     (5, None, 0), (4, 0.05, 0)):
        for _ in range(int(seconds / SAMPLE)):
            run(acc, clock, SAMPLE, step_time, back)
            back = 0
            now = acc.report()
            assert all(now[k] >= before[k] for k in before), (now, before)
            before = {k: now[k] for k in before}


def test_close_counts_the_time_since_the_last_step_and_stops(clocked: tuple[Accountant, Clock]) -> None:
    acc, clock = clocked
    run(acc, clock, 5, 0.05)
    clock.t += 1.0
    final = acc.close()
    assert final["productive_s"] == pytest.approx(6, abs=2 * SAMPLE)
    clock.t += 100
    clock.step += 1000
    acc.sample()
    assert acc.report() == final  # a closed process counts nothing more, not even a stall


def test_a_bad_stall_setting_is_refused_in_one_sentence(redis_url: str, monkeypatch: Any) -> None:
    assert stall_after({}) == 30.0 and stall_after({"TRAINMEDIC_STALL_AFTER": "5s"}) == 5.0
    assert stall_after({"TRAINMEDIC_STALL_AFTER": "2.5"}) == 2.5
    monkeypatch.setenv("TRAINMEDIC_STALL_AFTER", "soon")
    with pytest.raises(ValueError, match=r"^RemediationClient: TRAINMEDIC_STALL_AFTER must be a positive duration"):
        RemediationClient(job="j", redis_url=redis_url, start=False)


def beat(r: redis.Redis, job: str) -> dict:
    raw = r.get(keys.heartbeat(keys.Target("job", job)))
    assert raw is not None
    return dict(json.loads(raw))


def test_rank_zero_sends_its_totals_with_the_heartbeat_and_close_sends_a_last_one_marked_closed(
        r: redis.Redis, redis_url: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("TRAINMEDIC_STALL_AFTER", "1s")
    rc = RemediationClient(job="gp-beats", redis_url=redis_url, heartbeat_interval=0.2)
    deadline = time.monotonic() + 3
    step = 0
    while time.monotonic() < deadline:
        rc.poll(step=step)
        step += 1
        time.sleep(0.01)
    time.sleep(1.6)  # a stall, the heartbeat going on
    g = beat(r, "gp-beats")["goodput"]
    assert g["productive_s"] == pytest.approx(3, abs=0.6) and g["stall_s"] >= 1.0
    assert g["first_step"] <= 30 and g["high"] >= step - 30 and len(g["run"]) == 12
    assert "closed" not in beat(r, "gp-beats")
    rc.close()
    last = beat(r, "gp-beats")
    assert last["closed"] is True and last["goodput"]["run"] == g["run"]
    assert last["goodput"]["stall_s"] == pytest.approx(1.6, abs=0.6)
    assert last["goodput"]["productive_s"] >= g["productive_s"]


def test_other_ranks_and_unstarted_clients_add_nothing_to_the_loop(redis_url: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("RANK", "1")
    rc = RemediationClient(job="gp-rank1", redis_url=redis_url, start=False)
    assert rc._goodput is None and "goodput" not in rc._heartbeat_info()
    monkeypatch.setenv("RANK", "0")
    rc0 = RemediationClient(job="gp-rank0", redis_url=redis_url, start=False)
    assert rc0._goodput is not None and rc0._goodput._thread is None  # no thread until the client starts
    assert rc0._heartbeat_info()["goodput"]["productive_s"] == 0
