"""RemediationClient against the real service and Redis: handlers, statuses, expiry, restarts, the idle path."""
from __future__ import annotations

import gc
import json
import logging
import socket
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import redis

from trainmedic.service.store import record as records
from trainmedic.client import RemediationClient
from trainmedic.client.wire import keys
from trainmedic.client.receiver.mailbox import Mailbox
from tests.support.jobs import inject, job_app, mailbox_entries, send, trigger, wait_capable, wait_record, wait_until
from tests.support.loop import Loop

JOB = "llama-ft-01"


@pytest.fixture
def loops(redis_url: str) -> Iterator[Any]:
    made: list[Loop] = []

    def make(**kw: Any) -> Loop:
        loop = Loop(redis_url, kw.pop("job", JOB), **kw)
        made.append(loop)
        return loop
    yield make
    for loop in made:
        loop.rc.close()


@pytest.fixture
def jobs_http(make_app: Any, tmp_path: Path) -> Any:
    return job_app(make_app, tmp_path).test_client()


def test_it_halves_the_lr_sent_through_the_service_and_acks_old_new_and_step(r: redis.Redis, jobs_http: Any,
                                                                             loops: Any) -> None:
    loop = loops()
    rec = trigger(jobs_http, "halve-lr", JOB)
    done = wait_record(r, rec["id"], tick=loop.tick)
    assert done["status"] == "applied"
    action = done["actions"][0]
    assert action["status"] == "applied"
    assert action["result"]["old_lr"] == [pytest.approx(0.1)]
    assert action["result"]["new_lr"] == [pytest.approx(0.05)]
    assert 1 <= action["result"]["step"] <= loop.t
    assert action["acked_by"] == f"{socket.gethostname()}:{__import__('os').getpid()}"
    assert loop.lr == pytest.approx(0.05)
    assert [a.status for a in loop.acks] == ["applied"]


def test_it_calls_a_registered_handler_with_the_params_and_records_its_result(r: redis.Redis, jobs_http: Any,
                                                                             loops: Any) -> None:
    loop = loops()
    seen: list[dict] = []

    @loop.rc.handler("reduce_batch_size")
    def shrink(params: dict) -> dict:
        seen.append(params)
        return {"batch_size": 16}

    rec = trigger(jobs_http, "free-memory", JOB)
    done = wait_record(r, rec["id"], tick=loop.tick)
    assert seen == [{"factor": 0.5, "min": 1}]
    by_action = {a["action"]: a for a in done["actions"]}
    assert by_action["reduce_batch_size"]["status"] == "applied"
    assert by_action["reduce_batch_size"]["result"]["batch_size"] == 16
    # No GPU here: empty_cache degrades to skipped, it does not fail.
    assert by_action["empty_cache"]["status"] == "skipped"
    assert by_action["empty_cache"]["result"]["cuda"] is False


def test_an_action_without_handler_is_unsupported_and_the_rest_still_runs(r: redis.Redis, jobs_http: Any,
                                                                          loops: Any) -> None:
    loop = loops()
    rec = trigger(jobs_http, "rollback-then-halve", JOB)
    done = wait_record(r, rec["id"], tick=loop.tick)
    assert [a["status"] for a in done["actions"]] == ["unsupported", "applied"]
    assert done["status"] == "partially_applied"
    # Answered by the client (no handler), or decided at once from its heartbeat when the service read it first.
    assert done["actions"][0]["reason"] in ("unsupported", "target_cannot")
    assert "rollback_checkpoint" in done["actions"][0]["result"]["message"]


def test_a_handler_that_raises_fails_its_action_and_training_goes_on(r: redis.Redis, jobs_http: Any,
                                                                     loops: Any, caplog: Any) -> None:
    loop = loops()

    @loop.rc.handler("rollback_checkpoint")
    def rollback(params: dict) -> dict:
        raise RuntimeError("no checkpoint on disk")

    wait_capable(r, JOB, "rollback_checkpoint", tick=loop.tick)
    with caplog.at_level(logging.WARNING, logger="trainmedic"):
        rec = trigger(jobs_http, "rollback-then-halve", JOB)
        done = wait_record(r, rec["id"], tick=loop.tick)
        for _ in range(20):
            loop.tick()
    assert [a["status"] for a in done["actions"]] == ["failed", "applied"]
    assert done["actions"][0]["result"]["error"] == "RuntimeError: no checkpoint on disk"
    assert loop.lr == pytest.approx(0.05)
    assert sum("no checkpoint on disk" in m for m in caplog.messages) == 1


