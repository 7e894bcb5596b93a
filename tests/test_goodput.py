"""The service's share of goodput: heartbeats folded into each job's account on a clock the test sets (processes,
down time, the job's highest step across processes, bad input), and the accounts as /metrics shows them."""
from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from trainmedic.client.wire import keys
from trainmedic.service import goodput, goodput_metrics
from trainmedic.service.job_account import Account, Phase

from tests.support.keyspaces import BOTH

T0 = 1_800_000_000.0


def job(name: str) -> keys.Target:
    return keys.Target("job", name)


@dataclass
class Proc:
    """One training process of a job as its heartbeats describe it (what client/trainer/goodput.py reports)."""

    name: str
    started: float
    run: str = field(default_factory=lambda: secrets.token_hex(6))
    productive: float = 0.0
    recompute: float = 0.0
    stall: float = 0.0
    first: int | None = None
    high: int | None = None
    step: int | None = None
    back: list[float] | None = None

    def steps(self, to: int, seconds: float, kind: str = "productive") -> None:
        """The process moved to step `to` over `seconds`, counted as `kind`."""
        setattr(self, kind, getattr(self, kind) + seconds)
        self.first = to if self.first is None else self.first
        self.high = to if self.high is None else max(self.high, to)
        self.step = to

    def beat(self, t: float, closed: bool = False, **goodput_overrides: Any) -> dict[str, Any]:
        g = {"run": self.run, "started": self.started, "productive_s": self.productive,
             "recompute_s": self.recompute, "stall_s": self.stall, "first_step": self.first, "high": self.high,
             "back": self.back, **goodput_overrides}
        return {"kind": "job", "name": self.name, "step": self.step, "last_seen": t, "goodput": g,
                **({"closed": True} if closed else {})}


def fold(r: redis.Redis, now: float, *beats: tuple[str, dict[str, Any] | None]) -> None:
    goodput.fold(r, [(job(name), b) for name, b in beats], now)


def account(r: redis.Redis, name: str) -> Account:
    acc = Account.decode(r.get(keys.goodput(job(name))))
    assert acc is not None
    return acc


def test_a_job_adds_each_heartbeat_and_its_wall_time_runs_to_now(r: redis.Redis) -> None:
    p = Proc("j", T0)
    fold(r, T0 + 0.1, ("j", p.beat(T0)))
    p.steps(100, 5)
    fold(r, T0 + 5.1, ("j", p.beat(T0 + 5)))
    p.steps(100, 4, "stall")
    p.steps(150, 1)
    fold(r, T0 + 10.1, ("j", p.beat(T0 + 10)))
    f = account(r, "j").figures(T0 + 12)
    assert (f.live, f.productive, f.stall, f.recompute, f.down) == (True, 6, 4, 0, 0)
    assert f.wall == pytest.approx(12) and f.goodput == pytest.approx(0.5)
    fold(r, T0 + 10.5, ("j", p.beat(T0 + 10)))  # the same heartbeat again adds nothing
    assert account(r, "j").figures(T0 + 12) == f


def test_goodput_is_null_before_the_first_step(r: redis.Redis) -> None:
    p = Proc("j", T0)
    fold(r, T0 + 5, ("j", p.beat(T0 + 5)))
    f = account(r, "j").figures(T0 + 6)
    assert f.goodput is None and f.wall == pytest.approx(6)


@BOTH
def test_a_process_that_ends_without_close_starts_down_time_until_the_next_one_begins(r: redis.Redis) -> None:
    a = Proc("j", T0)
    a.steps(500, 10)
    fold(r, T0 + 10, ("j", a.beat(T0 + 10)))
    fold(r, T0 + 41, ("j", None))  # its heartbeat expired: it stopped without close()
    acc = account(r, "j")
    assert acc.phase == Phase.GONE and acc.figures(T0 + 50).down == pytest.approx(40)
    assert acc.figures(T0 + 50).live and not acc.figures(T0 + 71).live  # live a minute after its last heartbeat
    assert r.zscore(keys.GOODPUT_DOWN, "j") is not None and r.zscore(keys.GOODPUT_JOBS, "l:j") is not None
    fold(r, T0 + 75)  # nobody gives its heartbeat any more: fold still moves it out of the live jobs
    assert r.zscore(keys.GOODPUT_JOBS, "n:j") is not None and r.zscore(keys.GOODPUT_JOBS, "l:j") is None
    b = Proc("j", T0 + 90)
    fold(r, T0 + 90.5, ("j", b.beat(T0 + 90)))
    b.steps(400, 10, "recompute")
    fold(r, T0 + 100.5, ("j", b.beat(T0 + 100)))
    f = account(r, "j").figures(T0 + 100)
    assert f.down == pytest.approx(80) and f.wall == pytest.approx(100)
    assert (f.productive, f.recompute) == (10, 10) and f.live
    assert r.zscore(keys.GOODPUT_DOWN, "j") is None


