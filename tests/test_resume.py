"""Sticky changes survive a resume: a checkpoint from before a scale_lr gets it again, one from after does not."""
from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import redis

from trainmedic.client.wire import keys
from trainmedic.service.store import record as records

from tests.support.jobs import send, wait_until
from tests.support.loop import Loop

JOB = "resumed-job"


def checkpoint(loop: Loop) -> dict:
    """What a training script saves: optimizer, scheduler and the client's state."""
    return copy.deepcopy({"opt": loop.opt.state_dict(), "sched": loop.sched.state_dict(),
                          "trainmedic": loop.rc.state_dict()})


def resume(url: str, ckpt: dict) -> Loop:
    """A new process started from a checkpoint."""
    loop = Loop(url, JOB)
    loop.opt.load_state_dict(ckpt["opt"])
    loop.sched.load_state_dict(ckpt["sched"])
    loop.rc.load_state_dict(ckpt["trainmedic"])
    return loop


def test_a_resume_from_before_a_change_applies_it_again_and_one_from_after_does_not(r: redis.Redis,
                                                                                     redis_url: str) -> None:
    first = Loop(redis_url, JOB)
    try:
        first.run_for(0.3)
        before = checkpoint(first)
        rid = send(r, JOB, "scale_lr", {"factor": 0.5})
        wait_until(lambda: records.get(r, rid)["status"] == "applied", tick=first.tick, what="the first apply")
        first.run_for(0.2)
        after = checkpoint(first)
    finally:
        first.rc.close()
    assert first.lr == pytest.approx(0.05)
    assert r.llen(keys.ledger(keys.Target("job", JOB))) == 1

    early = resume(redis_url, before)
    try:
        assert early.lr == pytest.approx(0.1)  # the checkpoint predates the change
        t0 = time.monotonic()
        wait_until(lambda: early.lr == pytest.approx(0.05), tick=early.tick, what="the change applied again")
        assert time.monotonic() - t0 < 8  # read in the background, normally within a second
        early.run_for(0.5)
        assert early.lr == pytest.approx(0.05)  # once: the ledger's entry is now in this run's state
        assert early.slowest < 0.25  # poll() never waited for the read (its network timeout is 0.5 s)
        again = checkpoint(early)
    finally:
        early.rc.close()
    [entry] = records.get(r, rid)["actions"][0]["reapplied"]
    assert entry["by"] == early.rc.identity and entry["step"] is not None

    late = resume(redis_url, after)
    try:
        assert late.lr == pytest.approx(0.05)
        late.run_for(1.0)  # long enough for the ledger to have been read
        assert late.lr == pytest.approx(0.05)  # the checkpoint has it: never applied again
    finally:
        late.rc.close()
    assert len(records.get(r, rid)["actions"][0]["reapplied"]) == 1

    # A checkpoint taken after the re-application holds it too.
    last = resume(redis_url, again)
    try:
        last.run_for(1.0)
        assert last.lr == pytest.approx(0.05)
    finally:
        last.rc.close()


def test_changes_are_applied_again_in_their_order(r: redis.Redis, redis_url: str) -> None:
    first = Loop(redis_url, JOB)
    try:
        before = checkpoint(first)
        for action, params in (("scale_lr", {"factor": 0.5}), ("set_lr", {"lr": 0.02}), ("scale_lr", {"factor": 0.5})):
            rid = send(r, JOB, action, params)
            wait_until(lambda rid=rid: records.get(r, rid)["status"] == "applied", tick=first.tick, what=action)
    finally:
        first.rc.close()
    assert first.lr == pytest.approx(0.01)
    resumed = resume(redis_url, before)
    try:
        wait_until(lambda: resumed.lr == pytest.approx(0.01), tick=resumed.tick, what="all three applied again")
        resumed.run_for(0.5)
        assert resumed.lr == pytest.approx(0.01)
    finally:
        resumed.rc.close()


def test_a_fresh_start_without_a_restored_state_applies_nothing_from_the_ledger(r: redis.Redis,
                                                                                redis_url: str) -> None:
    first = Loop(redis_url, JOB)
    try:
        rid = send(r, JOB, "scale_lr", {"factor": 0.5})
        wait_until(lambda: records.get(r, rid)["status"] == "applied", tick=first.tick, what="the apply")
    finally:
        first.rc.close()
    fresh = Loop(redis_url, JOB)  # a new run of the same job name, not a resume
    try:
        fresh.run_for(1.0)
        assert fresh.lr == pytest.approx(0.1)
    finally:
        fresh.rc.close()


def test_a_damaged_state_is_refused_in_one_sentence(redis_url: str) -> None:
    loop = Loop(redis_url, JOB)
    try:
        with pytest.raises(ValueError, match="not a trainmedic client state"):
            loop.rc.load_state_dict({"something": "else"})
    finally:
        loop.rc.close()


def test_state_dict_is_plain_json(redis_url: str, r: Any) -> None:
    import json

    loop = Loop(redis_url, JOB)
    try:
        rid = send(r, JOB, "scale_lr", {"factor": 0.5})
        wait_until(lambda: records.get(r, rid)["status"] == "applied", tick=loop.tick, what="the apply")
        state = loop.rc.state_dict()
    finally:
        loop.rc.close()
    assert json.loads(json.dumps(state)) == state
    assert state["commands"][0][0] == rid
