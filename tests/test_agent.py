"""`trainmedic agent` as a real process: heartbeat, mailbox protocol, expiry, bad commands, signals, Redis restarts."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from trainmedic.client.wire import keys
from trainmedic.service.embedded_redis import EmbeddedRedis

from trainmedic.client.wire.signing import Signer

from tests.conftest import ROOT, SIGNING_KEY, VERIFY_KEY
from tests.support import jobs
from tests.support.nvml import AgentProcess, wait_record

NODE = "gpu-node-3"


def inject(r: redis.Redis, steps: list[tuple[str, dict]], node: str = NODE, context: dict | None = None,
           expire_after: float = 3600.0) -> str:
    """A command to this test's node, validated by nothing but the agent itself; its record id."""
    return jobs.inject(r, keys.Target("node", node), steps, context, expire_after)


def test_it_heartbeats_so_get_targets_lists_it(agents, nvml_lib, nvml_state, http, r, tmp_path: Path) -> None:
    (tmp_path / "ckpts").mkdir()
    agent = agents(NODE, lib_dir=nvml_lib, state=nvml_state, allow_roots=[tmp_path / "ckpts"])
    agent.wait_ready(r)
    # Listed once the service has heard the agent announce itself (on the node's own channel).
    t = jobs.wait_until(lambda: next((t for t in http.get("/targets").get_json()["targets"]
                                 if (t["kind"], t["name"]) == ("node", NODE)), None), what="the agent listed")
    assert t["pid"] == agent.proc.pid and t["host"] and t["age_seconds"] < 30
    assert [g["uuid"] for g in t["gpus"]] == ["GPU-0a1b2c3d-0000-1111-2222-333344445555",
                                             "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"]
    assert t["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert t["allow_roots"] == [str(tmp_path / "ckpts")] and t["dry_run"] is False


def test_it_stops_cleanly_on_sigterm_and_on_sigint(agents, r) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        agent = agents(NODE)
        agent.wait_ready(r)
        t0 = time.monotonic()
        assert agent.stop(sig) == 0
        assert time.monotonic() - t0 < 8
        assert "Traceback" not in agent.log() and f"agent for node {NODE} stopped" in agent.log()


def test_commands_sent_while_it_was_down_are_applied_when_it_starts(agents, r, tmp_path: Path) -> None:
    (tmp_path / "ckpts").mkdir()
    rid = inject(r, [("disk_cleanup", {"keep_last": 1})])
    agents(NODE, allow_roots=[tmp_path / "ckpts"]).wait_ready(r)
    rec = wait_record(r, rid)
    assert rec["status"] == "applied" and rec["actions"][0]["result"]["deleted"] == []


def test_a_command_that_expired_before_it_started_is_acked_expired(agents, r, tmp_path: Path) -> None:
    (tmp_path / "ckpts").mkdir()
    rid = inject(r, [("disk_cleanup", {}), ("restore_power_limit", {})], expire_after=0.3)
    time.sleep(0.5)
    agents(NODE, allow_roots=[tmp_path / "ckpts"]).wait_ready(r)
    rec = wait_record(r, rid)
    assert rec["status"] == "expired"
    assert [a["status"] for a in rec["actions"]] == ["expired", "expired"]
    assert [a["reason"] for a in rec["actions"]] == ["expired", "expired"]
    assert rec["actions"][0]["result"]["message"] == "The command expired before anyone applied it."


def test_unknown_and_in_loop_actions_are_unsupported_and_bad_params_fail(agents, r) -> None:
    agent = agents(NODE)
    agent.wait_ready(r)
    rid = inject(r, [("reboot_node", {}), ("scale_lr", {"factor": 0.5}), ("power_limit", {"watts": 100,
                                                                                          "fraction": 0.5}),
                     ("disk_cleanup", {"patterns": ["../../etc/*"]})])
    rec = wait_record(r, rid)
    # One shape on both sides (the training client answers the same): a reason code, and a sentence.
    got = [(a["status"], a["reason"], a["result"].get("error") or a["result"].get("message")) for a in rec["actions"]]
    assert got == [
        ("unsupported", "unsupported", "Unknown action 'reboot_node'."),
        ("unsupported", "unsupported", "scale_lr runs in a training job, not on a node agent."),
        ("failed", "bad_params", "Bad parameters for power_limit: power_limit needs exactly one of 'watts' or "
                                 "'fraction'."),
        ("failed", "bad_params", "Bad parameters for disk_cleanup: patterns: pattern '../../etc/*' must name an "
                                 "entry, not a path."),
    ]
    assert rec["status"] == "failed" and agent.proc.poll() is None


def test_a_malformed_mailbox_entry_is_skipped_and_the_next_command_applied(agents, r, tmp_path: Path) -> None:
    (tmp_path / "ckpts").mkdir()
    agent = agents(NODE, allow_roots=[tmp_path / "ckpts"])
    agent.wait_ready(r)
    target = keys.Target("node", NODE)
    signer = Signer.from_secret(SIGNING_KEY)
    for text in ("{not json", json.dumps({"v": 99})):  # signed by the service's key, but not commands
        r.xadd(keys.mailbox(target), {"c": text, "s": signer.sign(text.encode())})
    rid = inject(r, [("disk_cleanup", {})])
    assert wait_record(r, rid)["status"] == "applied"
    assert agent.proc.poll() is None and agent.log().count("ignored a malformed command") == 2


def test_two_agents_for_one_node_apply_each_command_once(agents, r, tmp_path: Path) -> None:
    (tmp_path / "ckpts").mkdir()
    pair = [agents(NODE, allow_roots=[tmp_path / "ckpts"]) for _ in range(2)]
    # Both heartbeat on one key, each overwriting the other's, so a reader may never catch one pid there: wait
    # for each to say it is up instead (what they miss meanwhile they read from the mailbox anyway).
    jobs.wait_until(lambda: all(f"agent for node {NODE} up" in a.log() for a in pair), timeout=30,
               what="both agents up")
    ids = [inject(r, [("disk_cleanup", {})]) for _ in range(20)]
    for rid in ids:
        assert wait_record(r, rid)["status"] == "applied"
    lines = (pair[0].log() + pair[1].log()).splitlines()
    assert [sum(rid in line for line in lines) for rid in ids] == [1] * 20  # one "applied" log line each


def test_it_survives_a_redis_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendonly=True).start()
    (tmp_path / "ckpts").mkdir()
    agent = AgentProcess(NODE, server.url, tmp_path / "agent.log", allow_roots=[tmp_path / "ckpts"])
    r = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        agent.wait_ready(r)
        assert wait_record(r, inject(r, [("disk_cleanup", {})]))["status"] == "applied"
        server.stop()
        time.sleep(1.0)  # the agent notices: its receiver and heartbeats fail and back off
        server.start()
        rid = inject(r, [("disk_cleanup", {})])
        assert wait_record(r, rid, timeout=20)["status"] == "applied"
        assert agent.proc.poll() is None
        assert agent.stop() == 0
    finally:
        agent.stop()
        r.close()
        server.stop()


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "trainmedic.service.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=full)


