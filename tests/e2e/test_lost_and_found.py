"""Lost and found (nothing claimed is dropped, and every action ends), with real processes killed at the
worst moment and the service under gunicorn: only its reconciler threads bring records to the truth here, no
test calls the reconciler by hand."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import requests

from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire import keys
from trainmedic.service.beats import announce
from trainmedic.service.store.record import get as record_here

from tests.conftest import write_playbooks
from tests.support.jobs import send as send_here, service
from tests.support.faults import (TERMINAL, CrashTrainer, history, metric, post, record,
                                  rfc3339_seconds, send, wait_for)

JOB = "llama-ft-01"
NODE = "gpu-node-3"
# A dispatched action is terminal by expire_after + 30 s (README: Guardrails).
TERMINAL_WITHIN = 30.0
PLAYBOOKS = """\
playbooks:
  - name: throttle
    matchers: ['alertname="GPUTemperatureHigh"']
    target: node
    actions: [{power_limit: {watts: 560}}]
  - name: throttle-briefly
    matchers: ['alertname="GPUTemperatureHighBriefly"']
    target: node
    expire_after: 3s
    actions: [{power_limit: {watts: 560}}]
"""


def status(url: str, rid: str) -> str:
    return str(record(url, rid)["status"])


def action(url: str, rid: str) -> dict:
    return dict(record(url, rid)["actions"][0])


def test_a_trainer_killed_after_its_claim_gets_the_command_again_when_it_restarts_and_applies_it_once(
        gunicorn: Any, r: Any, redis_url: str, tmp_path: Path) -> None:
    server = gunicorn(workers=2)
    doomed = CrashTrainer(tmp_path, JOB, redis_url, "die")
    restarted = None
    try:
        doomed.wait_beating(r)
        rid = send(server.url, f"job:{JOB}", "scale_lr", {"factor": 0.5})
        doomed.wait_killed()
        assert doomed.result()["held"] == [rid]
        a = action(server.url, rid)
        assert (a["status"], a["acked_by"]) == ("delivered", None)  # claimed, never applied

        restarted = CrashTrainer(tmp_path, JOB, redis_url, "apply")
        first_beat = restarted.wait_beating(r)
        wait_for(lambda: status(server.url, rid) == "applied", TERMINAL_WITHIN + 5, "the restarted trainer's ack")
        rec = record(server.url, rid)
        a = rec["actions"][0]
        assert a["acked_by"].endswith(f":{restarted.pid}")
        assert rfc3339_seconds(a["acked_at"]) - first_beat <= TERMINAL_WITHIN
        assert a["result"]["new_lr"] == [0.05]
        time.sleep(1.5)  # a few more polls: nothing is applied twice
        restarted.stop()
        applied = [x for x in restarted.result()["applied"] if x["rid"] == rid]
        assert [(x["action"], x["status"]) for x in applied] == [("scale_lr", "applied")]
    finally:
        doomed.stop()
        if restarted is not None:
            restarted.stop()


def test_a_command_whose_trainer_was_killed_for_good_counts_in_the_backlog_then_ends_lost(
        gunicorn: Any, r: Any, redis_url: str, tmp_path: Path) -> None:
    server = gunicorn(workers=2)
    doomed = CrashTrainer(tmp_path, JOB, redis_url, "die")
    try:
        doomed.wait_beating(r)
        rid = send(server.url, f"job:{JOB}", "scale_lr", {"factor": 0.5}, expire_after="3s")
        sent = time.monotonic()
        doomed.wait_killed()
        # Delivered to a process and never acknowledged: not applied, so it is backlog.
        assert metric(server.url, "trainmedic_mailbox_backlog", kind="job") == 1
        wait_for(lambda: status(server.url, rid) != "dispatched", 3 + TERMINAL_WITHIN, "the record to end")
        assert time.monotonic() - sent <= 3 + TERMINAL_WITHIN
    finally:
        doomed.stop()
    rec = record(server.url, rid)
    assert rec["status"] == "lost"
    assert (rec["actions"][0]["status"], rec["actions"][0]["reason"]) == ("lost", "lost")
    assert metric(server.url, "trainmedic_mailbox_backlog", kind="job") == 0


def test_a_command_nobody_takes_ends_expired_through_the_service_reconcilers_alone(
        gunicorn: Any, r: Any, tmp_path: Path) -> None:
    server = gunicorn(workers=2)
    rid = send(server.url, f"job:{JOB}", "scale_lr", {"factor": 0.5}, expire_after="2s")
    sent = time.monotonic()
    assert metric(server.url, "trainmedic_mailbox_backlog", kind="job") == 1  # waiting in the mailbox
    wait_for(lambda: status(server.url, rid) != "dispatched", 2 + TERMINAL_WITHIN, "the record to end")
    assert time.monotonic() - sent <= 2 + TERMINAL_WITHIN
    rec = record(server.url, rid)
    assert rec["status"] == "expired" and rec["actions"][0]["reason"] == "expired"
    assert metric(server.url, "trainmedic_mailbox_backlog", kind="job") == 0


class HungNvml:
    """Make the NVML stand-in hang: its state file becomes a FIFO, so the agent's next NVML call blocks in
    open() like a wedged driver, after the agent has claimed the command and before it can acknowledge."""

    def __init__(self, state: Any):
        self.state = state
        self.gpus = list(state.gpus().values())

    def __enter__(self) -> HungNvml:
        self.state.path.unlink()
        os.mkfifo(self.state.path)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.state.path.unlink()
        self.state.write(self.gpus)


def throttle_with_a_hung_agent(server: Any, agent: Any, r: Any, nvml_state: Any, playbook: str) -> str:
    """Trigger a throttle whose agent claims it, hangs in NVML, and is SIGKILLed; the record id."""
    agent.wait_ready(r)
    with HungNvml(nvml_state):
        rid = str(post(server.url, "/remediations", {"playbook": playbook,
                                                     "labels": {"node": NODE, "gpu_id": "0"}})["id"])
        wait_for(lambda: action(server.url, rid)["status"] == "delivered", 15, "the agent's claim")
        time.sleep(1.0)
        assert action(server.url, rid)["status"] == "delivered"  # hung: claimed, not acknowledged
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(10)
    assert nvml_state.limit_w(0) == 700
    return rid


def test_a_node_agent_killed_while_its_handler_hangs_gets_the_command_again_when_it_restarts(
        gunicorn: Any, agents: Any, r: Any, tmp_path: Path, nvml_lib: Path, nvml_state: Any) -> None:
    server = gunicorn(workers=2, TRAINMEDIC_PLAYBOOKS=str(write_playbooks(tmp_path / "pb.yaml", PLAYBOOKS)))
    agent = agents(NODE, lib_dir=nvml_lib, state=nvml_state)
    rid = throttle_with_a_hung_agent(server, agent, r, nvml_state, "throttle")
    again = agents(NODE, lib_dir=nvml_lib, state=nvml_state)  # the same node and state dir, a new process
    again.wait_ready(r)
    first_beat = time.time()
    wait_for(lambda: status(server.url, rid) == "applied", TERMINAL_WITHIN + 5, "the restarted agent's ack")
    a = action(server.url, rid)
    assert a["acked_by"].endswith(f":{again.proc.pid}")
    assert rfc3339_seconds(a["acked_at"]) - first_beat <= TERMINAL_WITHIN
    assert a["result"]["new_watts"] == 560 and nvml_state.limit_w(0) == 560


def test_a_command_whose_node_agent_was_killed_for_good_ends_lost(
        gunicorn: Any, agents: Any, r: Any, tmp_path: Path, nvml_lib: Path, nvml_state: Any) -> None:
    server = gunicorn(workers=2, TRAINMEDIC_PLAYBOOKS=str(write_playbooks(tmp_path / "pb.yaml", PLAYBOOKS)))
    sent = time.monotonic()
    rid = throttle_with_a_hung_agent(server, agents(NODE, lib_dir=nvml_lib, state=nvml_state), r, nvml_state,
                                     "throttle-briefly")
    assert metric(server.url, "trainmedic_mailbox_backlog", kind="node") == 1
    wait_for(lambda: status(server.url, rid) != "dispatched", 3 + TERMINAL_WITHIN, "the record to end")
    assert time.monotonic() - sent <= 3 + TERMINAL_WITHIN + 1
    rec = record(server.url, rid)
    assert rec["status"] == "lost" and rec["actions"][0]["status"] == "lost"
    assert nvml_state.limit_w(0) == 700


class Watch:
    """Reads every record through GET /history (and each record's settled time from Redis) over and over,
    and keeps what it saw once each record was terminal."""

    def __init__(self, url: str, r: Any, ids: list[str]):
        self.url, self.r, self.ids = url, r, ids
        self.final: dict[str, set] = {rid: set() for rid in ids}  # status seen once terminal
        self.acked_at: dict[str, set] = {rid: set() for rid in ids}
        self.settled: dict[str, set] = {rid: set() for rid in ids}
        self.ended_at: dict[str, float] = {}
        self.rounds = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            seen = {i["id"]: i for i in history(self.url)}
            pipe = self.r.pipeline(transaction=False)
            for rid in self.ids:
                pipe.hget(keys.record(rid), "settled_ms")
            settled = dict(zip(self.ids, pipe.execute()))
            now = time.time()
            for rid in self.ids:
                rec = seen.get(rid)
                if rec is None:
                    continue
                act = rec["actions"][0]
                if act["acked_at"]:
                    self.acked_at[rid].add(act["acked_at"])
                if rec["status"] in TERMINAL:
                    self.final[rid].add(rec["status"])
                    self.ended_at.setdefault(rid, now)
                    self.settled[rid].add(settled[rid])
            self.rounds += 1
            self._stop.wait(0.2)

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self.thread.join(30)


def steal_leases(r: Any, stop: threading.Event) -> None:
    """Delete the reconcilers' lease again and again: several reconcilers of both replicas tick at once."""
    while not stop.is_set():
        r.delete(keys.RECONCILER_LEASE)
        stop.wait(0.02)


def worker_pids(master: int) -> list[int]:
    with open(f"/proc/{master}/task/{master}/children") as f:
        return [int(p) for p in f.read().split()]


def test_two_replicas_racing_reconcilers_end_each_of_300_expiring_records_exactly_once(
        gunicorn: Any, r: Any, tmp_path: Path) -> None:
    replicas = [gunicorn(workers=4), gunicorn(workers=4)]
    expire = 8.0
    ids: list[str] = []
    claimed: set[str] = set()
    for i in range(300):
        job = f"race-{i % 100}"
        rid = send(replicas[i % 2].url, f"job:{job}", "scale_lr", {"factor": 0.5}, expire_after=f"{int(expire)}s")
        ids.append(rid)
        if i % 2 == 0:  # half are delivered to a process that then dies (it never heartbeats again)
            box = Mailbox(r, keys.Target("job", job))
            entry = next(e for e in box.fetch() if e.command is not None and e.command.record_id == rid)
            assert box.claim(entry, f"gone-host:{4000 + i}") == "ok"
            claimed.add(rid)
    last_sent = time.monotonic()
    stop = threading.Event()
    stealer = threading.Thread(target=steal_leases, args=(r, stop), daemon=True)
    with Watch(replicas[1].url, r, ids) as watch:
        stealer.start()
        try:
            time.sleep(expire / 2)
            os.kill(worker_pids(replicas[0].proc.pid)[0], signal.SIGKILL)  # a worker dies mid-race
            wait_for(lambda: len(watch.ended_at) == len(ids), expire + TERMINAL_WITHIN + 5, "every record to end",
                     every=0.5)
            time.sleep(3)  # the reconcilers go on racing over records that are done
        finally:
            stop.set()
            stealer.join(5)
    assert time.monotonic() - last_sent <= expire + TERMINAL_WITHIN + 5
    assert watch.rounds > 10
    for rid in ids:
        want = "lost" if rid in claimed else "expired"
        assert watch.final[rid] == {want}, (rid, watch.final[rid])
        assert len(watch.acked_at[rid]) == 1, (rid, watch.acked_at[rid])  # ended once: one acked_at ever
        assert len(watch.settled[rid]) == 1 and None not in watch.settled[rid], (rid, watch.settled[rid])
    final = {i["id"]: i for i in history(replicas[0].url)}
    assert sorted(final) == sorted(ids)
    assert all(final[rid]["actions"][0]["status"] == final[rid]["status"] for rid in ids)
    assert r.zcard(keys.DUE) == 0
    assert requests.get(replicas[0].url + "/healthz", timeout=5).ok  # the killed worker was replaced


def test_a_claim_is_offered_to_a_restarted_process_once_it_is_10_s_old_not_10_s_after_the_restart(r: Any) -> None:
    rid = send_here(r, JOB, "scale_lr", {"factor": 0.5})
    target = keys.Target("job", JOB)
    box = Mailbox(r, target)
    claimed = time.time()
    assert box.claim(box.fetch()[0], "gpu-1:100") == "ok"  # then the process died
    box.heartbeat({"kind": "job", "name": JOB, "host": "gpu-1", "pid": 200})  # its replacement
    announce(r, [target])  # what the service does when it hears the replacement announce itself
    rc = service(r).extensions["trainmedic"].reconciler
    rc.tick(claimed + 4)  # the replacement's first heartbeat: the claim is too young to be taken from its owner
    assert record_here(r, rid)["actions"][0]["status"] == "delivered"
    rc.tick(claimed + 10.5)  # the claim is 10 s old: offered to the live process
    assert record_here(r, rid)["actions"][0]["status"] == "pending" and len(box.fetch()) == 1
