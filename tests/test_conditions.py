"""`when:` conditions with the real Prometheus (README: Playbooks, `when:`): evaluated by the reconciler, never the
webhook; true runs the step, false skips it (`condition_false`), unreachable or a variable without a value
skips it (`condition_unknown`); variables go in escaped; `check` parses with promtool, else on its own."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.service.embedded_redis import free_port
from trainmedic.service.rules import conditions

from tests.conftest import ROOT, load_fixture, post_json, write_playbooks
from tests.support.jobs import wait_record
from tests.support.loop import Loop
from tests.support.stack import Prometheus

JOB = "llama-ft-01"
PLAYBOOKS = """\
playbooks:
  - name: slow-job
    matchers: ['alertname="TrainingThroughputDrop"']
    target: job
    actions:
      - scale_lr: {factor: 0.5}
        when: 'toy_host_cpu_busy{job_name="$job", host=~"$node"} > 0.8'
      - set_lr: {lr: 0.01}
        when: 'toy_host_cpu_busy{job_name="$job", gpu="$gpu"} > 0.8'
      - empty_cache: {}
"""


@pytest.fixture(scope="module")
def exporter() -> Iterator[tuple[str, Gauge]]:
    """A toy exporter in this process: the job's host CPU, as a node exporter would tell it."""
    registry = CollectorRegistry()
    busy = Gauge("toy_host_cpu_busy", "Host CPU busy fraction (toy).", ["job_name", "host"], registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield f"127.0.0.1:{port}", busy
    server.shutdown()


@pytest.fixture(scope="module")
def prometheus(exporter: tuple[str, Gauge], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path_factory.mktemp("prom"), [exporter[0]], [], "127.0.0.1:9")
    yield prom
    prom.stop()


def fire(http: Any, fingerprint: str) -> str:
    body = load_fixture("firing_single.json")
    body["alerts"][0].update(fingerprint=fingerprint)
    body["alerts"][0]["labels"] = {"alertname": "TrainingThroughputDrop", "job_name": JOB}
    t0 = time.perf_counter()
    resp = post_json(http, "/webhook", body)
    assert time.perf_counter() - t0 < 5.0, "the webhook never waits on Prometheus"
    [made] = resp.get_json()["remediations"]
    return str(made["id"])


def until_scraped(prom: Prometheus, expr: str, want: bool) -> None:
    import requests
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        got = requests.get(prom.url + "/api/v1/query", params={"query": expr}, timeout=5).json()["data"]["result"]
        if bool(got) == want:
            return
        time.sleep(0.2)
    raise AssertionError(f"Prometheus never saw {expr} as {want}")


def evaluate(app: Any, r: redis.Redis, rid: str, loop: Loop) -> dict:
    """The reconciler evaluates the conditions (it is called here, as its thread would within a second)."""
    rec = records.get(r, rid)
    assert rec is not None and all(a["status"] == "pending" for a in rec["actions"]), "nothing before the reconciler"
    assert r.hget(keys.record(rid), "cmd") is None, "nothing is sent before the conditions"
    app.extensions["trainmedic"].reconciler.tick()
    return wait_record(r, rid, lambda rec: rec is not None and rec["status"] != "dispatched", tick=loop.tick)


def test_a_true_condition_runs_its_step_a_false_one_skips_it_and_no_prometheus_is_unknown(
        make_app: Any, r: redis.Redis, redis_url: str, tmp_path: Path, exporter: tuple[str, Gauge],
        prometheus: Prometheus) -> None:
    _, busy = exporter
    loop = Loop(redis_url, JOB)
    while not r.get(keys.heartbeat(keys.Target("job", JOB))):
        loop.tick()
    host = loop.rc.identity.split(":")[0]
    pbs = str(write_playbooks(tmp_path / "p.yaml", PLAYBOOKS))
    app = make_app(playbooks=pbs, prometheus_url=prometheus.url)
    http = app.test_client()

    busy.labels(JOB, host).set(0.93)
    until_scraped(prometheus, f'toy_host_cpu_busy{{job_name="{JOB}"}} > 0.8', True)
    rec = evaluate(app, r, fire(http, "t1"), loop)
    got = [(a["action"], a["status"], a["reason"]) for a in rec["actions"]]
    # True: applied. $gpu has no value for this alert: unknown. A step without `when:` just runs.
    assert got == [("scale_lr", "applied", None), ("set_lr", "skipped", "condition_unknown"),
                   ("empty_cache", "skipped", "no_cuda")]
    assert "$gpu has no value" in rec["actions"][1]["result"]["message"]

    busy.labels(JOB, host).set(0.2)
    until_scraped(prometheus, f'toy_host_cpu_busy{{job_name="{JOB}"}} > 0.8', False)
    rec = evaluate(app, r, fire(http, "t2"), loop)
    assert (rec["actions"][0]["status"], rec["actions"][0]["reason"]) == ("skipped", "condition_false")
    assert f'job_name="{JOB}"' in rec["actions"][0]["result"]["message"]

    unreachable = make_app(playbooks=pbs, prometheus_url=f"http://127.0.0.1:{free_port()}")
    rec = evaluate(unreachable, r, fire(unreachable.test_client(), "t3"), loop)
    assert (rec["actions"][0]["status"], rec["actions"][0]["reason"]) == ("skipped", "condition_unknown")
    assert "cannot be reached" in rec["actions"][0]["result"]["message"]

    none = make_app(playbooks=pbs)
    rec = evaluate(none, r, fire(none.test_client(), "t4"), loop)
    assert rec["actions"][0]["reason"] == "condition_unknown"
    assert "TRAINMEDIC_PROMETHEUS_URL is not set" in rec["actions"][0]["result"]["message"]
    loop.rc.close()


def test_variables_are_filled_in_escaped_and_only_inside_label_values() -> None:
    assert conditions.fill('up{job="$job", n=~"$node"}', {"job": 'a"b\\c', "node": "gpu-1.dc"}) == \
        'up{job="a\\"b\\\\c", n=~"gpu\\\\-1\\\\.dc"}'
    assert conditions.problem('up{job="x"} > $job') is not None
    assert "only inside a double-quoted label value" in (conditions.problem("sum by ($node) (up)") or "")
    assert "unknown variable $host" in (conditions.problem('up{h="$host"}') or "")
    with pytest.raises(conditions.MissingVariable):
        conditions.fill('up{gpu="$gpu"}', {"gpu": None})


BAD = """\
playbooks:
  - name: bad-when
    matchers: ['alertname="X"']
    target: job
    actions:
      - scale_lr: {factor: 0.5}
        when: 'rate(up[5m] > 0'
      - set_lr: {lr: 0.1}
        when: 'up{job="$job"} > 0'
      - empty_cache: {}
        when: 'avg(up) by ($job)'
"""


@pytest.mark.parametrize("parser", ["promtool", "own"])
def test_check_reports_bad_promql_at_its_line_with_promtool_or_without(parser: str, tmp_path: Path) -> None:
    path = write_playbooks(tmp_path / "bad.yaml", BAD)
    env = dict(os.environ)
    if parser == "own":
        env["PATH"] = str(Path(sys.executable).parent)  # trainmedic's venv, no promtool
    out = subprocess.run([sys.executable, "-m", "trainmedic.service.cli", "check", str(path)], env=env,
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 1, out
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"{path}:7: when is not valid PromQL: ")
    assert ("unclosed left parenthesis" in lines[0]) == (parser == "promtool")
    assert lines[1] == (f"{path}:11: $job may appear only inside a double-quoted label value, "
                        'like {job_name="$job"}')
    assert len(lines) == 2
