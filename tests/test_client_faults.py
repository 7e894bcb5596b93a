"""A client that survives anything: Redis down at start, killed and restarted, a hanging network, bad commands."""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import redis

from trainmedic.client.wire import keys, scripts
from trainmedic.service.embedded_redis import EmbeddedRedis, free_port
from tests.support.jobs import inject, send, trigger, job_app, wait_record, wait_until
from tests.support.loop import Loop

JOB = "fragile-job"
# A poll that touched the network would wait for a timeout (>= 0.5 s here); a loaded machine's scheduler or a
# full GC can stall any one poll for tens of milliseconds.
POLL_BOUND = 0.25


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A redis-server of this test alone, persistent (AOF fsync'd on every write) so it survives a kill."""
    server = EmbeddedRedis(tmp_path / "redis", port=free_port(), appendonly=True,
                           extra_args=("--appendfsync", "always"))
    yield server
    server.stop()


@pytest.fixture
def loops() -> Iterator[Any]:
    made: list[Loop] = []

    def make(url: str, **kw: Any) -> Loop:
        made.append(Loop(url, JOB, **kw))
        return made[-1]
    yield make
    for loop in made:
        loop.rc.close()


def outage_warnings(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "unreachable" in r.getMessage()]


def test_redis_down_at_start_then_up_applies_what_was_sent(own_redis: EmbeddedRedis, loops: Any,
                                                           caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger="trainmedic"):
        loop = loops(own_redis.url)
        loop.run_for(1.0)  # no Redis at all yet
        assert loop.t > 50 and loop.slowest < POLL_BOUND
        assert len(outage_warnings(caplog)) == 1
        own_redis.start()
        r = redis.Redis.from_url(own_redis.url, decode_responses=True)
        rid = send(r, JOB, "scale_lr", {"factor": 0.5})
        done = wait_record(r, rid, tick=loop.tick)
        loop.run_for(0.3)
    assert done["status"] == "applied"
    assert loop.lr == pytest.approx(0.05)
    assert len(outage_warnings(caplog)) == 1
    assert any("reachable again" in m for m in caplog.messages)
    assert loop.slowest < POLL_BOUND
    r.close()


def test_redis_killed_and_restarted_mid_run(own_redis: EmbeddedRedis, loops: Any, caplog: Any,
                                            make_app: Any, tmp_path: Path) -> None:
    own_redis.start()
    app_r = redis.Redis.from_url(own_redis.url, decode_responses=True)
    with caplog.at_level(logging.INFO, logger="trainmedic"):
        # The service, on this test's own Redis.
        http = job_app(lambda **kw: make_app(**{**kw, "redis_url": own_redis.url}), tmp_path).test_client()
        loop = loops(own_redis.url)
        first = trigger(http, "halve-lr", JOB)
        wait_record(app_r, first["id"], tick=loop.tick)
        assert loop.lr == pytest.approx(0.05)

        # A command received just before the crash is applied during the outage; its ack waits.
        during = trigger(http, "halve-lr", JOB)
        wait_until(lambda: loop.rc._inbox.ready, what="the command received")
        own_redis.proc.kill()  # SIGKILL: a crash, not a shutdown
        own_redis.proc.wait()
        loop.run_for(1.5)
        assert loop.lr == pytest.approx(0.025)
        assert len(outage_warnings(caplog)) == 1  # one line for the outage, not one per step or retry

        own_redis.start()  # same port, same data folder: the AOF brings back records and the cursor
        after = trigger(http, "quarter-lr", JOB)
        wait_record(app_r, after["id"], tick=loop.tick)
        assert wait_record(app_r, during["id"], tick=loop.tick)["status"] == "applied"
        loop.run_for(0.5)

    assert loop.lr == pytest.approx(0.025 * 0.25)  # the first command was not replayed after the restart
    assert [a.record_id for a in loop.acks] == [first["id"], during["id"], after["id"]]
    assert len(outage_warnings(caplog)) == 1
    assert loop.slowest < POLL_BOUND
    app_r.close()


class HangingProxy:
    """A TCP proxy to Redis that can stop forwarding (a network partition: connections hang, nothing fails)."""

    def __init__(self, upstream_port: int):
        self.upstream = ("127.0.0.1", upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.forwarding = threading.Event()
        self.forwarding.set()
        self.closed = threading.Event()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=2)
            except OSError:
                client.close()
                continue
            self.socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while not self.closed.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.05)
                if not self.forwarding.is_set():
                    continue  # hold everything: the peer sees a connection that never answers
                for src in ready:
                    data = src.recv(65536)
                    if not data:
                        return
                    (b if src is a else a).sendall(data)
        except OSError:
            pass
        finally:
            a.close()
            b.close()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


