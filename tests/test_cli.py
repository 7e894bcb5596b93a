"""The trainmedic command: serve, send, history and its one-line errors."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from trainmedic.client import RemediationClient
from trainmedic.client.wire import keys
from trainmedic.service.cli import main
from trainmedic.service.embedded_redis import free_port

from tests.conftest import ROOT

CLI = [sys.executable, "-m", "trainmedic.service.cli"]


def run(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_bad_flags_are_a_one_line_error() -> None:
    assert "trainmedic" in one_line_error(run("serve", "--port", "x"))
    assert one_line_error(run("frobnicate"))


def test_send_needs_a_reachable_redis() -> None:
    msg = one_line_error(run("send", "--job", "j", "scale_lr", "factor=0.5",
                             env={"TRAINMEDIC_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}))
    assert "cannot reach Redis" in msg


def test_send_refuses_bad_parameters_and_names(redis_url) -> None:
    env = {"TRAINMEDIC_REDIS_URL": redis_url}
    assert "factor" in one_line_error(run("send", "--job", "j", "scale_lr", "factor=99", env=env))
    assert "runs on a node" in one_line_error(run("send", "--job", "j", "power_limit", "watts=200", env=env))
    assert "--job" in one_line_error(run("send", "--job", "../x", "scale_lr", "factor=0.5", env=env))
    assert "KEY=VALUE" in one_line_error(run("send", "--job", "j", "scale_lr", "0.5", env=env))


def test_send_reaches_a_training_client_and_waits_for_its_ack(r, redis_url, capsys) -> None:
    import torch

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with RemediationClient(job="cli-job", redis_url=redis_url, optimizer=opt) as rc:
        proc = subprocess.Popen([*CLI, "send", "--job", "cli-job", "--redis-url", redis_url, "--wait", "20",
                                 "set_lr", "lr=0.05"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            rc.poll()
            time.sleep(0.01)
        out = proc.communicate(timeout=5)[0]
    assert proc.returncode == 0, out
    assert opt.param_groups[0]["lr"] == 0.05
    record = json.loads(out[out.index("{"):])
    assert record["status"] == "applied" and record["actions"][0]["result"]["old_lr"] == [0.2]


def test_serve_refuses_a_public_address_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    proc = subprocess.run([*CLI, "serve", "--host", "0.0.0.0", "--no-agent"], capture_output=True, text=True,
                          timeout=30, cwd=ROOT, env=env)
    assert "without a token" in one_line_error(proc)


def test_serve_refuses_invalid_playbooks_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("playbooks:\n  - name: x\n    matchers: ['alertname=\"A\"']\n    target: job\n"
                   "    actions:\n      - explode: {}\n")
    msg = one_line_error(run("serve", "--no-agent", "--playbooks", str(bad), "--data-dir", str(tmp_path / "d")))
    assert f"{bad}:6: unknown action 'explode'" in msg


def test_serve_runs_gunicorn_on_an_embedded_redis_and_stops_everything(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    proc = subprocess.Popen([*CLI, "serve", "--port", str(port), "--workers", "2", "--no-agent",
                             "--data-dir", str(tmp_path / "data")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 40
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, "serve did not come up"
            try:
                if requests.get(f"http://127.0.0.1:{port}/readyz", timeout=1).ok:
                    break
            except requests.RequestException:
                time.sleep(0.2)
        resp = requests.post(f"http://127.0.0.1:{port}/remediations", json={"playbook": "loss-spike",
                             "labels": {"job_name": "j"}}, timeout=5)
        assert resp.status_code == 201  # loopback, no token: writes allowed
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert "receivers:" in out and f"/webhook" in out
    assert (tmp_path / "data" / "redis" / "appendonlydir").is_dir()  # AOF persistence on
    # Nothing it started is left: the embedded redis-server (its --dir is under tmp_path) and gunicorn.
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).returncode == 1
    import socket
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_history_prints_records(gunicorn, r) -> None:
    server = gunicorn(workers=1)
    requests.post(server.url + "/remediations", json={"playbook": "loss-spike", "labels": {"job_name": "j1"}},
                  headers={"Authorization": "Bearer s3cret-token"}, timeout=5)
    proc = run("history", "--url", server.url, "--limit", "5")
    assert proc.returncode == 0 and "loss-spike" in proc.stdout and "job:j1" in proc.stdout
    as_json = run("history", "--url", server.url, "--json")
    assert json.loads(as_json.stdout.splitlines()[0])["playbook"] == "loss-spike"


def test_history_against_nothing_is_a_one_line_error() -> None:
    assert "cannot reach" in one_line_error(run("history", "--url", f"http://127.0.0.1:{free_port()}"))


def test_check_accepts_the_shipped_playbooks(capsys) -> None:
    assert main(["check", str(ROOT / "playbooks")]) == 0
    assert capsys.readouterr().out.startswith("ok: 5 playbooks")