def test_bad_agent_flags_are_one_line_errors(redis_url: str, tmp_path: Path) -> None:
    key = {"TRAINMEDIC_VERIFY_KEY": VERIFY_KEY}
    state = ["--state-dir", str(tmp_path / "state")]
    cases = [
        (["agent", "--node", "no spaces!"], {}, 2, "--node must be 1 to 128 letters"),
        (["agent", "--node", NODE, *state], key, 1, "no Redis URL"),
        (["agent", "--node", NODE, "--redis-url", redis_url, *state], {}, 1, "needs TRAINMEDIC_VERIFY_KEY"),
        (["agent", "--node", NODE, "--redis-url", redis_url, "--allow-root", "/", *state], key, 1,
         "anywhere on the host"),
        (["agent", "--node", NODE, "--redis-url", "http://x", *state], key, 1, "must start with redis://"),
        (["agent", "--node", NODE, "--redis-url", redis_url, *state], {"TRAINMEDIC_VERIFY_KEY": "bm90IGEga2V5"}, 1,
         "a verify key must be 32 bytes"),
    ]
    for argv, env, code, words in cases:
        out = run_cli(*argv, env=env)
        assert out.returncode == code, (argv, out)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in out.stderr, (argv, out.stderr)



def test_serve_runs_an_agent_for_its_own_host_and_stops_it(tmp_path: Path) -> None:
    import os

    import requests

    from trainmedic.service.cli.serve import node_name
    from trainmedic.service.embedded_redis import free_port

    port = free_port()
    (tmp_path / "ckpts").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    proc = subprocess.Popen([sys.executable, "-m", "trainmedic.service.cli", "serve", "--port", str(port),
                             "--workers", "1",
                             "--data-dir", str(tmp_path / "data"), "--allow-root", str(tmp_path / "ckpts"),
                             "--dry-run"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=env)
    agent_pid = None
    try:
        deadline = time.monotonic() + 40
        while agent_pid is None:
            assert time.monotonic() < deadline and proc.poll() is None, "serve or its agent did not come up"
            try:
                nodes = [t for t in requests.get(f"http://127.0.0.1:{port}/targets", timeout=1).json()["targets"]
                         if t["kind"] == "node"]
            except requests.RequestException:
                nodes = []
            if nodes:
                assert nodes[0]["name"] == node_name()
                assert nodes[0]["allow_roots"] == [str(tmp_path / "ckpts")] and nodes[0]["dry_run"] is True
                agent_pid = nodes[0]["pid"]
            else:
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert subprocess.run(["ps", "-p", str(agent_pid)], capture_output=True).returncode == 1  # the agent is gone
