"""Goodput's accuracy with real processes on a known timeline, through the real service under gunicorn.

Two jobs run the same timeline at the same time, one a single process and one two gloo ranks (rank 0 counts):
10 s of 50 ms steps, a 12 s hang while the heartbeat goes on (TRAINMEDIC_STALL_AFTER=3s), a rollback of 100
steps through the service (POST /commands, rollback_checkpoint), steps past where it was, a SIGKILL of every
process, 8 s with none, a restart from 150 steps before the job's highest, steps past it, a clean close(). The
truth comes from each job's own log of the steps it passed to poll() and when: the README's definitions applied
to those exact times. Each figure must be within 2 s or 5 % of it, whichever is larger; a process killed without
close() may move up to one heartbeat interval (1 s here) from its kinds into down, and what it did in that
interval its successor cannot know either (its recompute may end up to that much sooner).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from trainmedic.client.wire.protocol import parse_rfc3339
from trainmedic.service.embedded_redis import free_port

from tests.conftest import OP_AUTH, ROOT

STEP = 0.05
STALL_AT = 200  # 10 s of steps first
STALL_S = 12.0
STALL_AFTER = 3.0
HEARTBEAT = 1.0
BACK = 100
DOWN_S = 8.0
RESUME_BEHIND = 150
JOBS = {"solo": 1, "pair": 2}
KINDS = ("productive", "stall", "recompute", "down")


def tol(x: float) -> float:
    return max(2.0, 0.05 * abs(x))


class Job:
    """One job's processes (one per rank), its log and stop file."""

    def __init__(self, tmp: Path, name: str, world: int, redis_url: str):
        self.tmp, self.name, self.world, self.redis_url = tmp, name, world, redis_url
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def start(self, start_step: int, stall_at: int | None) -> None:
        n = len(self.logs)
        log, stop = self.tmp / f"{self.name}-{n}.jsonl", self.tmp / f"{self.name}-{n}.stop"
        self.logs.append(log)
        self.stop = stop
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
        env["TRAINMEDIC_STALL_AFTER"] = f"{STALL_AFTER:g}s"
        self.procs = []
        for rank in range(self.world):
            cfg = {"job": self.name, "redis_url": self.redis_url, "log": str(log), "stop": str(stop),
                   "start_step": start_step, "step_time": STEP, "stall_at": stall_at, "stall_s": STALL_S,
                   "heartbeat": HEARTBEAT, "rank": rank, "world": self.world, "port": port}
            out = open(self.tmp / f"{self.name}-{n}-rank{rank}.out", "wb")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "tests.e2e.goodput_job", json.dumps(cfg)],
                                               cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))

    def events(self, n: int) -> list[dict[str, Any]]:
        path = self.logs[n]
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def steps(self, n: int) -> list[tuple[float, int]]:
        return [(e["t"], e["step"]) for e in self.events(n) if "step" in e]

    def kill(self) -> float:
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
        killed = time.time()
        for p in self.procs:
            p.wait(10)
        return killed

    def finish(self) -> None:
        self.stop.touch()
        for p in self.procs:
            assert p.wait(60) == 0, (self.tmp / f"{self.name}-{len(self.logs) - 1}-rank0.out").read_text()[-3000:]


def wait_for(what: str, cond: Any, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.1)


def truth(first: list[dict], killed: float, second: list[dict]) -> tuple[dict[str, float], float]:
    """Each figure by the README's definitions (Goodput), from the exact times of the steps both processes passed to
    poll(); and the job's highest step when the first process died."""
    times = [b[0] - a[0] for a, b in zip(steps_of(first), steps_of(first)[1:]) if b[1] == a[1] + 1]
    threshold = max(STALL_AFTER, 3 * statistics.median(times))
    kinds = dict.fromkeys(KINDS, 0.0)
    high = steps_of(first)[0][1]
    highs = []
    for events, end in ((first, killed), (second, next(e["t"] for e in second if e.get("event") == "closed"))):
        steps = steps_of(events)  # time before a process's first step is wall time only
        for (t0, _), (t1, s1) in zip(steps, steps[1:]):
            span = t1 - t0
            kind = "stall" if span > threshold else "productive" if s1 > high else "recompute"
            kinds[kind] += span
            high = max(high, s1)
        # From its last step to its end (killed, or closed): the kind it was in.
        kinds["productive" if steps[-1][1] >= high else "recompute"] += end - steps[-1][0]
        highs.append(high)
    created = [next(e["t"] for e in events if e.get("event") == "created") for events in (first, second)]
    kinds["down"] = created[1] - killed
    closed = next(e["t"] for e in second if e.get("event") == "closed")
    kinds["wall"] = closed - created[0]
    return kinds, highs[0]


def past_rollback(steps: list[tuple[float, int]]) -> int:
    """How many steps past its highest before its first step back the job is (-1 before it went back)."""
    s = [x for _, x in steps]
    back = next((i for i in range(1, len(s)) if s[i] < s[i - 1]), None)
    return -1 if back is None else s[-1] - max(s[:back])


def steps_of(events: list[dict]) -> list[tuple[float, int]]:
    return [(e["t"], e["step"]) for e in events if "step" in e]


