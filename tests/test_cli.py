"""The trainmedic command: serve, send, history, show, match, approve, reject, --version, and their one-line errors."""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from trainmedic.client import RemediationClient
from trainmedic.service.cli import main
from trainmedic.service.embedded_redis import free_port

from tests.conftest import OP_AUTH, OPERATOR, ROOT, TOKEN, load_fixture, write_playbooks
from tests.support.jobs import wait_until

CLI = [sys.executable, "-m", "trainmedic.service.cli"]
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}


def run(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**CLEAN_ENV, **(env or {})})


def one_line_error(proc: subprocess.CompletedProcess, code: int | None = None) -> str:
    assert proc.returncode != 0 and (code is None or proc.returncode == code), (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_bad_flags_are_a_one_line_error() -> None:
    assert "trainmedic" in one_line_error(run("serve", "--port", "x"), 2)
    assert one_line_error(run("frobnicate"), 2)


def test_version_names_the_installed_distribution() -> None:
    from importlib.metadata import version

    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"trainmedic {version('trainmedic')}"


OP = {"TRAINMEDIC_OPERATOR_TOKEN": OPERATOR}


@pytest.mark.parametrize("argv, words", [
    (["scael_lr", "factor=0.5"], "unknown action 'scael_lr': did you mean scale_lr?"),
    (["scale_lr", "factor=99"], "factor must be <= 10, not 99"),
    (["set_lr", "lr=nan"], "'nan' is not a finite number"),
    (["set_lr", "lr=1e999"], "'1e999' is not a finite number"),
    (["scale_lr", "factor=[1, 2]"], "factor must be a number"),
    (["power_limit", "watts=200"], "power_limit runs on a node agent, not in a training job (known for a job: "),
    (["scale_lr", "0.5"], "parameter '0.5' must be KEY=VALUE"),
])
def test_send_validates_the_action_and_its_params_like_check_before_anything_goes_out(argv: list, words: str) -> None:
    # Nothing listens at this URL: a refusal here happened before any request was made.
    msg = one_line_error(run("send", "--job", "j", "--url", f"http://127.0.0.1:{free_port()}", *argv, env=OP), 2)
    assert words in msg
    assert "--job" in one_line_error(run("send", "--job", "../x", "scale_lr", "factor=0.5", env=OP), 2)


def test_send_names_only_the_actions_a_job_can_be_sent() -> None:
    from trainmedic.client.wire.actions import CATALOGUE

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused before any request
    job_actions = sorted(name for name, spec in CATALOGUE.items() if spec.kind == "job")
    for argv in (["explode"], ["drain_node"]):
        msg = one_line_error(run("send", "--job", "j", "--url", url, *argv, env=OP), 2)
        listed = msg.split("known for a job: ")[1].rstrip(")").split(", ")
        assert listed == job_actions, msg
        assert not {"drain_node", "power_limit", "disk_cleanup", "checkpoint_jobs"} & set(listed)
    # The near name is looked for among a job's actions too: a node's resume_node is no suggestion for a job.
    assert "did you mean" not in one_line_error(run("send", "--job", "j", "--url", url, "resume_nod", env=OP), 2)


def test_send_raises_a_learning_rate_only_with_yes() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: a refusal happened before any request
    msg = one_line_error(run("send", "--job", "j", "--url", url, "scale_lr", "factor=5", env=OP), 2)
    assert msg == "trainmedic: scale_lr factor=5 raises the learning rate 5-fold; add --yes to send it"
    # With --yes (or a factor of 1 or less) it goes out: here, to a service that is not there.
    for argv in (["scale_lr", "factor=5", "--yes"], ["scale_lr", "factor=1"]):
        assert "cannot reach" in one_line_error(run("send", "--job", "j", "--url", url, *argv, env=OP), 1)


def test_send_says_when_the_service_is_unreachable_or_no_token_is_set() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert "cannot reach" in one_line_error(run("send", "--job", "j", "--url", url, "scale_lr", "factor=0.5",
                                                env=OP), 1)
    assert "TRAINMEDIC_OPERATOR_TOKEN" in one_line_error(run("send", "--job", "j", "--url", url, "scale_lr",
                                                             "factor=0.5"), 1)


def test_send_goes_through_the_service_and_waits_for_the_ack(gunicorn: Any, redis_url: str) -> None:
    import torch

    server = gunicorn(workers=1)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.2)
    with RemediationClient(job="cli-job", redis_url=redis_url, optimizer=opt, heartbeat_interval=0.2) as rc:
        outs = []
        for lr, more in (("0.05", []), ("0.025", ["--json"])):
            proc = subprocess.Popen([*CLI, "send", "--job", "cli-job", "--url", server.url, "--wait", "20", *more,
                                     "set_lr", f"lr={lr}"], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                    env={**CLEAN_ENV, **OP})
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline:
                rc.poll()
                time.sleep(0.01)
            outs.append(proc.communicate(timeout=5)[0])
            assert proc.returncode == 0, outs[-1]
    assert opt.param_groups[0]["lr"] == 0.025
    # Without --json: the line saying it was sent, then the record as `trainmedic show` prints it.
    sent, *shown = outs[0].splitlines()
    rid = shown[0]
    assert sent == f"sent set_lr to job cli-job: remediation {rid} (dispatched)"
    assert shown == run("show", rid, "--url", server.url, env=OP).stdout.splitlines()
    assert "  status      applied" in shown and any(line.startswith("    1. set_lr") for line in shown)
    # With --json: only the record, as the API gives it.
    record = json.loads(outs[1])
    assert record["status"] == "applied" and record["actions"][0]["result"]["old_lr"] == [0.05]
    assert record["requested_by"] == "operator" and record["playbook"] == "manual"