def test_down_time_stops_growing_after_a_day(r: redis.Redis) -> None:
    a = Proc("j", T0)
    a.steps(5, 10)
    fold(r, T0 + 10, ("j", a.beat(T0 + 10)))
    fold(r, T0 + 41, ("j", None))
    assert account(r, "j").figures(T0 + 10 + 3 * 86400).down == pytest.approx(86400)
    b = Proc("j", T0 + 5 * 86400)
    fold(r, T0 + 5 * 86400, ("j", b.beat(T0 + 5 * 86400)))
    assert account(r, "j").figures(T0 + 5 * 86400).down == pytest.approx(86400)


def test_after_close_the_time_until_the_next_process_is_not_counted(r: redis.Redis) -> None:
    a = Proc("j", T0)
    a.steps(100, 10)
    fold(r, T0 + 10, ("j", a.beat(T0 + 10, closed=True)))
    acc = account(r, "j")
    assert acc.phase == Phase.CLOSED and not acc.figures(T0 + 20).live
    assert acc.figures(T0 + 3600).wall == pytest.approx(10) and r.zscore(keys.GOODPUT_JOBS, "n:j") is not None
    b = Proc("j", T0 + 3600)
    b.steps(200, 10)
    fold(r, T0 + 3610, ("j", b.beat(T0 + 3610)))
    f = account(r, "j").figures(T0 + 3610)
    assert (f.wall, f.productive, f.down) == (20, 20, 0)


def test_what_a_resumed_process_did_below_the_jobs_highest_step_is_recompute(r: redis.Redis) -> None:
    a = Proc("j", T0)
    a.steps(1000, 10)
    fold(r, T0 + 10, ("j", a.beat(T0 + 10, closed=True)))
    b = Proc("j", T0 + 20)  # resumed from step 600: 400 steps again, then 200 new ones, at the same pace
    b.first = b.high = b.step = 600
    b.steps(1200, 6)
    fold(r, T0 + 26, ("j", b.beat(T0 + 26)))
    f = account(r, "j").figures(T0 + 26)
    assert f.recompute == pytest.approx(4) and f.productive == pytest.approx(12)
    assert account(r, "j").high == 1200
    b.steps(1300, 1)
    fold(r, T0 + 27, ("j", b.beat(T0 + 27)))
    assert account(r, "j").figures(T0 + 27).productive == pytest.approx(13)  # past the highest: all productive


def test_a_resumed_process_whose_first_heartbeat_came_before_its_first_step_is_corrected_too(
        r: redis.Redis) -> None:
    a = Proc("j", T0)
    a.steps(1000, 10)
    fold(r, T0 + 10, ("j", a.beat(T0 + 10, closed=True)))
    b = Proc("j", T0 + 20)
    fold(r, T0 + 20, ("j", b.beat(T0 + 20)))  # made, not yet stepping
    b.first = b.high = b.step = 600
    b.steps(1200, 6)
    fold(r, T0 + 27, ("j", b.beat(T0 + 27)))
    f = account(r, "j").figures(T0 + 27)
    assert f.recompute == pytest.approx(4) and f.productive == pytest.approx(12)


def test_a_process_whose_heartbeats_come_back_keeps_its_own_time_and_no_down(r: redis.Redis) -> None:
    a = Proc("j", T0)
    a.steps(100, 10)
    fold(r, T0 + 10, ("j", a.beat(T0 + 10)))
    fold(r, T0 + 45, ("j", None))  # its Redis was out of reach: the heartbeat expired
    assert account(r, "j").figures(T0 + 60).down == pytest.approx(50)
    a.steps(700, 60)
    fold(r, T0 + 70, ("j", a.beat(T0 + 70)))
    f = account(r, "j").figures(T0 + 70)
    assert (f.down, f.productive, f.wall) == (0, 70, 70)