def test_an_unknown_action_is_acked_unsupported(r: redis.Redis, loops: Any) -> None:
    loop = loops()
    rid = inject(r, keys.Target("job", JOB), [("do_a_barrel_roll", {"speed": 3})])
    done = wait_record(r, rid, tick=loop.tick)
    assert done["actions"][0]["status"] == "unsupported"
    assert done["actions"][0]["result"]["message"] == "Unknown action 'do_a_barrel_roll'."
    assert done["status"] == "failed"


def test_bad_params_fail_the_action_with_the_reason(r: redis.Redis, loops: Any) -> None:
    loop = loops()
    rid = inject(r, keys.Target("job", JOB), [("scale_lr", {"factor": 50})])
    done = wait_record(r, rid, tick=loop.tick)
    assert (done["actions"][0]["status"], done["actions"][0]["reason"]) == ("failed", "bad_params")
    assert done["actions"][0]["result"]["error"] == "Bad parameters for scale_lr: factor must be <= 10, not 50."
    assert loop.lr == pytest.approx(0.1)


def test_scale_lr_without_an_optimizer_is_unsupported(r: redis.Redis, loops: Any) -> None:
    loop = loops(optimizer=False)
    rid = send(r, JOB, "scale_lr", {"factor": 0.5})
    done = wait_record(r, rid, tick=loop.tick)
    assert done["actions"][0]["status"] == "unsupported"
    assert done["actions"][0]["result"]["message"] == "No optimizer was given to RemediationClient."


def test_set_lr_sets_it_and_the_ack_has_both_values(r: redis.Redis, loops: Any) -> None:
    loop = loops()
    rid = send(r, JOB, "set_lr", {"lr": 0.003})
    done = wait_record(r, rid, tick=loop.tick)
    assert done["actions"][0]["result"]["new_lr"] == [0.003]
    assert loop.lr == 0.003


def test_commands_sent_before_the_trainer_started_are_applied_once_it_starts(r: redis.Redis, jobs_http: Any,
                                                                             loops: Any) -> None:
    first = trigger(jobs_http, "halve-lr", JOB)
    second = trigger(jobs_http, "halve-lr", JOB)
    loop = loops()
    wait_record(r, second["id"], tick=loop.tick)
    assert wait_record(r, first["id"])["status"] == "applied"
    assert loop.lr == pytest.approx(0.025)


def test_an_expired_command_is_acked_expired_and_not_applied(r: redis.Redis, loops: Any) -> None:
    rid = send(r, JOB, "scale_lr", {"factor": 0.5}, expire_after=0.3)
    time.sleep(0.5)
    loop = loops()
    done = wait_record(r, rid, tick=loop.tick)
    assert done["actions"][0]["status"] == "expired"
    assert done["status"] == "expired"
    assert loop.lr == pytest.approx(0.1)


def test_malformed_entries_are_skipped_with_a_warning_and_later_commands_still_apply(
        r: redis.Redis, loops: Any, caplog: Any) -> None:
    stream = keys.mailbox(keys.Target("job", JOB))
    other = send(r, "someone-else", "scale_lr", {"factor": 0.5})
    r.xadd(stream, {"r": "{not an id"})
    r.xadd(stream, {"c": json.dumps({"v": 99, "record_id": "x"})})  # no record named
    r.xadd(stream, {"nothing": "here"})
    r.xadd(stream, {"r": other})  # a record of another job must not run here
    r.xadd(stream, {"r": "0" * 26})  # no such record
    with caplog.at_level(logging.WARNING, logger="trainmedic"):
        loop = loops()
        rid = send(r, JOB, "scale_lr", {"factor": 0.5})
        done = wait_record(r, rid, tick=loop.tick)
    assert done["status"] == "applied"
    assert loop.lr == pytest.approx(0.05)
    assert sum("malformed" in m for m in caplog.messages) == 4
    assert sum("unknown remediation" in m for m in caplog.messages) == 1
    # Every entry was taken (the mailbox keeps only what waits), the cursor past them all.
    last = r.xinfo_stream(stream)["last-generated-id"]
    assert mailbox_entries(r, JOB) == [] and Mailbox(r, keys.Target("job", JOB)).cursor() == last
    assert wait_record(r, other, until=lambda rec: True)["status"] == "dispatched"


def test_a_restarted_trainer_does_not_repeat_what_it_applied(r: redis.Redis, jobs_http: Any, loops: Any) -> None:
    calls: list[str] = []
    before = loops()
    before.rc.register("save_checkpoint", lambda p: calls.append("before"))
    wait_capable(r, JOB, "save_checkpoint")
    rec = trigger(jobs_http, "save", JOB)
    wait_record(r, rec["id"], tick=before.tick)
    before.rc.close()

    after = loops()
    after.rc.register("save_checkpoint", lambda p: calls.append("after"))
    for _ in range(100):  # long enough for the receiver to have read the mailbox several times
        after.tick()
    assert calls == ["before"]
    rec2 = trigger(jobs_http, "save", JOB)
    wait_record(r, rec2["id"], tick=after.tick)
    for _ in range(50):
        after.tick()
    assert calls == ["before", "after"]