def test_send_explains_a_timeout_in_one_line(gunicorn: Any) -> None:
    server = gunicorn(workers=1)
    out = run("send", "--job", "nobody-runs-this", "--url", server.url, "--wait", "1", "scale_lr", "factor=0.5",
              env=OP)
    msg = one_line_error(out, 1)
    assert msg.startswith("trainmedic: scale_lr was not applied within 1s: no live target")


def test_approve_and_reject_show_what_is_decided_and_then_the_status_and_reason(gunicorn: Any,
                                                                                tmp_path: Path) -> None:
    path = write_playbooks(tmp_path / "held.yaml", "playbooks:\n  - name: held\n    matchers: ['alertname=\"Held\"']\n"
                           "    target: job\n    approval: true\n    actions: [{scale_lr: {factor: 0.5}}]\n")
    server = gunicorn(workers=1, TRAINMEDIC_PLAYBOOKS=str(path))
    ids = [requests.post(f"{server.url}/remediations", json={"playbook": "held", "labels": {"job_name": f"j{i}"}},
                         headers=OP_AUTH, timeout=5).json()["id"] for i in range(2)]
    alertname = requests.get(f"{server.url}/remediations/{ids[0]}", timeout=5).json()["alert"]["alertname"]
    out = run("approve", ids[0], "--url", server.url, "--comment", "looks right", "--yes", env=OP)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"remediation {ids[0]}", f"  playbook held on job:j0, alert {alertname}, status pending_approval",
        '  1. scale_lr {"factor": 0.5}', f"remediation {ids[0]}: dispatched", "  1. scale_lr: pending"], out.stdout
    out = run("reject", ids[1], "--url", server.url, "--yes", env=OP)
    assert out.returncode == 0 and out.stdout.splitlines()[-2:] == [
        f"remediation {ids[1]}: skipped (rejected)", "  1. scale_lr: skipped (rejected): A person rejected it."], \
        out.stdout
    # A prefix of 8 characters or more that names one record is enough (the service resolves it).
    out = run("approve", ids[1][:12], "--url", server.url, "--yes", env=OP)
    assert "is skipped, not pending approval" in one_line_error(out, 2)
    approved = requests.get(f"{server.url}/remediations/{ids[0]}", timeout=5).json()
    assert (approved["approved_by"], approved["approval_comment"]) == ("operator", "looks right")
    assert "is dispatched, not pending approval" in one_line_error(run("reject", ids[0], "--url", server.url,
                                                                       "--yes", env=OP), 2)


