"""End to end, did it work? Real Prometheus scraping real PyTorch jobs, real Alertmanager (and a cluster of
two), the service under gunicorn, short intervals: an effective remediation, an ineffective one whose ladder
stops the job, one resolved between stages, a silence made and expired, a restart in the middle of a ladder,
and screenshots of the pages with the metric around each remediation."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import pytest
import requests
from playwright.sync_api import Browser

from tests.conftest import TOKEN, write_playbooks
from tests.support.browser import shot
from tests.support.receiver import Receiver
from tests.support.stack import Alertmanager, Prometheus
from trainmedic.service.embedded_redis import free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = """\
groups:
  - name: toy
    rules:
      - alert: ToyLossHigh
        expr: max by (job_name) (training_loss) > 5
        labels: {severity: critical}
        annotations: {summary: "The toy job's loss is {{ $value }}"}
"""
PLAYBOOKS = """\
playbooks:
  - name: toy-ladder
    matchers: ['alertname="ToyLossHigh"']
    target: job
    actions: [{{scale_lr: {{factor: 0.5}}}}]
    verify: 6s
    escalate:
      - after: {after}
        actions: [{{scale_lr: {{factor: 0.5}}}}]
      - after: {after}
        actions: [{{save_checkpoint: {{}}}}, {{stop_training: {{}}}}]
    silence: {silence}
