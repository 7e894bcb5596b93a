"""JSON logs: one object per line from gunicorn, the app and the CLI; remediation lines name id, fingerprint, target."""
from __future__ import annotations

import io
import json
import os
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import requests

from trainmedic.client.logs import JsonFormatter, gunicorn_config, remediation, setup
from tests.conftest import AUTH, load_fixture


def _record(msg: str, *args: Any, exc: bool = False, **extra: Any) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom\nsecond line")
        except RuntimeError:
            import sys
            exc_info = sys.exc_info()
    rec = logging.LogRecord("trainmedic.test", logging.WARNING, __file__, 1, msg, args, exc_info)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def _json_lines(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "no output at all"
    out = []
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(obj, dict), line
        out.append(obj)
    return out


def test_a_record_becomes_one_json_line_with_its_extras_at_the_top_level() -> None:
    line = JsonFormatter().format(_record("applied %s to %s", "scale_lr", "job:a",
                                          **remediation("01ABC~job~a", "071ff15f8faead0f", "job:a")))
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["msg"] == "applied scale_lr to job:a"
    assert obj["level"] == "warning"
    assert obj["logger"] == "trainmedic.test"
    assert obj["remediation_id"] == "01ABC~job~a"
    assert obj["fingerprint"] == "071ff15f8faead0f"
    assert obj["target"] == "job:a"
    assert obj["ts"].endswith("Z") and obj["ts"][10] == "T"


def test_a_traceback_stays_inside_the_one_line() -> None:
    line = JsonFormatter().format(_record("failed", exc=True))
    assert "\n" not in line
    obj = json.loads(line)
    assert "RuntimeError: boom\nsecond line" in obj["exc"]
    assert obj["exc"].startswith("Traceback")


def test_odd_extras_and_bad_arguments_never_lose_the_line() -> None:
    rec = _record("%d steps", "not a number", path=Path("/ckpt"), seen=object())
    obj = json.loads(JsonFormatter().format(rec))
    assert obj["msg"].startswith("%d steps")
    assert obj["path"] == "/ckpt"
    assert obj["seen"].startswith("<object object")


def test_an_extra_named_like_a_builtin_key_does_not_overwrite_it() -> None:
    obj = json.loads(JsonFormatter().format(_record("hello", level="nope", ts="then")))
    assert obj["level"] == "warning"
    assert obj["extra_level"] == "nope"
    assert obj["extra_ts"] == "then"


def test_remediation_fields_accept_a_target_object() -> None:
    from trainmedic.client.wire.keys import Target

    fields = remediation("r1", "fp", Target("node", "gpu-node-01"), playbook="p")
    assert fields == {"remediation_id": "r1", "fingerprint": "fp", "target": "node:gpu-node-01", "playbook": "p"}


def test_setup_twice_leaves_one_handler_and_captures_warnings() -> None:
    root = logging.getLogger()
    before = list(root.handlers)
    level = root.level
    buf = io.StringIO()
    try:
        setup("INFO", io.StringIO())
        setup("INFO", buf)
        ours = [h for h in root.handlers if getattr(h, "_trainmedic_json", False)]
        assert len(ours) == 1
        logging.getLogger("trainmedic.x").info("one %s", "two", extra={"target": "job:a"})
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("careful", UserWarning, stacklevel=1)
        objs = _json_lines(buf.getvalue())
        assert objs[0]["msg"] == "one two" and objs[0]["target"] == "job:a"
        assert any("careful" in o["msg"] and o["logger"] == "py.warnings" for o in objs)
    finally:
        for h in list(root.handlers):
            if h not in before:
                root.removeHandler(h)
        root.setLevel(level)
        logging.captureWarnings(False)


def test_the_gunicorn_config_routes_everything_through_the_json_formatter() -> None:
    cfg = gunicorn_config("info")
    assert cfg["formatters"]["json"]["()"] is JsonFormatter
    for handler in cfg["handlers"].values():
        assert handler["formatter"] == "json"
    assert cfg["root"]["handlers"] == ["console"]


def test_every_line_gunicorn_writes_is_json_and_the_remediation_line_names_id_fingerprint_and_target(
        gunicorn: Any) -> None:
    g = gunicorn(workers=2)
    body = load_fixture("firing_single.json")
    resp = requests.post(g.url + "/webhook", json=body, headers=AUTH, timeout=10)
    assert resp.status_code == 200, resp.text
    [made] = resp.json()["remediations"]
    # A resend must not log a second remediation line; a bad body and a 404 must not print plain text.
    assert requests.post(g.url + "/webhook", json=body, headers=AUTH, timeout=10).status_code == 200
    assert requests.post(g.url + "/webhook", data=b"{nope", headers={**AUTH, "Content-Type": "application/json"},
                         timeout=10).status_code == 400
    group = requests.post(g.url + "/webhook", json=load_fixture("firing_group.json"), headers=AUTH, timeout=10)
    assert group.status_code == 200
    assert requests.get(g.url + "/nowhere", timeout=10).status_code == 404
    g.stop()  # flushes and adds gunicorn's shutdown lines, which must be JSON too

    log_file = Path(g.log.name)
    objs = _json_lines(log_file.read_text())
    assert any(o["logger"] == "gunicorn.error" and "Booting worker" in o["msg"] for o in objs)
    assert any(o["logger"] == "gunicorn.error" and "Shutting down" in o["msg"] for o in objs)

    lines = [o for o in objs if o.get("remediation_id") == made["id"]]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line["fingerprint"] == "071ff15f8faead0f"
    assert line["target"] == "job:llama-ft-01"
    assert line["playbook"] == "loss-spike" and line["status"] == "dispatched"
    assert line["alertname"] == "TrainingLossSpike"
    assert made["id"] in line["msg"]

    node_lines = {o["target"]: o for o in objs if o.get("playbook") == "gpu-temperature-high"}
    assert set(node_lines) == {"node:gpu-node-01", "node:gpu-node-02"}
    ids = {r["id"] for r in group.json()["remediations"]}
    assert {o["remediation_id"] for o in node_lines.values()} == ids
    assert all(o["fingerprint"] for o in node_lines.values())


def test_every_log_line_of_trainmedic_serve_is_json(tmp_path: Path, redis_url: str, r: Any) -> None:
    import subprocess
    import sys

    from trainmedic.service.embedded_redis import free_port

    from tests.conftest import ROOT, TOKEN

    port = free_port()
    env = {"TRAINMEDIC_WEBHOOK_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"}
    err = open(tmp_path / "serve.err", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "trainmedic.service.cli", "serve", "--no-agent", "--workers", "1",
                             "--port", str(port), "--redis-url", redis_url, "--data-dir", str(tmp_path / "d")],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).ok:
                    break
            except requests.RequestException:
                time.sleep(0.1)
        else:
            raise AssertionError("serve did not come up: " + (tmp_path / "serve.err").read_text()[-2000:])
        body = load_fixture("firing_single.json")
        made = requests.post(f"http://127.0.0.1:{port}/webhook", json=body, headers=AUTH, timeout=10).json()
    finally:
        proc.terminate()
        proc.wait(20)
        err.close()
    objs = _json_lines((tmp_path / "serve.err").read_text())
    [line] = [o for o in objs if o.get("remediation_id") == made["remediations"][0]["id"]]
    assert line["target"] == "job:llama-ft-01" and line["fingerprint"] == "071ff15f8faead0f"