def test_approve_without_a_terminal_and_without_yes_refuses_in_one_line_and_changes_nothing(gunicorn: Any,
                                                                                            tmp_path: Path) -> None:
    path = write_playbooks(tmp_path / "held.yaml", "playbooks:\n  - name: held\n    matchers: ['alertname=\"Held\"']\n"
                           "    target: job\n    approval: true\n    actions: [{scale_lr: {factor: 0.5}}]\n")
    server = gunicorn(workers=1, TRAINMEDIC_PLAYBOOKS=str(path))
    rid = requests.post(f"{server.url}/remediations", json={"playbook": "held", "labels": {"job_name": "j"}},
                        headers=OP_AUTH, timeout=5).json()["id"]
    for verb in ("approve", "reject"):
        msg = one_line_error(run(verb, rid, "--url", server.url, env=OP), 2)
        assert msg == f"trainmedic: {verb} asks for confirmation on a terminal: pass --yes to {verb} without it"
    assert requests.get(f"{server.url}/remediations/{rid}", timeout=5).json()["status"] == "pending_approval"


def test_approve_on_a_terminal_asks_and_a_no_changes_nothing(gunicorn: Any, tmp_path: Path) -> None:
    import pty

    path = write_playbooks(tmp_path / "held.yaml", "playbooks:\n  - name: held\n    matchers: ['alertname=\"Held\"']\n"
                           "    target: job\n    approval: true\n    actions: [{scale_lr: {factor: 0.5}}]\n")
    server = gunicorn(workers=1, TRAINMEDIC_PLAYBOOKS=str(path))
    rid = requests.post(f"{server.url}/remediations", json={"playbook": "held", "labels": {"job_name": "j"}},
                        headers=OP_AUTH, timeout=5).json()["id"]

    def on_terminal(answer: str) -> str:
        main, sub = pty.openpty()
        proc = subprocess.Popen([*CLI, "approve", rid, "--url", server.url], stdin=sub, stdout=sub, stderr=sub,
                                cwd=ROOT, env={**CLEAN_ENV, **OP})
        os.close(sub)
        seen = b""
        while b"[y/N]" not in seen:
            seen += os.read(main, 4096)
        os.write(main, answer.encode() + b"\n")
        proc.wait(timeout=30)
        try:
            while chunk := os.read(main, 4096):
                seen += chunk
        except OSError:  # the terminal closed with the process
            pass
        os.close(main)
        return seen.decode()

    said = on_terminal("n")
    assert '1. scale_lr {"factor": 0.5}' in said and "approve this action? [y/N]" in said
    assert "not approved: nothing changed" in said
    assert requests.get(f"{server.url}/remediations/{rid}", timeout=5).json()["status"] == "pending_approval"
    said = on_terminal("y")
    assert f"remediation {rid}: dispatched" in said
    assert requests.get(f"{server.url}/remediations/{rid}", timeout=5).json()["status"] == "dispatched"


def test_serve_refuses_a_public_address_without_a_token() -> None:
    proc = run("serve", "--host", "0.0.0.0", "--no-agent", timeout=30)
    assert "without a webhook token" in one_line_error(proc, 1)


def test_serve_refuses_invalid_playbooks_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("playbooks:\n  - name: x\n    matchers: ['alertname=\"A\"']\n    target: job\n"
                   "    actions:\n      - explode: {}\n")
    msg = one_line_error(run("serve", "--no-agent", "--playbooks", str(bad), "--data-dir", str(tmp_path / "d")))
    assert f"{bad}:6: unknown action 'explode'" in msg