def test_a_hanging_connection_does_not_slow_training_and_commands_arrive_after(
        r: redis.Redis, redis_url: str, loops: Any, caplog: Any) -> None:
    proxy = HangingProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    try:
        with caplog.at_level(logging.INFO, logger="trainmedic"):
            loop = loops(proxy.url)
            before = send(r, JOB, "scale_lr", {"factor": 0.5})
            wait_record(r, before, tick=loop.tick)

            proxy.forwarding.clear()  # partition: bytes go in, nothing comes back
            sent_during = send(r, JOB, "scale_lr", {"factor": 0.5})
            loop.run_for(2.0)
            assert loop.lr == pytest.approx(0.05)  # not received: the client cannot see Redis
            wait_until(lambda: outage_warnings(caplog), timeout=10, tick=loop.tick, what="the outage warning")
            assert len(outage_warnings(caplog)) == 1
            assert "Timeout" in outage_warnings(caplog)[0]

            proxy.forwarding.set()
            done = wait_record(r, sent_during, tick=loop.tick)
            loop.run_for(0.3)
        assert done["status"] == "applied"
        assert loop.lr == pytest.approx(0.025)
        assert len(outage_warnings(caplog)) == 1
        assert loop.slowest < POLL_BOUND
    finally:
        proxy.close()


class CuttingProxy(HangingProxy):
    """A TCP proxy to Redis that forwards the first request holding `cut_on`, then closes that connection before
    its answer comes back (the reply lost with a connection that broke)."""

    def __init__(self, upstream_port: int, cut_on: bytes):
        self.cut_on = cut_on
        self.cut = threading.Event()
        super().__init__(upstream_port)

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while not self.closed.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.05)
                for src in ready:
                    data = src.recv(65536)
                    if not data:
                        return
                    (b if src is a else a).sendall(data)
                    if src is a and self.cut_on in data and not self.cut.is_set():
                        self.cut.set()
                        time.sleep(0.3)  # Redis runs it; its answer never reaches the client
                        return
        except OSError:
            pass
        finally:
            a.close()
            b.close()


def test_a_claim_whose_answer_was_lost_is_asked_again_and_the_command_applied_once(
        r: redis.Redis, redis_url: str, loops: Any) -> None:
    proxy = CuttingProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]), scripts.script("claim").sha.encode())
    try:
        loop = loops(proxy.url)
        rid = send(r, JOB, "scale_lr", {"factor": 0.5})
        rec = wait_record(r, rid, tick=loop.tick)
        loop.run_for(0.5)
    finally:
        proxy.close()
    assert proxy.cut.is_set()  # the claim ran in Redis, and its answer was lost
    assert rec["status"] == "applied"
    assert loop.lr == pytest.approx(0.05)  # applied once
    assert [a.replayed for a in loop.acks] == [False]


def test_a_bad_command_and_a_raising_handler_cost_one_warning_each_and_training_goes_on(
        r: redis.Redis, redis_url: str, loops: Any, caplog: Any) -> None:
    loop = loops(redis_url)

    @loop.rc.handler("rollback_checkpoint")
    def rollback(params: dict) -> dict:
        raise OSError("disk gone")

    with caplog.at_level(logging.WARNING, logger="trainmedic"):
        r.xadd(keys.mailbox(keys.Target("job", JOB)), {"c": "\x00garbage"})
        broken = send(r, JOB, "rollback_checkpoint")
        unknown = inject(r, keys.Target("job", JOB), [("teleport", {})])
        ok = send(r, JOB, "scale_lr", {"factor": 0.5})
        wait_record(r, ok, tick=loop.tick)
        loop.run_for(0.5)
    assert wait_record(r, broken)["actions"][0]["status"] == "failed"
    assert wait_record(r, unknown)["actions"][0]["status"] == "unsupported"
    assert loop.lr == pytest.approx(0.05)
    warnings = caplog.messages
    assert sum("malformed" in m for m in warnings) == 1
    assert sum("disk gone" in m for m in warnings) == 1
    assert loop.slowest < POLL_BOUND


def test_commands_sent_while_the_trainer_was_away_apply_once_and_expired_ones_are_acked_expired(
        r: redis.Redis, redis_url: str, loops: Any) -> None:
    stale = send(r, JOB, "scale_lr", {"factor": 0.5}, expire_after=0.2)
    fresh = send(r, JOB, "scale_lr", {"factor": 0.5})
    time.sleep(0.4)
    loop = loops(redis_url)
    wait_record(r, fresh, tick=loop.tick)
    assert wait_record(r, stale, tick=loop.tick)["actions"][0]["status"] == "expired"
    loop.run_for(0.3)
    assert loop.lr == pytest.approx(0.05)
    # The stale one ended expired in the same atomic step as the claim: the trainer never had it to apply.
    assert [a.status for a in loop.acks] == ["applied"]
    assert wait_record(r, stale)["actions"][0]["result"]["message"] == "The command expired before anyone applied it."