def _wait_acked(http: Any, record_id: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    record = http.get(f"/remediations/{record_id}").get_json()
    while record["status"] == "dispatched" and time.monotonic() < deadline:
        time.sleep(0.05)
        record = http.get(f"/remediations/{record_id}").get_json()
    return record


def test_the_training_client_logs_each_applied_action_with_id_fingerprint_and_target(
        http: Any, redis_url: str) -> None:
    import torch

    from trainmedic.client import RemediationClient
    from tests.conftest import post_json

    made = post_json(http, "/webhook", load_fixture("firing_single.json")).get_json()["remediations"]
    [rid] = [m["id"] for m in made]
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    buf = io.StringIO()
    try:
        setup("INFO", buf)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        with RemediationClient(job="llama-ft-01", redis_url=redis_url, optimizer=opt) as rc:
            deadline = time.monotonic() + 10
            acks: list = []
            while not acks and time.monotonic() < deadline:
                acks = rc.poll(step=1)
                time.sleep(0.01)
        assert [a.action for a in acks] == ["rollback_checkpoint", "scale_lr"]
    finally:
        for h in list(root.handlers):
            if h not in before:
                root.removeHandler(h)
        root.setLevel(level)
        logging.captureWarnings(False)
    lines = [o for o in _json_lines(buf.getvalue()) if o.get("remediation_id") == rid]
    assert {o["action"] for o in lines} == {"rollback_checkpoint", "scale_lr"}
    for o in lines:
        assert o["fingerprint"] == "071ff15f8faead0f"
        assert o["target"] == "job:llama-ft-01"
    # No rollback handler: the optional step is skipped, which fails nothing.
    assert _wait_acked(http, rid)["status"] == "applied"


def test_every_line_of_the_agent_is_json_and_its_action_lines_name_id_fingerprint_and_target(
        http: Any, redis_url: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT, VERIFY_KEY, post_json

    root = tmp_path / "checkpoints"
    (root / "run-1").mkdir(parents=True)
    err = open(tmp_path / "agent.err", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "trainmedic.service.cli", "agent", "--node", "gpu-node-07",
                             "--redis-url", redis_url, "--allow-root", str(root), "--state-dir", str(tmp_path / "s")],
                            cwd=ROOT, stdout=err, stderr=subprocess.STDOUT,
                            env={**os.environ, "TRAINMEDIC_VERIFY_KEY": VERIFY_KEY})
    try:
        alert = {"status": "firing", "labels": {"alertname": "DiskSpaceLow", "node": "gpu-node-07",
                                                "mountpoint": "/checkpoints", "severity": "warning"},
                 "annotations": {}, "startsAt": "2026-11-22T01:25:24.1Z", "fingerprint": "00000000000000d7"}
        made = post_json(http, "/webhook", {"version": "4", "status": "firing", "alerts": [alert]}).get_json()
        [rid] = [m["id"] for m in made["remediations"]]
        assert _wait_acked(http, rid)["status"] == "applied"
    finally:
        proc.terminate()
        proc.wait(15)
        err.close()
    objs = _json_lines((tmp_path / "agent.err").read_text())
    [line] = [o for o in objs if o.get("remediation_id") == rid]
    assert line["fingerprint"] == "00000000000000d7"
    assert line["target"] == "node:gpu-node-07"
    assert line["action"] == "disk_cleanup" and line["status"] == "applied"