def test_a_port_in_use_is_one_sentence(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        msg = one_line_error(run("serve", "--no-agent", "--port", str(port), "--data-dir", str(tmp_path / "d")), 1)
        assert msg == (f"trainmedic: port {port} on 127.0.0.1 is in use: stop what listens there, or choose "
                       "another with --port")
        msg = one_line_error(run("serve", "--no-agent", "--port", str(free_port()), "--redis-port", str(port),
                                 "--data-dir", str(tmp_path / "d")), 1)
        assert msg == (f"trainmedic: cannot start the embedded Redis: port {port} on 127.0.0.1 is in use "
                       "(another trainmedic serve, or another Redis?); stop it, or choose another port with "
                       "--redis-port")


def _serve(tmp_path: Path, port: int, redis_port: int) -> tuple[subprocess.Popen, str]:
    """`trainmedic serve` until it answers; the process and what it printed so far."""
    proc = subprocess.Popen([*CLI, "serve", "--port", str(port), "--redis-port", str(redis_port), "--workers", "2",
                             "--no-agent", "--data-dir", str(tmp_path / "data")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=CLEAN_ENV)
    assert proc.stdout is not None
    lines: list[str] = []
    while not any("max_alerts: 0" in line for line in lines):  # the last line of what it prints at start
        line = proc.stdout.readline()
        assert line, "".join(lines)
        lines.append(line)
    wait_until(lambda: _ready(port), timeout=40, what="serve to answer")
    return proc, "".join(lines)


def _ready(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/readyz", timeout=1).ok
    except requests.RequestException:
        return False


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    return out


def _exported(out: str, name: str) -> str:
    [line] = [x for x in out.splitlines() if x.startswith(f"export {name}=")]
    return line.split("=", 1)[1].strip("'")


def test_serve_prints_a_redis_url_that_stays_the_same_across_restarts(tmp_path: Path) -> None:
    port, redis_port = free_port(), free_port()
    proc, out = _serve(tmp_path, port, redis_port)
    assert "receivers:" in out and f"url: http://127.0.0.1:{port}/webhook" in out
    try:
        url, verify, token = (_exported(out, n) for n in ("TRAINMEDIC_REDIS_URL", "TRAINMEDIC_VERIFY_KEY",
                                                          "TRAINMEDIC_OPERATOR_TOKEN"))
        assert url.startswith("redis://:") and url.endswith(f"@127.0.0.1:{redis_port}/0")
        # The password, token and signing key were made once into the data dir, readable by its owner only.
        for name in ("redis/password", "operator.token", "signing.key"):
            mode = stat.S_IMODE((tmp_path / "data" / name).stat().st_mode)
            assert mode == 0o600, (name, oct(mode))
        assert (tmp_path / "data" / "operator.token").read_text().strip() == token
        import redis

        assert redis.Redis.from_url(url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=redis_port).ping()
        # People's writes need the operator token: no loopback exception.
        trigger = {"playbook": "loss-spike", "labels": {"job_name": "j"}}
        assert requests.post(f"http://127.0.0.1:{port}/remediations", json=trigger, timeout=5).status_code == 401
        made = requests.post(f"http://127.0.0.1:{port}/remediations", json=trigger, timeout=5,
                             headers={"Authorization": f"Bearer {token}"})
        assert made.status_code == 201
    finally:
        _stop(proc)
    assert (tmp_path / "data" / "redis" / "appendonlydir").is_dir()  # AOF persistence on
    proc, again = _serve(tmp_path, port, redis_port)
    try:
        assert [_exported(again, n) for n in ("TRAINMEDIC_REDIS_URL", "TRAINMEDIC_VERIFY_KEY",
                                              "TRAINMEDIC_OPERATOR_TOKEN")] == [url, verify, token]
        rid = made.json()["id"]
        assert requests.get(f"http://127.0.0.1:{port}/remediations/{rid}", timeout=5).status_code == 200  # kept
    finally:
        _stop(proc)
    # Nothing it started is left: the embedded redis-server (its --dir is under tmp_path) and gunicorn.
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).returncode == 1
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def _trigger(url: str, job: str) -> str:
    resp = requests.post(url + "/remediations", json={"playbook": "loss-spike", "labels": {"job_name": job}},
                         headers=OP_AUTH, timeout=5)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def test_history_prints_a_header_and_each_records_full_id_newest_first(gunicorn: Any) -> None:
    server = gunicorn(workers=1)
    ids = [_trigger(server.url, job) for job in ("j1", "j2")]
    proc = run("history", "--url", server.url, "--limit", "5")
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()
    assert header.split() == ["ID", "CREATED", "STATUS", "PLAYBOOK", "TARGET", "ALERT", "ACTIONS", "OUTCOME"]
    assert [row.split()[0] for row in rows] == [ids[1], ids[0]]
    assert "job:j2" in rows[0] and "job:j1" in rows[1] and "loss-spike" in rows[0]
    # Columns line up under their headers.
    assert rows[0].index("loss-spike") == header.index("PLAYBOOK")
    as_json = run("history", "--url", server.url, "--json")
    assert [json.loads(x)["target"]["name"] for x in as_json.stdout.splitlines()] == ["j2", "j1"]


def test_show_prints_one_record_by_its_id_or_a_unique_prefix(gunicorn: Any) -> None:
    server = gunicorn(workers=1)
    rid = _trigger(server.url, "shown")
    api = requests.get(f"{server.url}/remediations/{rid}", timeout=5).json()
    for text in (rid, rid[:8], rid[:12].lower()):
        proc = run("show", text, "--url", server.url)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0] == rid
        assert "  playbook    loss-spike" in lines and "  target      job:shown" in lines
        assert any(x.startswith("    1. ") for x in lines), lines
    as_json = run("show", rid[:10], "--url", server.url, "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == api


def test_show_refuses_an_unknown_short_or_ambiguous_prefix_in_one_line(gunicorn: Any) -> None:
    server = gunicorn(workers=1)
    body = load_fixture("firing_single.json")
    body["alerts"] = [{**body["alerts"][0], "labels": {**body["alerts"][0]["labels"], "job_name": f"twin-{i}"},
                       "fingerprint": f"twin{i}"} for i in range(2)]
    made = requests.post(f"{server.url}/webhook", json=body, timeout=5,
                         headers={"Authorization": f"Bearer {TOKEN}"}).json()["remediations"]
    common = os.path.commonprefix([m["id"] for m in made])
    assert len(made) == 2 and len(common) >= 8  # one notification's records are made microseconds apart
    assert "is the start of 2 remediation ids" in one_line_error(run("show", common, "--url", server.url), 2)
    assert "no remediation with id '0000000000'" in one_line_error(run("show", "0000000000", "--url", server.url), 2)
    assert "at least 8 characters" in one_line_error(run("show", common[:5], "--url", server.url), 2)


def test_a_refused_token_names_the_variable_to_set(gunicorn: Any) -> None:
    server = gunicorn(workers=1, TRAINMEDIC_READ_TOKEN="reader-s3cret")
    for argv in (["history"], ["show", "0123456789"]):
        msg = one_line_error(run(*argv, "--url", server.url, env={"TRAINMEDIC_READ_TOKEN": "wrong-token"}), 1)
        assert "HTTP 401" in msg and msg.endswith(": set TRAINMEDIC_READ_TOKEN (or TRAINMEDIC_OPERATOR_TOKEN) to a "
                                                  "token this service reads with: its read token or an operator token")
    wrong = {"TRAINMEDIC_OPERATOR_TOKEN": "wrong-token"}
    for argv in (["send", "--job", "j", "scale_lr", "factor=0.5"], ["approve", "0123456789", "--yes"]):
        msg = one_line_error(run(*argv, "--url", server.url, env=wrong), 1)
        assert "HTTP 401" in msg and msg.endswith(": set TRAINMEDIC_OPERATOR_TOKEN to an operator token of this "
                                                  "service"), msg


def test_history_and_show_send_the_read_token_else_the_operator_token(gunicorn: Any) -> None:
    server = gunicorn(workers=1, TRAINMEDIC_READ_TOKEN="reader-s3cret")
    rid = _trigger(server.url, "guarded")
    assert "HTTP 401: reading needs an Authorization: Bearer token" in one_line_error(run("history", "--url",
                                                                                         server.url), 1)
    for env in ({"TRAINMEDIC_READ_TOKEN": "reader-s3cret"}, OP):
        assert run("history", "--url", server.url, env=env).stdout.splitlines()[1].startswith(rid)
        assert run("show", rid[:9], "--url", server.url, env=env).stdout.splitlines()[0] == rid
    assert "HTTP 401" in one_line_error(run("show", rid, "--url", server.url), 1)


def test_history_follow_prints_only_records_newer_than_those_shown(gunicorn: Any) -> None:
    server = gunicorn(workers=1)
    old = [_trigger(server.url, f"old-{i}") for i in range(3)]
    proc = subprocess.Popen([*CLI, "history", "--url", server.url, "--limit", "1", "--follow", "--json"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=CLEAN_ENV)
    assert proc.stdout is not None
    try:
        first = json.loads(proc.stdout.readline())
        new = [_trigger(server.url, f"new-{i}") for i in range(2)]
        shown = [json.loads(proc.stdout.readline())["id"] for _ in new]
    finally:
        proc.terminate()
        proc.wait(10)
    assert first["id"] == old[-1]
    assert shown == new  # in the order they were made, and none of the older ones again


def test_history_against_nothing_is_a_one_line_error() -> None:
    assert "cannot reach" in one_line_error(run("history", "--url", f"http://127.0.0.1:{free_port()}"), 1)


def test_check_accepts_the_shipped_playbooks(capsys: Any) -> None:
    assert main(["check", str(ROOT / "playbooks")]) == 0
    from trainmedic.service.rules.playbooks import load

    assert capsys.readouterr().out.startswith(f"ok: {len(load([ROOT / 'playbooks']))} playbooks")


PAYLOAD = {"version": "4", "status": "firing", "receiver": "trainmedic", "alerts": [
    {"status": "firing", "startsAt": "2026-11-22T08:40:00Z",
     "labels": {"alertname": "TrainingLossSpike", "job_name": "llama-ft-01", "severity": "critical"}},
    {"status": "resolved", "labels": {"alertname": "GPUTemperatureHigh", "instance": "gpu-1:9400", "gpu_id": "0"},
     "startsAt": "2026-11-22T08:40:00Z"},
    {"status": "firing", "labels": {"alertname": "SomethingElse"}, "startsAt": "2026-11-22T08:40:00Z"}]}
# Neither Redis nor the service is there: `match` needs neither.
NOTHING = {"TRAINMEDIC_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "TRAINMEDIC_URL": "http://127.0.0.1:1"}


def test_match_says_what_each_alert_would_match_and_do_without_redis_or_the_service(tmp_path: Path) -> None:
    path = tmp_path / "payload.json"
    path.write_text(json.dumps(PAYLOAD))
    expected = [
        "alert 1: TrainingLossSpike (firing) job_name=llama-ft-01 severity=critical",
        '  loss-spike: job:llama-ft-01: rollback_checkpoint {} (optional), scale_lr {"factor": 0.5, "min_lr": 1e-07}',
        "alert 2: GPUTemperatureHigh (resolved) gpu_id=0 instance=gpu-1:9400",
        "  gpu-temperature-high: node:gpu-1: on_resolved: restore_power_limit {}",
        "alert 3: SomethingElse (firing)",
        "  no playbook",
    ]
    from_file = run("match", str(path), env=NOTHING)
    assert from_file.returncode == 0 and from_file.stdout.splitlines() == expected, from_file.stderr
    for argv in (["match", "-"], ["match"]):
        piped = subprocess.run([*CLI, *argv], input=json.dumps(PAYLOAD), capture_output=True, text=True, timeout=60,
                               cwd=ROOT, env={**CLEAN_ENV, **NOTHING})
        assert piped.returncode == 0 and piped.stdout.splitlines() == expected, piped.stderr


def test_match_uses_the_playbooks_it_is_given_and_says_when_a_target_is_missing(tmp_path: Path) -> None:
    path = write_playbooks(tmp_path / "own.yaml", "playbooks:\n  - name: held\n    matchers: ['alertname=~\".+\"']\n"
                           "    target: job\n    approval: true\n    actions: [{scale_lr: {factor: 0.5}}]\n")
    (tmp_path / "payload.json").write_text(json.dumps(PAYLOAD))
    out = run("match", str(tmp_path / "payload.json"), "--playbooks", str(path), env=NOTHING)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1] == '  held: job:llama-ft-01: scale_lr {"factor": 0.5} (held for approval)'
    assert out.stdout.splitlines()[-1] == ("  held: no target (the alert has no job_name or job label): recorded as "
                                           "skipped, nothing sent")


@pytest.mark.parametrize("text, words", [
    ("{", "payload.json is not valid JSON"),
    ('{"version": "3", "alerts": []}', "not an Alertmanager webhook payload: payload version '3' is not supported"),
    ('{"alerts": [{"status": "firing", "labels": {}}]}',
     "not an Alertmanager webhook payload: alerts[0].labels must include alertname"),
    ('[1, 2]', "not an Alertmanager webhook payload: the body must be a JSON object"),
])
def test_match_refuses_an_invalid_payload_with_exit_2(tmp_path: Path, text: str, words: str) -> None:
    (tmp_path / "payload.json").write_text(text)
    assert words in one_line_error(run("match", str(tmp_path / "payload.json"), env=NOTHING), 2)
    assert "cannot read" in one_line_error(run("match", str(tmp_path / "missing.json"), env=NOTHING), 2)