def figures(job: dict) -> dict[str, float]:
    return {"productive": job["productive_s"], **job["lost_s"], "wall": job["wall_s"]}


def test_goodput_is_within_2s_or_5pc_across_a_hang_a_rollback_a_kill_and_a_resume_for_one_and_two_ranks(
        gunicorn: Any, redis_url: str, tmp_path: Path) -> None:
    server = gunicorn(workers=2)
    jobs = {name: Job(tmp_path, name, world, redis_url) for name, world in JOBS.items()}
    for job in jobs.values():
        job.start(0, STALL_AT)
    # The hang (12 s without a poll) ends, then 3 s of steps: the rollback goes through the service.
    for job in jobs.values():
        wait_for(f"{job.name}'s hang and steps after it", lambda j=job: any(
            s >= STALL_AT + 60 for _, s in j.steps(0)))
    rollbacks = {}
    for name in jobs:
        resp = requests.post(f"{server.url}/commands", json={"target": f"job:{name}", "action": "rollback_checkpoint"},
                             headers=OP_AUTH, timeout=10)
        assert resp.status_code == 201, resp.text
        rollbacks[name] = resp.json()
    for job in jobs.values():  # back 100 steps (5 s again), then 100 new ones (5 s)
        wait_for(f"{job.name}'s steps past the rollback", lambda j=job: past_rollback(j.steps(0)) >= 100)
    killed = {name: job.kill() for name, job in jobs.items()}
    time.sleep(DOWN_S)
    resumed_at = {name: max(s for _, s in job.steps(0)) - RESUME_BEHIND for name, job in jobs.items()}
    for name, job in jobs.items():
        job.start(resumed_at[name], None)
    for name, job in jobs.items():  # 150 steps again (7.5 s), then 100 new ones (5 s)
        wait_for(f"{name}'s steps past its highest", lambda j=job, n=name: any(
            s >= resumed_at[n] + RESUME_BEHIND + 100 for _, s in j.steps(1)))
    for job in jobs.values():
        job.finish()
    got = {}
    for name in jobs:
        wait_for(f"{name}'s last heartbeat folded", lambda n=name: not requests.get(
            f"{server.url}/jobs/{n}", timeout=5).json()["live"], timeout=15)
        got[name] = requests.get(f"{server.url}/jobs/{name}", timeout=5).json()

    for name, job in jobs.items():
        expected, high = truth(job.events(0), killed[name], job.events(1))
        # The timeline happened as planned: each kind is there, so no figure can pass by being near zero.
        assert expected["stall"] == pytest.approx(STALL_S, abs=0.5), expected
        assert expected["recompute"] == pytest.approx((BACK + RESUME_BEHIND) * STEP, rel=0.3), expected
        assert expected["down"] >= DOWN_S and expected["productive"] > 15, expected
        measured = figures(got[name])
        moved = min(max(0.0, measured["down"] - expected["down"]), HEARTBEAT)
        errors = {k: measured[k] - expected[k] for k in (*KINDS, "wall")}
        report = f"{name}: measured {measured}, truth {expected}, errors {errors}"
        print(f"{name} ({jobs[name].world} rank{'s' if jobs[name].world > 1 else ''}): " + ", ".join(
            f"{k} {measured[k]:.2f} s (truth {expected[k]:.2f}, error {errors[k]:+.2f})" for k in (*KINDS, "wall")))
        assert abs(errors["wall"]) <= tol(expected["wall"]), report
        assert abs(errors["stall"]) <= tol(expected["stall"]), report
        assert -tol(expected["down"]) <= errors["down"] <= tol(expected["down"]) + HEARTBEAT, report
        for kind in ("productive", "recompute"):
            assert abs(errors[kind]) <= tol(expected[kind]) + HEARTBEAT, report
        assert abs(errors["productive"] + errors["recompute"] + moved) <= 2 * tol(expected["productive"]), report
        assert got[name]["goodput"] == pytest.approx(measured["productive"] / measured["wall"], abs=0.001)
        # The rollback is an incident: recovered when, once it was applied, the step passed the highest step
        # the job had reached when it was sent.
        [incident] = got[name]["incidents"]
        assert incident["id"] == rollbacks[name]["id"] and incident["recovered_at"] is not None
        sent, applied = parse_rfc3339(incident["started_at"]), parse_rfc3339(incident["applied_at"])
        assert sent is not None and applied is not None
        steps = job.steps(0)
        at_start = max(s for t, s in steps if t <= sent)
        back = next(i for i in range(1, len(steps)) if steps[i][1] < steps[i - 1][1])  # where the rollback took
        assert steps[back][0] >= applied - 0.1
        passed = next(t for t, s in steps[back:] if s > at_start)
        assert incident["recovered_after_s"] == pytest.approx(passed - sent, abs=2.0), (incident, passed - sent)
        assert 4.0 < passed - sent < 8.0  # 100 steps of 50 ms again
        assert got[name]["step"] == max(s for _, s in job.steps(1)) and high <= got[name]["step"]
    # Two ranks count as one process does.
    for kind in (*KINDS, "wall"):
        solo, pair = figures(got["solo"])[kind], figures(got["pair"])[kind]
        assert abs(pair - solo) <= tol(solo) + (HEARTBEAT if kind != "stall" else 0), (kind, got)