def test_bad_heartbeats_are_ignored_or_clamped_and_each_kind_is_logged_once(r: redis.Redis, caplog: Any) -> None:
    caplog.set_level(logging.WARNING, "trainmedic.goodput")
    p = Proc("j", T0)
    p.steps(100, 10)
    fold(r, T0 + 10, ("j", p.beat(T0 + 10)))
    for t, bad in ((T0 + 11, {"productive_s": 5.0}), (T0 + 12, {"productive_s": 4.0}),  # backwards
                   (T0 + 13, {"productive_s": -1.0}), (T0 + 14, {"stall_s": math.nan}),  # negative, NaN
                   (T0 + 15, {"recompute_s": math.inf}), (T0 + 16, {"productive_s": "10"})):
        fold(r, t, ("j", p.beat(t, **bad)))
    assert account(r, "j").productive == 10
    fold(r, T0 + 17, ("j", p.beat(T0 + 17, stall_s=1000.0)))  # more than its 17 s: clamped to them
    f = account(r, "j").figures(T0 + 17)
    assert f.productive + f.stall + f.recompute <= f.wall + 1e-6 and f.stall < 17
    old = Proc("j", T0 - 100)  # an older process than the job's latest, still heartbeating
    old.steps(50, 1000)
    fold(r, T0 + 18, ("j", old.beat(T0 + 18)))
    assert account(r, "j").run == p.run and account(r, "j").high == 100
    for t in (T0 + 19, T0 + 20):  # each kind again: no new line
        fold(r, t, ("j", p.beat(t, productive_s=1.0)))
        fold(r, t + 0.5, ("j", old.beat(t + 0.5)))
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) == 4, lines
    assert all("heartbeat of job j" in line for line in lines)
    for words in ("went backwards", "not finite", "exceed its process's time", "older than the job's latest"):
        assert sum(words in line for line in lines) == 1, (words, lines)


def test_a_job_name_that_fails_the_target_rule_never_reaches_a_key(r: redis.Redis) -> None:
    for name in ("../x", "a b", "", "x" * 129, "{job:y}"):
        p = Proc(name, T0)
        p.steps(5, 5)
        goodput.fold(r, [(keys.Target("job", name), p.beat(T0 + 5))], T0 + 5)
    goodput.fold(r, [(keys.Target("node", "n1"), Proc("n1", T0).beat(T0 + 5))], T0 + 5)
    assert r.zcard(keys.GOODPUT_JOBS) == 0 and not list(r.scan_iter(match="trainmedic:goodput:{*"))


def test_an_account_that_does_not_parse_is_replaced(r: redis.Redis) -> None:
    r.set(keys.goodput(job("j")), "not an account")
    p = Proc("j", T0)
    p.steps(10, 5)
    fold(r, T0 + 5, ("j", p.beat(T0 + 5)))
    assert account(r, "j").productive == 5


def test_accounts_expire_after_30_days_and_leave_the_index(r: redis.Redis) -> None:
    for name in ("a", "b", "c"):
        p = Proc(name, T0)
        p.steps(1, 1)
        fold(r, T0 + 1, (name, p.beat(T0 + 1, closed=True)))
    ttl = r.pttl(keys.goodput(job("a")))
    assert 29.9 * 86400_000 < ttl <= 30 * 86400_000
    r.delete(keys.goodput(job("b")))  # as its TTL would
    fold(r, T0 + 2)
    assert r.zrange(keys.GOODPUT_JOBS, 0, -1) == ["n:a", "n:c"]