def test_a_command_received_but_not_applied_before_close_goes_to_the_next_process_once(
        r: redis.Redis, jobs_http: Any, loops: Any) -> None:
    first = loops()
    rec = trigger(jobs_http, "halve-lr", JOB)
    # Received (and claimed) in the background, not applied: no poll yet.
    wait_until(lambda: first.rc._inbox.ready, what="the command received")
    first.rc.close()
    assert first.lr == pytest.approx(0.1)
    assert records.get(r, rec["id"])["actions"][0]["status"] == "pending"  # handed back, not dropped

    second = loops()
    done = wait_record(r, rec["id"], tick=second.tick)
    assert done["actions"][0]["status"] == "applied" and second.lr == pytest.approx(0.05)
    for _ in range(100):
        second.tick()
    assert second.lr == pytest.approx(0.05) and len(second.acks) == 1


def _network_calls(fn: Any) -> list[str]:
    """Every socket method and redis-py function the current thread calls while fn runs."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and isinstance(getattr(arg, "__self__", None), socket.socket):
            seen.append(f"socket.{arg.__name__}")
        elif event == "call" and frame.f_globals.get("__name__", "").startswith("redis"):
            seen.append(f"{frame.f_globals['__name__']}.{frame.f_code.co_name}")

    # Garbage of earlier tests (closed redis clients) would be finalised here otherwise: not fn's I/O.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return seen


def test_the_probe_sees_network_calls(r: redis.Redis) -> None:
    # The check below is only worth something if it can see a Redis round trip.
    assert any(c.startswith("socket.") for c in _network_calls(r.ping))


def test_an_idle_poll_does_no_network_io(r: redis.Redis, loops: Any) -> None:
    loop = loops()
    wait_until(lambda: r.exists(keys.heartbeat(keys.Target("job", JOB))), what="a heartbeat")
    calls = _network_calls(lambda: [loop.rc.poll(step=i) for i in range(20000)])
    assert calls == []


def test_a_poll_that_applies_a_command_does_no_network_io_either(r: redis.Redis, loops: Any) -> None:
    loop = loops()
    rid = send(r, JOB, "scale_lr", {"factor": 0.5})
    wait_until(lambda: loop.rc._inbox.ready, what="the command received")
    acks: list = []
    calls = _network_calls(lambda: acks.extend(loop.rc.poll(step=7)))
    assert calls == []
    assert [a.status for a in acks] == ["applied"] and acks[0].result["step"] == 7
    assert wait_record(r, rid)["status"] == "applied"  # the ack thread sent it


def test_the_heartbeat_shows_the_job_on_get_targets(r: redis.Redis, jobs_http: Any, loops: Any) -> None:
    loop = loops()
    for _ in range(5):
        loop.tick()

    def shown() -> bool:
        items = [t for t in jobs_http.get("/targets").get_json()["targets"] if t["name"] == JOB]
        return bool(items) and items[0].get("step") == 5

    wait_until(shown, what="the job on /targets")
    item = next(t for t in jobs_http.get("/targets").get_json()["targets"] if t["name"] == JOB)
    assert item["kind"] == "job"
    assert item["host"] == socket.gethostname()
    assert item["pid"] == __import__("os").getpid()
    assert item["ranks"] == 1
    assert item["lr"] == [pytest.approx(0.1)]
    assert item["age_seconds"] < 5


def test_poll_never_raises_even_when_applying_blows_up(loops: Any, caplog: Any) -> None:
    loop = loops(start=False)
    loop.rc.optimizer = object()  # not an optimizer at all: scale_lr fails inside

    from trainmedic.client.receiver.mailbox import Entry
    from trainmedic.client.wire.protocol import ActionCall, Command

    cmd = Command(f"{'0' * 26}~job~{JOB}", "job", JOB, (ActionCall(0, "scale_lr", {"factor": 0.5}),),
                  time.time(), time.time() + 60)
    loop.rc._inbox.ready.append(Entry("1-0", cmd))
    acks = loop.rc.poll(step=3)
    assert [a.status for a in acks] == ["failed"]


@pytest.mark.parametrize("kw", [{"job": "bad name"}, {"job": ""}, {"sync_every": 0}, {"redis_url": "http://x"}])
def test_it_refuses_bad_arguments_at_construction(redis_url: str, kw: dict, monkeypatch: Any) -> None:
    monkeypatch.delenv("TRAINMEDIC_JOB", raising=False)
    args = {"job": JOB, "redis_url": redis_url, "start": False, **kw}
    with pytest.raises(ValueError):
        RemediationClient(**args)


def test_the_job_and_url_come_from_the_environment(redis_url: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("TRAINMEDIC_JOB", "from-env")
    monkeypatch.setenv("TRAINMEDIC_REDIS_URL", redis_url)
    with RemediationClient(start=False) as rc:
        assert rc.job == "from-env" and rc.url == redis_url


def test_poll_from_two_threads_applies_every_command_exactly_once(r: redis.Redis, loops: Any) -> None:
    import threading

    loop = loops()
    done: list[str] = []
    loop.rc.register("save_checkpoint", lambda params: done.append("saved") or {"ok": True})
    wait_capable(r, JOB, "save_checkpoint")
    ids = [send(r, JOB, "save_checkpoint") for _ in range(200)]
    stop = threading.Event()

    def poll_forever() -> None:
        while not stop.is_set():
            loop.rc.poll()

    threads = [threading.Thread(target=poll_forever) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: all(records.get(r, rid)["status"] == "applied" for rid in ids), timeout=120,
                   what="every command applied")
    finally:
        stop.set()
        for t in threads:
            t.join(5)
    assert len(done) == 200


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()], ids=["SystemExit", "KeyboardInterrupt"])
def test_a_handler_that_raises_system_exit_acks_failed_stops_the_loop_and_loses_nothing_behind_it(
        r: redis.Redis, loops: Any, exc: BaseException) -> None:
    first = loops()
    first.rc.register("stop_training", lambda params: (_ for _ in ()).throw(exc))
    wait_capable(r, JOB, "stop_training")
    stop = send(r, JOB, "stop_training")
    behind = send(r, JOB, "scale_lr", {"factor": 0.5})
    # Both received before the loop's next poll: the stop first, the LR change queued behind it.
    wait_until(lambda: len(first.rc._inbox.ready) == 2, what="both commands received")
    with pytest.raises(type(exc)) as exited:
        first.tick()
    assert exited.value is exc  # the user's own stop (or Ctrl-C) still works
    first.rc.close()
    rec = wait_record(r, stop, until=lambda x: x is not None and x["status"] == "failed")
    assert rec["actions"][0]["result"]["error"] == f"The handler stopped the process ({type(exc).__name__})."
    assert first.lr == pytest.approx(0.1)
    second = loops()  # the next process of the job gets the command that was behind the stop
    done = wait_record(r, behind, tick=second.tick)
    assert done["status"] == "applied" and second.lr == pytest.approx(0.05)


def test_poll_from_two_threads_drops_nothing_from_a_queue_of_a_hundred_thousand(redis_url: str) -> None:
    import threading

    import collections

    from trainmedic.client.receiver.mailbox import Entry
    from trainmedic.client.wire.protocol import ActionCall, Command

    rc = RemediationClient(job=JOB, redis_url=redis_url, start=False)  # no threads: only the hot path
    count, lock = [0], threading.Lock()

    def handler(params: dict) -> dict:
        with lock:
            count[0] += 1
        return {}

    rc.register("save_checkpoint", handler)

    class Yielding(collections.deque):  # type: ignore[type-arg]
        """The ready queue, yielding the GIL between "is there anything?" and popleft(): the race, every time."""

        def __bool__(self) -> bool:
            answer = len(self) > 0
            time.sleep(0)  # another thread may take the last item before this answer is acted on
            return answer

    rc._ready = Yielding()
    far = time.time() + 3600
    done = threading.Event()

    def receive() -> None:  # as the receiver thread does: one command at a time, while the loop polls
        for i in range(100_000):
            cmd = Command(f"{i:026d}~job~{JOB}", "job", JOB, (ActionCall(0, "save_checkpoint"),), 0.0, far)
            rc._ready.append(Entry(f"{i}-0", cmd))
        done.set()

    def loop() -> None:
        while not (done.is_set() and not rc._ready):
            rc.poll()

    threads = [threading.Thread(target=f) for f in (receive, loop, loop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert count[0] == 100_000 and not rc._ready
    rc._inbox = None  # never started: nothing to close


def test_a_handler_is_registered_only_for_a_catalogue_action_of_its_own_kind(redis_url: str) -> None:
    rc = RemediationClient(job=JOB, redis_url=redis_url, start=False)
    try:
        with pytest.raises(ValueError, match=r"unknown action 'scael_lr' \(known: "):
            rc.register("scael_lr", lambda params: {})
        with pytest.raises(ValueError, match="power_limit runs on a node, not on a job"):
            rc.register("power_limit", lambda params: {})
        rc.register("reduce_batch_size", lambda params: {"batch_size": 16})
        assert "reduce_batch_size" in rc.applier.actions() and "scael_lr" not in rc.applier.actions()
    finally:
        rc.close()
