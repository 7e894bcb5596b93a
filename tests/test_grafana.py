"""config/grafana/: every PromQL expression of the dashboards (panels and annotations) parses and returns data
from the real Prometheus scraping the service under gunicorn and a real training job, after remediations
with acks and outcomes."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import pytest
import requests
import yaml

from tests.conftest import ROOT, post_json, write_playbooks
from tests.e2e.test_outcomes_e2e import Job
from tests.support.stack import Prometheus

GRAFANA = ROOT / "config" / "grafana"
PLAYBOOK = """\
playbooks:
  - name: toy-halve
    matchers: ['alertname="ToyLossHigh"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
"""


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) of every panel target and annotation."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in dashboard["panels"] for t in p.get("targets", ())]
    out += [(f"annotation {a['name']!r}", a["expr"]) for a in dashboard["annotations"]["list"]]
    return out


def test_the_provisioning_files_point_at_the_dashboards() -> None:
    [ds] = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["uid"] == "prometheus"
    [provider] = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "trainmedic.yml").read_text())["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]
    assert "./config/grafana/dashboards:/var/lib/grafana/dashboards:ro" in compose["volumes"]
    uids = set()
    for path in sorted((GRAFANA / "dashboards").glob("*.json")):
        d = json.loads(path.read_text())
        uids.add(d["uid"])
        for p in d["panels"]:
            assert all(t["datasource"]["uid"] == ds["uid"] for t in p["targets"]), path
    assert {"trainmedic", "trainmedic-training"} <= uids


@pytest.fixture
def scraped(gunicorn: Callable[..., Any], redis_url: str, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """Prometheus scraping the service and a job that took two effective remediations, a few seconds apart."""
    playbooks = write_playbooks(tmp_path / "toy.yaml", PLAYBOOK)
    server = gunicorn(workers=2, TRAINMEDIC_PLAYBOOKS=str(playbooks))
    job = Job(tmp_path, "graphed", redis_url, "stuck")
    prom = Prometheus(tmp_path, [f"127.0.0.1:{job.port}", server.url.removeprefix("http://")], [], "127.0.0.1:9")
    http = requests.Session()
    try:
        for i in range(2):
            time.sleep(4)  # a few scrapes between them: counters rise, so increase() sees them
            starts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 5))
            alert = {"status": "firing", "labels": {"alertname": "ToyLossHigh", "job_name": "graphed"},
                     "annotations": {}, "startsAt": starts, "endsAt": "0001-01-01T00:00:00Z",
                     "fingerprint": f"feed{i}", "generatorURL": ""}
            body = {"version": "4", "status": "firing", "receiver": "t", "alerts": [alert]}
            resp = post_json(_Client(http, server.url), "/webhook", body)
            assert resp.status_code == 200
            [made] = resp.json()["remediations"]
            deadline = time.monotonic() + 30
            while http.get(f"{server.url}/remediations/{made['id']}").json()["status"] != "applied":
                assert time.monotonic() < deadline, "the job did not apply the remediation"
                time.sleep(0.2)
            ends = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))
            resolved = {**body, "status": "resolved", "alerts": [{**alert, "status": "resolved", "endsAt": ends}]}
            assert post_json(_Client(http, server.url), "/webhook", resolved).status_code == 200
            while (http.get(f"{server.url}/remediations/{made['id']}").json()["outcome"] or {}).get(
                    "status") != "effective":
                assert time.monotonic() < deadline, "the outcome was not decided"
                time.sleep(0.2)
        time.sleep(5)  # Prometheus scrapes the counters after the last change
        yield prom.url, http
    finally:
        job.kill()
        prom.stop()


class _Client:
    """post_json's interface over requests, for a real server."""

    def __init__(self, session: requests.Session, base: str):
        self.session, self.base = session, base

    def post(self, path: str, data: str, content_type: str, headers: dict) -> requests.Response:
        return self.session.post(self.base + path, data=data, headers={**headers, "Content-Type": content_type},
                                 timeout=10)


def test_every_dashboard_expression_parses_and_returns_data(scraped: tuple[str, Any]) -> None:
    url, http = scraped
    checked = 0
    now = time.time()
    for path in sorted((GRAFANA / "dashboards").glob("*.json")):
        for where, expr in expressions(json.loads(path.read_text())):
            answer = http.get(url + "/api/v1/query_range", params={"query": expr, "start": now - 120, "end": now,
                                                                  "step": 2}, timeout=10).json()
            assert answer["status"] == "success", f"{path.name}, {where}: {answer.get('error')}"
            assert answer["data"]["result"], f"{path.name}, {where}: no data for {expr}"
            checked += 1
    assert checked >= 16
    titles = {p["title"] for p in json.loads((GRAFANA / "dashboards" / "trainmedic.json").read_text())["panels"]}
    assert {"Goodput by job", "Time lost by kind (last hour)"} <= titles  # the job's goodput series, from a real job
