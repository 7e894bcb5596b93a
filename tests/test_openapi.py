"""GET /openapi.json describes the API as it behaves: schemathesis fuzzes the running service against it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import requests

from trainmedic.service.store import views

from tests.conftest import AUTH, OP_AUTH, OPERATOR, ROOT, TOKEN, load_fixture, post_json

MAX_EXAMPLES = 25  # per operation and phase; the whole run stays well under a minute
APPROVAL_PLAYBOOK = """
playbooks:
  - name: held-lr-cut
    matchers: ['alertname="NeedsAPerson"']
    target: job
    actions:
      - scale_lr: {factor: 0.5, min_lr: 1.0e-7}
    approval: true
"""

# The README's HTTP API table: every method, path and status code it promises.
PROMISED = {
    ("post", "/webhook"): {"200", "400", "401", "413", "415", "503"},
    ("get", "/history"): {"200", "400"},
    ("get", "/remediations/{id}"): {"200", "404"},
    ("post", "/remediations"): {"201", "400", "401", "403", "404", "415"},
    ("post", "/commands"): {"201", "400", "401", "403", "415"},
    ("post", "/remediations/{id}/approve"): {"200", "401", "403", "404", "409", "415"},
    ("post", "/remediations/{id}/reject"): {"200", "401", "403", "404", "409", "415"},
    ("get", "/targets"): {"200"},
    ("get", "/healthz"): {"200"},
    ("get", "/readyz"): {"200", "503"},
    ("get", "/metrics"): {"200"},
    ("get", "/"): {"200"},
    ("get", "/openapi.json"): {"200"},
}


def test_the_document_names_every_endpoint_and_status_of_the_contract(http: Any) -> None:
    resp = http.get("/openapi.json")
    assert resp.status_code == 200 and resp.mimetype == "application/json"
    doc = resp.get_json()
    assert doc["openapi"].startswith("3.0.")
    for (method, path), statuses in PROMISED.items():
        op = doc["paths"][path][method]
        assert statuses <= set(op["responses"]), (method, path, statuses - set(op["responses"]))
        errors = [code for code in op["responses"] if code[0] in "45"]
        for code in errors:
            content = op["responses"][code].get("content", {})
            if "application/json" in content:
                assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
        # A bearer token on every write: Alertmanager's for the webhook, people's for the rest. Every read but the
        # probes and the scrape takes the read token or an operator token, needed only when a read token is set.
        wanted = ([{"webhook": []}] if path == "/webhook" else [{"operator": []}] if method == "post" else
                  None if path in ("/healthz", "/readyz", "/metrics") else [{}, {"read": []}, {"operator": []}])
        assert op.get("security") == wanted, (method, path)
        if wanted and wanted[0] == {}:
            assert {"401", "403"} <= set(op["responses"]), path
    assert set(doc["components"]["securitySchemes"]) == {"webhook", "operator", "read"}
    assert "operator:NAME" in doc["components"]["securitySchemes"]["operator"]["description"]
    record = doc["components"]["schemas"]["Record"]
    # The record's fields as the README lists them, described by the module that writes them.
    assert set(record["required"]) == {
        "id", "created_at", "playbook", "status", "reason", "alert", "target", "actions", "requested_by",
        "approved_by", "approved_at", "rejected_by", "rejected_at", "approval_comment", "outcome", "escalation",
        "silence_id", "silence_error"}
    assert record == views.SCHEMA["Record"]
    action = doc["components"]["schemas"]["RecordAction"]
    assert set(action["properties"]["status"]["enum"]) == {"pending", "delivered", "applied", "failed", "unsupported",
                                                           "expired", "skipped", "lost"}


def test_a_manual_trigger_offers_the_loaded_playbooks(http: Any) -> None:
    doc = http.get("/openapi.json").get_json()
    offered = doc["components"]["schemas"]["ManualTrigger"]["properties"]["playbook"]["enum"]
    shipped = re.findall(r"^  - name: (\S+)", (ROOT / "playbooks" / "default.yaml").read_text(), re.M)
    assert offered == shipped and len(shipped) == 10


def test_a_405_names_the_methods_that_are_allowed(http: Any) -> None:
    resp = http.delete("/history")
    assert resp.status_code == 405
    assert set(resp.headers["Allow"].replace(" ", "").split(",")) >= {"GET", "HEAD", "OPTIONS"}
    assert resp.get_json() == {"error": "this method is not allowed here"}


def test_a_manual_trigger_refuses_labels_that_are_not_an_object(http: Any) -> None:
    for bad in (0, "", [], False):
        resp = post_json(http, "/remediations", {"playbook": "loss-spike", "labels": bad})
        assert resp.status_code == 400, bad
        assert "labels" in resp.get_json()["error"]
    assert post_json(http, "/remediations", {"playbook": "loss-spike", "labels": None}).status_code == 201


def test_schemathesis_finds_nothing_wrong_with_the_running_service(gunicorn: Any, tmp_path: Path) -> None:
    playbooks = tmp_path / "playbooks"
    playbooks.mkdir()
    shutil.copy(ROOT / "playbooks" / "default.yaml", playbooks / "default.yaml")
    (playbooks / "approval.yaml").write_text(APPROVAL_PLAYBOOK)
    g = gunicorn(workers=2, TRAINMEDIC_PLAYBOOKS=str(playbooks))
    # Some history to describe: a dispatched record, a bad-label one, one held for approval.
    assert requests.post(g.url + "/webhook", json=load_fixture("firing_single.json"), headers=AUTH,
                         timeout=10).status_code == 200
    for body in ({"playbook": "loss-spike", "labels": {"job_name": "../x"}},
                 {"playbook": "held-lr-cut", "labels": {"job_name": "llama-ft-02"}}):
        assert requests.post(g.url + "/remediations", json=body, headers=OP_AUTH, timeout=10).status_code == 201

    st = Path(sys.executable).with_name("st")
    proc = subprocess.run(
        [str(st), "--config-file", str(ROOT / "tests" / "schemathesis.toml"), "run", g.url + "/openapi.json",
         "--checks", "all", "--max-examples", str(MAX_EXAMPLES), "--workers", "1",
         "--generation-database", "none", "--request-timeout", "10", "--no-color"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TRAINMEDIC_TEST_OPERATOR_TOKEN": OPERATOR, "TRAINMEDIC_TEST_WEBHOOK_TOKEN": TOKEN})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    # Every operation was tested, but the document itself (schemathesis leaves out the URL it loaded).
    operations = len(requests.get(g.url + "/openapi.json", timeout=10).json()["paths"]) - 1
    tested = re.search(r"Tested: (\d+)", out)
    assert tested and int(tested.group(1)) >= operations, out[-3000:]
    for phase in ("Examples", "Coverage", "Fuzzing", "Stateful"):
        assert re.search(rf"✅\s+{phase}", out), (phase, out[-3000:])
    generated = re.search(r"(\d+) generated, (\d+) passed", out)
    assert generated and int(generated.group(1)) > 100 and generated.group(1) == generated.group(2), out[-3000:]