@BOTH
def test_metrics_show_each_live_and_down_job_and_leave_closed_ones_out(r: redis.Redis) -> None:
    live, down, closed = Proc("live-1", T0), Proc("down.1", T0), Proc("closed_1", T0)
    for p, kind in ((live, "productive"), (down, "stall"), (closed, "productive")):
        p.steps(10, 8, kind)
    fold(r, T0 + 10, ("live-1", live.beat(T0 + 10)), ("down.1", down.beat(T0 + 10)),
         ("closed_1", closed.beat(T0 + 10, closed=True)))
    fold(r, T0 + 45, ("live-1", live.beat(T0 + 44)), ("down.1", None))
    text = goodput_metrics.metrics_text(r, T0 + 45).decode()
    samples = {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[0] != "#")}
    assert samples == {
        'trainmedic_job_goodput_ratio{job_name="live-1"}': 0.1778,
        # Live still: its process heartbeated within the last minute (not for long: it ended without close()).
        'trainmedic_job_goodput_ratio{job_name="down.1"}': 0,
        'trainmedic_job_seconds_total{job_name="down.1",kind="down"}': 35,
        'trainmedic_job_seconds_total{job_name="down.1",kind="productive"}': 0,
        'trainmedic_job_seconds_total{job_name="down.1",kind="recompute"}': 0,
        'trainmedic_job_seconds_total{job_name="down.1",kind="stall"}': 8,
        'trainmedic_job_seconds_total{job_name="live-1",kind="down"}': 0,
        'trainmedic_job_seconds_total{job_name="live-1",kind="productive"}': 8,
        'trainmedic_job_seconds_total{job_name="live-1",kind="recompute"}': 0,
        'trainmedic_job_seconds_total{job_name="live-1",kind="stall"}': 0,
    }
    assert "# TYPE trainmedic_job_goodput_ratio gauge" in text and "# TYPE trainmedic_job_seconds_total counter" in text
    fold(r, T0 + 75, ("live-1", live.beat(T0 + 74)))
    later = goodput_metrics.metrics_text(r, T0 + 75).decode()
    assert 'ratio{job_name="down.1"}' not in later and 'total{job_name="down.1",kind="down"} 65.0\n' in later
    # An account that cannot be copied as it is (a repair in progress) costs only its own series.
    r.set(keys.goodput(job("down.1")), "garbage")
    again = goodput_metrics.metrics_text(r, T0 + 45).decode()
    assert 'job_name="down.1"' not in again and 'trainmedic_job_goodput_ratio{job_name="live-1"} 0.1778' in again


def test_the_down_counter_never_goes_back_when_the_next_process_began_a_little_earlier(r: redis.Redis) -> None:
    a = Proc("j", T0)
    a.steps(10, 10)
    fold(r, T0 + 10, ("j", a.beat(T0 + 10)))
    fold(r, T0 + 41, ("j", None))
    fold(r, T0 + 60, ("j", None))
    shown = account(r, "j").figures(T0 + 60).down
    b = Proc("j", T0 + 55)  # its clock is a few seconds behind the service's
    fold(r, T0 + 61, ("j", b.beat(T0 + 56)))
    assert account(r, "j").figures(T0 + 61).down >= shown


@BOTH
def test_a_pass_reads_only_heartbeats_of_sound_job_names_and_parses_only_new_ones(r: redis.Redis) -> None:
    import time

    from trainmedic.client.receiver.mailbox import Mailbox
    from trainmedic.service.beats import announce

    now = time.time()
    p = Proc("good", now - 10)
    p.steps(50, 5)
    Mailbox(r, job("good")).heartbeat(p.beat(now))
    announce(r, [job("good")], now)  # what the service does when it hears the job announce itself
    # What a job's own Redis user could put among the live jobs: a label no job may have.
    r.zadd(keys.live("job"), {"job:../../x": int((now + 30) * 1000), "job:a}b": int((now + 30) * 1000)})
    goodput.fold_known(r, now + 0.1)
    assert account(r, "good").productive == 5
    assert sorted(r.scan_iter(match="trainmedic:goodput:*")) == [keys.GOODPUT_JOBS, keys.GOODPUT_SEQ,
                                                                 keys.GOODPUT_SWEEP, keys.goodput(job("good"))]
    beats, _ = goodput.beats_of_known_jobs(r, now + 1)
    assert [(t.name, b is goodput.FOLDED) for t, b in beats] == [("good", True)]  # folded: not parsed again
    p.steps(80, 3)
    time.sleep(0.1)  # the next heartbeat (its time is the clock's when it is written)
    Mailbox(r, job("good")).heartbeat(p.beat(now + 3))
    beats, _ = goodput.beats_of_known_jobs(r, now + 3.1)
    assert beats[0][1] is not goodput.FOLDED and beats[0][1]["goodput"]["productive_s"] == 8
    goodput.fold_known(r, now + 3.1)
    assert account(r, "good").productive == 8


def test_the_service_metrics_carry_the_goodput_series(r: redis.Redis, http: Any) -> None:
    import time

    now = time.time()
    p = Proc("scraped", now - 30)
    p.steps(100, 20)
    fold(r, now, ("scraped", p.beat(now - 1)))
    text = http.get("/metrics").get_data(as_text=True)
    assert 'trainmedic_job_seconds_total{job_name="scraped",kind="productive"} 20.0\n' in text
    assert 'trainmedic_job_goodput_ratio{job_name="scraped"} 0.' in text
