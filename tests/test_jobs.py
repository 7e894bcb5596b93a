"""GET /jobs, GET /jobs/<name> and `trainmedic jobs`: every job's time, paged live first then by name; a job's
incidents with when it recovered, from a real training client through the reconciler's passes."""
from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from trainmedic.client import RemediationClient
from trainmedic.client.wire import keys

from tests.conftest import load_fixture, post_json
from tests.support.jobs import wait_record, wait_until
from tests.support.keyspaces import BOTH
from tests.test_cli import one_line_error, run
from tests.test_goodput import Proc

JOB_KEYS = {"job_name", "live", "step", "first_seen", "last_seen", "wall_s", "productive_s", "lost_s", "goodput",
            "remediations"}
INCIDENT_KEYS = {"id", "playbook", "alertname", "started_at", "decided_at", "applied_at", "recovered_at",
                 "recovered_after_s"}


def seed(r: redis.Redis, live: list[str], done: list[str]) -> None:
    """Jobs with accounts: `live` heartbeating now, `done` closed a while ago."""
    from trainmedic.service import goodput

    now = time.time()
    beats = []
    for name in done:
        p = Proc(name, now - 600)
        p.steps(100, 300)
        beats.append((keys.Target("job", name), p.beat(now - 300, closed=True)))
    goodput.fold(r, beats, now - 299)
    beats = []
    for name in live:
        p = Proc(name, now - 60)
        p.steps(500, 50)
        p.steps(500, 5, "stall")
        beats.append((keys.Target("job", name), p.beat(now - 1)))
    goodput.fold(r, beats, now)