"""


class Job:
    """tests/e2e/toy_job.py as a subprocess, its metrics on a free port."""

    def __init__(self, tmp: Path, name: str, redis_url: str, mode: str):
        self.name = name
        self.port = free_port()
        self.out = tmp / f"{name}.json"
        self.log = open(tmp / f"{name}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("toy_job.py")), name, redis_url,
                                      str(self.port), str(self.out), mode],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def result(self, timeout: float = 60) -> dict[str, Any]:
        self.proc.wait(timeout)
        assert self.proc.returncode == 0, (self.out.parent / f"{self.name}.log").read_text()[-2000:]
        return json.loads(self.out.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Stack:
    """The service, Alertmanager(s), Prometheus and toy jobs for one test."""

    def __init__(self, tmp: Path, gunicorn: Callable[..., Any], redis_url: str, jobs: dict[str, str],
                 silence: bool = False, after: str = "8s", peers: int = 1):
        self.tmp, self.gunicorn, self.redis_url = tmp, gunicorn, redis_url
        self.hook = Receiver()
        self.jobs = {name: Job(tmp, name, redis_url, mode) for name, mode in jobs.items()}
        self.port = free_port()
        self.webhook = f"http://127.0.0.1:{self.port}/webhook"
        self.ams: list[Alertmanager] = []
        for _ in range(peers):
            self.ams.append(Alertmanager(tmp, self.webhook, TOKEN, group_wait="1s", group_interval="2s",
                                         repeat_interval="1h", cluster=peers > 1,
                                         peers=[a.cluster_address for a in self.ams]))
        rules = tmp / "toy-rules.yml"
        rules.write_text(RULES)
        self.prom = Prometheus(tmp, [f"127.0.0.1:{j.port}" for j in self.jobs.values()], [rules],
                               f"127.0.0.1:{self.ams[0].port}")
        self.playbooks = write_playbooks(tmp / "toy.yaml", PLAYBOOKS.format(after=after,
                                                                            silence=str(silence).lower()))
        self.start()

    def start(self) -> None:
        self.server = self.gunicorn(
            workers=2, port=self.port, TRAINMEDIC_PLAYBOOKS=str(self.playbooks),
            TRAINMEDIC_ALERTMANAGER_URL=",".join(a.url for a in self.ams), TRAINMEDIC_ALERTMANAGER_TRUST_AFTER="1",
            TRAINMEDIC_PROMETHEUS_URL=self.prom.url, TRAINMEDIC_NOTIFY_URL=self.hook.url,
            TRAINMEDIC_PUBLIC_URL=f"http://127.0.0.1:{self.port}")

    def restart(self) -> None:
        self.server.stop()
        self.start()

    def history(self, **params: str) -> list[dict[str, Any]]:
        return requests.get(self.server.url + "/history", params=params, timeout=5).json()["items"]

    def ladder(self, job: str) -> list[dict[str, Any]]:
        return sorted(self.history(target=f"job:{job}", playbook="toy-ladder"),
                      key=lambda r: r["escalation"]["stage"])

    def stop(self) -> None:
        for j in self.jobs.values():
            j.kill()
        self.prom.stop()
        for a in self.ams:
            a.stop()
        self.hook.close()


@pytest.fixture
def stack(tmp_path: Path, gunicorn: Callable[..., Any], redis_url: str) -> Iterator[Callable[..., Stack]]:
    made: list[Stack] = []

    def make(**kw: Any) -> Stack:
        s = Stack(tmp_path, gunicorn, redis_url, **kw)
        made.append(s)
        return s
    yield make
    for s in made:
        s.stop()


def wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def last_ack(rec: dict[str, Any]) -> float:
    return max(ts(a["acked_at"]) for a in rec["actions"])


def test_outcomes_and_ladders_with_real_prometheus_alertmanager_and_jobs(stack: Callable[..., Stack],
                                                                        browser: Browser) -> None:
    s = stack(jobs={"works": "halve-once", "between": "halve-twice", "stuck": "stuck"})
    # One that works: one halving brings the loss down; the alert resolves before stage 1 is due.
    works = wait(lambda: [r for r in s.ladder("works") if (r["outcome"] or {}).get("status") == "effective"],
                 90, "the effective outcome")[0]
    ttr = works["outcome"]["time_to_resolve_s"]
    assert 0 <= ttr < 8 and abs(ts(works["outcome"]["resolved_at"]) - last_ack(works) - ttr) < 0.01
    # One resolved between stages: stage 0 is ineffective, stage 1 fixes it, stage 2 never runs.
    between = wait(lambda: (lambda lad: lad if len(lad) == 2 and (lad[1]["outcome"] or {}).get("status") ==
                            "effective" else None)(s.ladder("between")), 90, "stage 1 to work")
    assert between[0]["outcome"]["status"] == "ineffective" and between[1]["escalation"]["parent"] == between[0]["id"]
    # One that does not work: stage 0 and stage 1 ineffective, stage 2 checkpoints and stops the job.
    stuck = wait(lambda: (lambda lad: lad if len(lad) == 3 and lad[2]["status"] == "applied" else None)(
        s.ladder("stuck")), 90, "stage 2 to stop the stuck job")
    assert [r["outcome"]["status"] for r in stuck[:2]] == ["ineffective", "ineffective"]
    assert [a["action"] for a in stuck[2]["actions"]] == ["save_checkpoint", "stop_training"]
    result = s.jobs["stuck"].result()
    assert [a["action"] for a in result["applied"]] == ["scale_lr", "scale_lr", "save_checkpoint", "stop_training"]
    # The job stopped, its series went away and the alert resolved: stage 2 gets that truth too.
    wait(lambda: (s.ladder("stuck")[2]["outcome"] or {}).get("status") == "effective", 60, "the stopped job's resolve")
    time.sleep(10)  # longer than any `after`: no stage appears after a ladder ended
    assert len(s.ladder("works")) == 1 and len(s.ladder("between")) == 2 and len(s.ladder("stuck")) == 3
    texts = s.hook.texts()
    assert sum("was ineffective" in t for t in texts) == 3 and not any("unresolved" in t for t in texts)
    # GET /playbooks and /metrics agree.
    [pb] = requests.get(s.server.url + "/playbooks", timeout=5).json()["items"]
    assert pb["outcomes"]["effective"] == 3 and pb["outcomes"]["ineffective"] == 3
    assert pb["time_to_resolve_s"]["median"] is not None
    # Screenshots of the pages with the metric chart from the real Prometheus.
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.goto(f"{s.server.url}/records/{stuck[2]['id']}")
    assert page.locator("#around svg path.series").count() >= 1
    assert page.locator("#around .mk-stage").count() >= 2 and page.locator("#around .mk-resolve").count() >= 1
    shot(page, "record-ladder.png")
    page.goto(f"{s.server.url}/targets/job/works")
    assert page.locator("#around svg path.series").count() >= 1
    assert "learning rate" in page.locator("#around").inner_text().lower()
    shot(page, "target-metric.png")
    page.goto(s.server.url + "/")
    assert "3 effective · 3 ineffective" in page.locator("#effectiveness").inner_text()
    shot(page, "history-outcomes.png")
    page.close()


def test_a_silence_is_made_and_expired_through_a_cluster_of_two_alertmanagers(stack: Callable[..., Stack]) -> None:
    s = stack(jobs={"quiet": "halve-twice"}, silence=True, after="12s", peers=2)
    first = wait(lambda: [r for r in s.ladder("quiet") if r["silence_id"]], 90, "the silence")[0]
    sid = first["silence_id"]
    for am in s.ams:  # made on one peer, gossiped to the other
        wait(lambda am=am: any(x["id"] == sid for x in am.silences()), 20, "the silence on every peer")
    made = next(x for x in s.ams[0].silences() if x["id"] == sid)
    assert made["createdBy"] == "trainmedic" and first["id"] in made["comment"]
    assert {(m["name"], m["value"], m["isEqual"], m["isRegex"]) for m in made["matchers"]} >= {
        ("alertname", "ToyLossHigh", True, False), ("job_name", "quiet", True, False)}
    length = ts(made["endsAt"]) - ts(first["created_at"])
    assert abs(length - (12 + 12 + 6 + 600)) < 5, "dispatch + every after + verify + 10 minutes"
    # Stage 1 fixes it. Alertmanager sends nothing for the silenced alert, not even its resolve: the
    # reconciler learns it from the API, and expires the silence.
    lad = wait(lambda: (lambda lad: lad if len(lad) == 2 and (lad[1]["outcome"] or {}).get("status") ==
                        "effective" else None)(s.ladder("quiet")), 120, "stage 1 effective through the API")
    assert lad[1]["silence_id"] == sid
    wait(lambda: all(next(x for x in am.silences() if x["id"] == sid)["status"]["state"] == "expired"
                     for am in s.ams), 30, "the silence expired on every peer")
    assert len(s.ladder("quiet")) == 2


def test_a_service_restart_in_the_middle_of_a_ladder_neither_loses_nor_repeats_a_stage(
        stack: Callable[..., Stack]) -> None:
    s = stack(jobs={"stuck": "stuck"}, after="15s")
    first = wait(lambda: [r for r in s.ladder("stuck") if r["status"] == "applied"], 90, "stage 0 applied")[0]
    s.restart()  # all workers and their reconcilers go; the new ones know the ladder only from Redis
    lad = wait(lambda: (lambda lad: lad if len(lad) == 3 and lad[2]["status"] == "applied" else None)(
        s.ladder("stuck")), 120, "the whole ladder after the restart")
    assert lad[0]["id"] == first["id"] and [r["escalation"]["stage"] for r in lad] == [0, 1, 2]
    result = s.jobs["stuck"].result()
    assert [a["action"] for a in result["applied"]].count("scale_lr") == 2, "each stage applied once"