@BOTH
def test_jobs_list_live_ones_first_then_by_name_in_full_pages(r: redis.Redis, http: Any) -> None:
    seed(r, live=["zeta", "alpha", "mid"], done=["beta", "aaa", "omega", "kappa"])
    seen, cursor, sizes = [], None, []
    while True:
        page = http.get("/jobs", query_string={"limit": 2, **({"before": cursor} if cursor else {})}).get_json()
        sizes.append(len(page["items"]))
        seen += [(j["job_name"], j["live"]) for j in page["items"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == [("alpha", True), ("mid", True), ("zeta", True), ("aaa", False), ("beta", False),
                    ("kappa", False), ("omega", False)]
    assert sizes == [2, 2, 2, 1]
    assert [j["job_name"] for j in http.get("/jobs?live=true").get_json()["items"]] == ["alpha", "mid", "zeta"]
    assert [j["job_name"] for j in http.get("/jobs?live=false&limit=3").get_json()["items"]] == ["aaa", "beta", "kappa"]
    job = http.get("/jobs").get_json()["items"][0]
    assert set(job) == JOB_KEYS and set(job["lost_s"]) == {"stall", "recompute", "down"}
    assert job["productive_s"] == 50 and job["lost_s"]["stall"] == 5 and job["step"] == 500
    assert job["wall_s"] == pytest.approx(60, abs=2) and job["goodput"] == pytest.approx(50 / 60, abs=0.03)
    assert job["first_seen"].endswith("Z") and job["remediations"] == 0


@pytest.mark.parametrize("query, words", [
    ("limit=abc", "limit must be an integer from 1 to 1000"), ("limit=0", "limit must be an integer from 1 to 1000"),
    ("limit=1001", "limit must be an integer from 1 to 1000"), ("live=maybe", "live must be true or false"),
    ("before=x", "before must be the `next` cursor of a previous page"), ("sort=name", "unknown query parameter"),
])
def test_a_bad_query_is_a_400_with_one_sentence(r: redis.Redis, http: Any, query: str, words: str) -> None:
    resp = http.get(f"/jobs?{query}")
    assert resp.status_code == 400 and set(resp.get_json()) == {"error"}
    assert resp.get_json()["error"].startswith(words)


def test_an_unknown_job_is_a_404(r: redis.Redis, http: Any) -> None:
    seed(r, live=["known"], done=[])
    assert http.get("/jobs/known").status_code == 200
    for name in ("unknown", "..", "a%20b", "x" * 200):
        resp = http.get(f"/jobs/{name}")
        assert resp.status_code == 404 and "no job named" in resp.get_json()["error"]


def test_a_repeat_skipped_by_the_cooldown_is_no_incident(r: redis.Redis, app: Any, http: Any) -> None:
    seed(r, live=["llama-ft-01"], done=[])
    made = []
    for n, start in enumerate(("2026-11-22T01:25:24Z", "2026-11-22T01:29:00Z")):
        payload = load_fixture("firing_single.json")
        payload["alerts"][0].update(startsAt=start, fingerprint=f"071ff15f8faead0{n}")
        [rem] = post_json(http, "/webhook", payload).json["remediations"]
        made.append(rem)
    assert [m["status"] for m in made] == ["dispatched", "skipped"] and made[1]["reason"] == "cooldown"
    app.extensions["trainmedic"].reconciler.tick()  # folds both into the job's history
    assert http.get("/jobs/llama-ft-01").get_json()["remediations"] == 2
    job = http.get("/jobs/llama-ft-01").get_json()
    assert [i["id"] for i in job["incidents"]] == [made[0]["id"]]


@BOTH
def test_a_rollback_is_an_incident_that_recovers_when_the_step_passes_where_it_was(
        r: redis.Redis, app: Any, http: Any, monkeypatch: Any) -> None:
    """A real client, a real rollback_checkpoint through the service, the reconciler's passes (its hook)."""
    monkeypatch.setenv("TRAINMEDIC_STALL_AFTER", "2s")
    reconciler = app.extensions["trainmedic"].reconciler
    rc = RemediationClient(job="incident", redis_url=app.extensions["trainmedic"].settings.redis_url,
                           heartbeat_interval=0.2)
    state = {"step": 0}

    @rc.handler("rollback_checkpoint")
    def rollback(params: dict) -> dict:
        state["step"] -= 100
        return {"restored_step": state["step"]}

    def train(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            rc.poll(step=state["step"])
            state["step"] += 1
            time.sleep(0.01)
            if state["step"] % 20 == 0:
                reconciler.tick()
    try:
        train(2)
        high = state["step"]
        resp = post_json(http, "/commands", {"target": "job:incident", "action": "rollback_checkpoint"})
        assert resp.status_code == 201, resp.get_json()
        rid = resp.get_json()["id"]
        rec = wait_record(r, rid, tick=lambda: train(0.05))
        assert rec["status"] == "applied" and state["step"] < high
        train(0.5)
        [incident] = http.get("/jobs/incident").get_json()["incidents"]
        assert incident["recovered_at"] is None  # still below where it was when the alert began
        wait_until(lambda: http.get("/jobs/incident").get_json()["incidents"][0]["recovered_at"], 15,
                   tick=lambda: train(0.1), what="the incident's recovery")
    finally:
        rc.close()
    reconciler.tick()  # folds close()'s last heartbeat
    job = http.get("/jobs/incident").get_json()
    [incident] = job["incidents"]
    assert set(incident) == INCIDENT_KEYS and incident["id"] == rid and incident["playbook"] == "manual"
    assert incident["alertname"] == "manual" and incident["started_at"] == rec["alert"]["starts_at"]
    assert incident["decided_at"] == rec["created_at"] and incident["applied_at"] == rec["actions"][0]["acked_at"]
    # About 100 steps of ~12 ms to get back to where it was, counted from the alert's start.
    assert 0.5 < incident["recovered_after_s"] < 5, incident
    assert job["remediations"] == 1 and job["lost_s"]["recompute"] > 0.5 and job["productive_s"] > 1.2
    counted = job["productive_s"] + job["lost_s"]["recompute"] + job["lost_s"]["stall"]
    assert job["wall_s"] - 0.6 < counted <= job["wall_s"]  # all but the time before the first step
    assert not job["live"] and job["lost_s"]["down"] == 0


def test_trainmedic_jobs_prints_a_header_and_every_job_and_json_lines(gunicorn: Any, r: redis.Redis) -> None:
    server = gunicorn(workers=1)
    seed(r, live=["cli-live"], done=[f"cli-{i:04d}" for i in range(1005)])  # more than one page of the API
    proc = run("jobs", "--url", server.url)
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()
    assert header.split()[:5] == ["JOB", "LIVE", "STEP", "WALL", "GOODPUT"] and "REMEDIATIONS" in header
    assert len(rows) == 1006 and rows[0].split()[:3] == ["cli-live", "yes", "500"]
    assert rows[1].split()[:2] == ["cli-0000", "no"] and rows[-1].startswith("cli-1004")
    assert rows[1].index("no") == header.index("LIVE")
    lines = run("jobs", "--url", server.url, "--json").stdout.splitlines()
    assert len(lines) == 1006 and set(json.loads(lines[0])) == JOB_KEYS


def test_trainmedic_jobs_sends_the_read_token_and_says_what_is_wrong_in_one_line(gunicorn: Any) -> None:
    server = gunicorn(workers=1, TRAINMEDIC_READ_TOKEN="reader-s3cret")
    assert "HTTP 401" in one_line_error(run("jobs", "--url", server.url), 1)
    ok = run("jobs", "--url", server.url, env={"TRAINMEDIC_READ_TOKEN": "reader-s3cret"})
    assert ok.returncode == 0 and ok.stdout.split()[0] == "JOB"
