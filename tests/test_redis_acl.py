"""config/redis/users.acl and `trainmedic credentials` on a real redis-server: the real flow works with each
side's own user (the service through gunicorn, a training client applying scale_lr, a node agent applying
disk_cleanup), Redis denies none of it, a trainer cannot touch a node's keys nor an agent a job's, one node's
user cannot touch another node's keys (nor one job's another job's), and a held record that a node's own user
rewrote is never signed when a person approves it."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import redis
import requests
import torch
from redis.exceptions import NoPermissionError

from trainmedic.client import RemediationClient
from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.service.embedded_redis import EmbeddedRedis

from tests.conftest import AUTH, OP_AUTH, OPERATOR, ROOT, SIGNING_KEY, VERIFY_KEY, Gunicorn, load_fixture
from tests.support import acl, jobs
from tests.support.nvml import AgentProcess

JOB, NODE = "acl-job", "acl-node"
USERS = acl.users(NODE, JOB)
PASSWORDS = acl.PASSWORDS
DAY = 86400.0


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """redis-server with the ACL file rendered as docker-compose.yml renders it, plus an inspector for the test."""
    tmp = tmp_path_factory.mktemp("acl")
    rendered = acl.render(tmp / "users.acl", NODE, JOB)
    server = EmbeddedRedis(tmp / "data", appendonly=False, extra_args=("--aclfile", str(rendered))).start()
    yield server
    server.stop()


def url(server: EmbeddedRedis, who: str) -> str:
    return acl.url(server.port, who, NODE, JOB)


@pytest.fixture(scope="module")
def inspector(acl_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    r = redis.Redis(port=acl_redis.port, username="inspector", password="inspector-pw", decode_responses=True)
    yield r
    r.close()


def denials(inspector: redis.Redis) -> list[dict]:
    return [e for e in inspector.acl_log() if e.get("username") != "inspector"]


def webhook(g: Gunicorn, status: str = "firing", **labels: str) -> dict:
    """One alert through POST /webhook; the one record it made."""
    body = copy.deepcopy(load_fixture("firing_single.json"))
    a = body["alerts"][0]
    a["labels"] = {"severity": "critical", **labels}
    a["fingerprint"] = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]
    a["status"] = body["status"] = status
    if status == "resolved":
        a["endsAt"] = "2099-01-01T00:00:00Z"
    resp = requests.post(g.url + "/webhook", json=body, headers=AUTH, timeout=10)
    assert resp.status_code == 200, resp.text
    [rec] = resp.json()["remediations"]
    return dict(rec)


def test_redis_loads_the_acl_file_and_no_user_may_run_admin_or_keyspace_wide_commands(acl_redis, inspector) -> None:
    users = set(inspector.acl_users())
    assert users == {"default", "health", *USERS.values(), "inspector"}
    # The default user keeps every command (Redis replays the AOF as that user), behind a password nobody has.
    default = inspector.acl_getuser("default")
    assert "nopass" not in default["flags"] and "on" in default["flags"] and default["passwords"]
    assert inspector.execute_command("ACL", "DRYRUN", "default", "EVALSHA", "0" * 40, "0") == "OK"
    health = inspector.acl_getuser("health")
    assert not health["keys"] and not health["channels"] and "nopass" in health["flags"]
    # No user may run admin, configuration, keyspace-wide or free-form script commands (ACL DRYRUN asks Redis).
    forbidden = [["FLUSHALL"], ["FLUSHDB"], ["KEYS", "*"], ["SCAN", "0"], ["CONFIG", "SET", "appendonly", "no"],
                 ["EVAL", "return 1", "0"], ["SCRIPT", "FLUSH"], ["FUNCTION", "FLUSH"], ["DEBUG", "SLEEP", "0"],
                 ["SHUTDOWN"], ["ACL", "LIST"], ["CLIENT", "KILL", "ID", "1"], ["CLIENT", "LIST"], ["MONITOR"],
                 ["SAVE"], ["BGREWRITEAOF"], ["REPLICAOF", "NO", "ONE"], ["MODULE", "LIST"], ["MIGRATE", "h", "1",
                 "trainmedic:x", "0", "1"], ["RENAME", "trainmedic:a", "trainmedic:b"], ["OBJECT", "ENCODING", "x"]]
    for user in USERS.values():
        for cmd in forbidden:
            answer = inspector.execute_command("ACL", "DRYRUN", user, *cmd)
            assert answer != "OK", (user, cmd)
    # Anyone reaching the port without a password is refused; the health check's user may PING and nothing else.
    anyone = redis.Redis(port=acl_redis.port, decode_responses=True)
    with pytest.raises(redis.AuthenticationError):
        anyone.ping()
    anyone.close()
    health = redis.Redis(port=acl_redis.port, username="health", password="anything", decode_responses=True)
    assert health.ping()
    for call in (lambda: health.get("trainmedic:history"), lambda: health.keys("*"), lambda: health.flushall()):
        with pytest.raises(NoPermissionError):
            call()
    health.close()
    inspector.acl_log_reset()


def test_the_real_flow_runs_with_each_sides_own_user_and_redis_denies_none_of_it(
        acl_redis, inspector, nvml_lib: Path, nvml_state: Any, tmp_path: Path) -> None:
    inspector.acl_log_reset()
    g = Gunicorn({"TRAINMEDIC_REDIS_URL": url(acl_redis, "SERVICE")}, 2, tmp_path)
    root = tmp_path / "checkpoints"
    old = []
    for s in range(1, 6):
        ckpt = root / "run" / f"checkpoint-{s}"
        (ckpt).mkdir(parents=True)
        (ckpt / "model.pt").write_bytes(b"x" * 1000)
        for p in (ckpt / "model.pt", ckpt):
            os.utime(p, (time.time() - (40 - s) * DAY,) * 2)
        old.append(ckpt)
    agent = AgentProcess(NODE, url(acl_redis, "AGENT"), tmp_path / "agent.log", allow_roots=[root],
                         lib_dir=nvml_lib, state=nvml_state)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    rc = RemediationClient(job=JOB, redis_url=url(acl_redis, "TRAINER"), optimizer=opt, heartbeat_interval=0.2,
                           verify_key=VERIFY_KEY)
    rc.register("rollback_checkpoint", lambda params: {"restored_step": 0})  # the shipped loss-spike's first step
    service = redis.Redis.from_url(url(acl_redis, "SERVICE"), decode_responses=True)
    steps = iter(range(10**6))
    try:
        agent.wait_ready(service)
        beat = keys.heartbeat(keys.Target("job", JOB))
        jobs.wait_until(lambda: "rollback_checkpoint" in json.loads(service.get(beat) or "{}").get("actions", []),
                        what="the trainer's heartbeat")
        # The webhook (service user) dispatches; the trainer user applies scale_lr ...
        lr_rec = webhook(g, alertname="TrainingLossSpike", job_name=JOB)
        assert lr_rec["status"] == "dispatched"
        done = jobs.wait_record(service, lr_rec["id"], tick=lambda: rc.poll(step=next(steps)))
        assert done["status"] == "applied" and opt.param_groups[0]["lr"] == pytest.approx(0.05)
        # ... and the agent user applies disk_cleanup below its allow-root.
        disk_rec = webhook(g, alertname="DiskSpaceLow", node=NODE)
        assert disk_rec["status"] == "dispatched"
        done = jobs.wait_record(service, disk_rec["id"], timeout=20)
        assert done["status"] == "applied", done
        assert [c.exists() for c in old] == [False, False, True, True, True]
        # A GPU throttled, and put back when the alert resolves (on_resolved, the obligation's path) ...
        hot = webhook(g, alertname="GPUTemperatureHigh", node=NODE, gpu_id="0")
        assert jobs.wait_record(service, hot["id"])["status"] == "applied" and nvml_state.limit_w(0) == 560
        cool = webhook(g, "resolved", alertname="GPUTemperatureHigh", node=NODE, gpu_id="0")
        assert jobs.wait_record(service, cool["id"])["status"] == "applied" and nvml_state.limit_w(0) == 700
        # ... a record held for approval and approved by a person ...
        held = webhook(g, alertname="GPUXidError", node=NODE, gpu_id="0", xid_class="drain")
        assert held["status"] == "pending_approval"
        resp = requests.post(f"{g.url}/remediations/{held['id']}/approve", json={}, headers=OP_AUTH, timeout=10)
        assert resp.status_code == 200 and resp.json()["approved_by"] == "operator"
        # ... and a command that expires.
        resp = requests.post(g.url + "/commands", headers=OP_AUTH, timeout=10, json={
            "target": f"job:{JOB}", "action": "set_lr", "params": {"lr": 0.01}, "expire_after": "500ms"})
        assert resp.status_code == 201, resp.text
        short = resp.json()["id"]
        time.sleep(1.0)
        expired = jobs.wait_record(service, short, tick=lambda: rc.poll(step=next(steps)), timeout=20)
        assert expired["status"] == "expired"
        # What people read: history, targets, metrics, pages.
        for path in ("/history", "/targets", "/metrics", "/", f"/targets/job/{JOB}", "/readyz"):
            assert requests.get(g.url + path, timeout=10).status_code == 200, path
        assert {(t["kind"], t["name"]) for t in requests.get(g.url + "/targets", timeout=10).json()["targets"]} == {
            ("job", JOB), ("node", NODE)}
        assert denials(inspector) == [], denials(inspector)
    finally:
        rc.close()
        agent.stop()
        g.stop()
        service.close()
    assert "NOPERM" not in agent.log() and "NOPERM" not in (tmp_path / f"gunicorn-{g.port}.log").read_text()
    assert denials(inspector) == []  # nor while stopping


def test_trainers_and_agents_run_only_scripts_the_service_loaded_and_carry_on_once_it_loads_them_again(
        acl_redis, inspector) -> None:
    from trainmedic.service.app import create_app

    # Loading a script of one's own (a busy loop would stall Redis for everyone) is the service's alone.
    for who in ("TRAINER", "AGENT"):
        assert inspector.execute_command("ACL", "DRYRUN", USERS[who], "SCRIPT", "LOAD", "while true do end") != "OK"
        assert inspector.execute_command("ACL", "DRYRUN", USERS[who], "EVALSHA", "0" * 40, "0") == "OK"
    trainer_url = credentials(acl_redis, "job", "acl-restart")
    trainer = redis.Redis.from_url(trainer_url, decode_responses=True)
    assert refused(lambda: trainer.script_load("while true do end"))
    trainer.close()
    app = create_app({"TESTING": True, "redis_url": url(acl_redis, "SERVICE"), "webhook_token": "t" * 32,
                      "operator_token": OPERATOR, "signing_key": SIGNING_KEY})
    service = redis.Redis.from_url(url(acl_redis, "SERVICE"), decode_responses=True)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    rc = RemediationClient(job="acl-restart", redis_url=trainer_url, optimizer=opt,
                           heartbeat_interval=0.2, verify_key=VERIFY_KEY)
    steps = iter(range(10**6))
    try:
        jobs.wait_until(lambda: service.exists(keys.heartbeat(keys.Target("job", "acl-restart"))),
                        tick=lambda: rc.poll(step=next(steps)), what="the trainer's heartbeat")
        inspector.script_flush()  # what a Redis restart does to its script cache
        resp = app.test_client().post("/commands", headers=OP_AUTH, json={
            "target": "job:acl-restart", "action": "scale_lr", "params": {"factor": 0.5}})
        assert resp.status_code == 201, resp.get_json()
        rid = resp.get_json()["id"]
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # the trainer sees the command but may not load CLAIM itself
            rc.poll(step=next(steps))
            time.sleep(0.02)
        assert records.get(service, rid)["actions"][0]["status"] == "pending"
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
        assert app.extensions["trainmedic"].reconciler.tick() is not None  # its tick loads them again
        done = jobs.wait_record(service, rid, tick=lambda: rc.poll(step=next(steps)), timeout=30)
        assert done["status"] == "applied" and opt.param_groups[0]["lr"] == pytest.approx(0.05)
        assert any(e.get("object") == "script|load" and e.get("username") == "trainmedic-job-acl-restart"
                   for e in inspector.acl_log())
    finally:
        rc.close()
        service.close()
    inspector.acl_log_reset()


def refused(call: Any) -> bool:
    try:
        call()
    except NoPermissionError:
        return True
    return False


def test_a_trainer_cannot_read_or_write_node_keys_nor_xadd_into_a_node_mailbox(acl_redis, inspector) -> None:
    trainer = redis.Redis.from_url(url(acl_redis, "TRAINER"), decode_responses=True)
    node = keys.Target("node", NODE)
    rid = "01ARZ3NDEKTSV4RRFFQ69G5FAV~node~" + NODE
    try:
        calls = {
            "XADD into a node's mailbox": lambda: trainer.xadd(keys.mailbox(node), {"c": "{}", "s": ""}),
            "read a node's mailbox": lambda: trainer.xrange(keys.mailbox(node)),
            "move a node's cursor": lambda: trainer.set(keys.cursor(node), "9999999999999-0"),
            "read a node's record": lambda: trainer.hget(keys.record(rid), "status"),
            "write a node's record": lambda: trainer.hset(keys.record(rid), "a:0:status", "pending"),
            "forge a node's heartbeat": lambda: trainer.set(keys.heartbeat(node), "{}"),
            "change the remembered power limits": lambda: trainer.hset(keys.power_memory(NODE), "GPU-0", "1"),
            "speak for a node to the service": lambda: trainer.publish(keys.up_channel(node), "beat"),
            "list the history": lambda: trainer.zrange(keys.HISTORY, 0, -1),
            "add to the history": lambda: trainer.zadd(keys.HISTORY, {rid: 0}),
            "add to the approvals": lambda: trainer.zadd(keys.APPROVALS, {rid: 0}),
            "take the reconciler's lease": lambda: trainer.set(keys.RECONCILER_LEASE, "me"),
            "list every key": lambda: trainer.keys("*"),
            "scan the keyspace": lambda: trainer.scan(0),
            "flush everything": lambda: trainer.flushall(),
            "reconfigure Redis": lambda: trainer.config_set("appendonly", "no"),
            "run any Lua": lambda: trainer.eval("return 1", 0),
            "delete its own records": lambda: trainer.delete(keys.record(f"01ARZ3NDEKTSV4RRFFQ69G5FAV~job~{JOB}")),
        }
        allowed = [what for what, call in calls.items() if not refused(call)]
        assert allowed == [], allowed
        # What it does need still works: its own keys (a release re-offers into its mailbox) and its channel.
        job = keys.Target("job", JOB)
        assert trainer.xadd(keys.mailbox(job), {"r": "x"}) and trainer.xrange(keys.mailbox(job))
        assert trainer.publish(keys.up_channel(job), "beat") is not None
    finally:
        trainer.close()


@pytest.mark.parametrize("who", ["TRAINER", "AGENT"])
def test_a_targets_user_may_write_no_key_that_other_targets_share(acl_redis, inspector, who: str) -> None:
    # Each of these, done with one job's (or node's) password, used to stop or skew remediation for every target:
    # the webhook and the reconciler failing on the due targets or the history journal, records left dispatched
    # past their expiry, records hidden from the history, /metrics broken, the breaker loosened.
    user = redis.Redis.from_url(url(acl_redis, who), decode_responses=True)
    other = keys.Target("job", "someone-else")
    try:
        calls = {
            "SET the due targets": lambda: user.set(keys.DUE, "x"),
            "SET the history journal": lambda: user.set(keys.HIST_JOURNAL, "x"),
            "SET the known targets": lambda: user.set(keys.TARGETS, "x"),
            "PEXPIRE the due targets": lambda: user.pexpire(keys.DUE, 1),
            "ZREM from the due targets": lambda: user.zrem(keys.DUE, "job:someone-else"),
            "ZADD XX into the due targets": lambda: user.zadd(keys.DUE, {"job:someone-else": 1e15}, xx=True),
            "LTRIM the history journal": lambda: user.ltrim(keys.HIST_JOURNAL, 1, 0),
            "count a refusal": lambda: user.hset(keys.REJECTED, "bad_signature", "notanumber"),
            "write the metrics": lambda: user.hincrby(keys.METRICS, "n|x|applied", 1),
            "make nodes look live": lambda: user.zadd(keys.live("node"), {f"node:fake-{i}": 1e15 for i in range(10)}),
            "make jobs look live": lambda: user.zadd(keys.live("job"), {"job:fake": 1e15}),
            "name a target dirty": lambda: user.sadd(keys.HIST_DIRTY, "job:someone-else"),
            "take a breaker's place": lambda: user.zadd(keys.breaker_open("gpu-xid-error"), {"x": 1e15}),
            "write another target's journal": lambda: user.rpush(keys.journal(other), "c|x|a|b"),
            "speak for another target": lambda: user.publish(keys.up_channel(other), "acks"),
        }
        allowed = [what for what, call in calls.items() if not refused(call)]
        assert allowed == [], allowed
    finally:
        user.close()
    inspector.acl_log_reset()


def test_an_agent_cannot_touch_job_keys(acl_redis, inspector) -> None:
    agent = redis.Redis.from_url(url(acl_redis, "AGENT"), decode_responses=True)
    job = keys.Target("job", JOB)
    rid = f"01ARZ3NDEKTSV4RRFFQ69G5FAV~job~{JOB}"
    try:
        calls = {
            "XADD into a job's mailbox": lambda: agent.xadd(keys.mailbox(job), {"c": "{}", "s": ""}),
            "read a job's mailbox": lambda: agent.xrange(keys.mailbox(job)),
            "move a job's cursor": lambda: agent.set(keys.cursor(job), "9999999999999-0"),
            "read a job's record": lambda: agent.hget(keys.record(rid), "status"),
            "write a job's record": lambda: agent.hset(keys.record(rid), "a:0:status", "pending"),
            "rewrite a job's ledger": lambda: agent.rpush(keys.ledger(job), "{}"),
            "read a job's ledger": lambda: agent.lrange(keys.ledger(job), 0, -1),
            "forge a job's heartbeat": lambda: agent.set(keys.heartbeat(job), "{}"),
            "speak for a job to the service": lambda: agent.publish(keys.up_channel(job), "acks"),
            "list the history": lambda: agent.zrange(keys.HISTORY, 0, -1),
            "list every key": lambda: agent.keys("*"),
            "flush everything": lambda: agent.flushall(),
        }
        allowed = [what for what, call in calls.items() if not refused(call)]
        assert allowed == [], allowed
        assert {e["username"] for e in denials(inspector)} <= {USERS["TRAINER"], USERS["AGENT"], "default"}
        # Its own node's keys it may use.
        assert agent.set(keys.cursor(keys.Target("node", NODE)), "0-0")
    finally:
        agent.close()
    assert records.get(redis.Redis.from_url(url(acl_redis, "SERVICE"), decode_responses=True), rid) is None


def test_serve_never_prints_the_redis_password_or_the_operator_token_it_was_given(acl_redis, tmp_path: Path) -> None:
    # Its output ends up in container logs: only what it made itself (an embedded Redis, a token) is printed.
    import signal
    import sys

    from trainmedic.service.embedded_redis import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    env.update(TRAINMEDIC_REDIS_URL=url(acl_redis, "SERVICE"), TRAINMEDIC_OPERATOR_TOKEN=OPERATOR,
               TRAINMEDIC_SIGNING_KEY=SIGNING_KEY, TRAINMEDIC_WEBHOOK_TOKEN="a-webhook-token-for-this-test")
    cli = [sys.executable, "-m", "trainmedic.service.cli", "serve", "--no-agent", "--workers", "1",
           "--data-dir", str(tmp_path / "data")]
    proc = subprocess.Popen([*cli, "--port", str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, env=env)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        while not any("max_alerts: 0" in line for line in lines):  # the last line it prints at start
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
    finally:
        proc.send_signal(signal.SIGINT)
        lines.append(proc.communicate(timeout=30)[0])
    out = "".join(lines)
    assert PASSWORDS["SERVICE"] not in out and OPERATOR not in out, out
    assert f"redis://trainmedic:***@127.0.0.1:{acl_redis.port}/0" in out and "TRAINMEDIC_VERIFY_KEY=" in out
    # Nor when Redis cannot be reached.
    wrong = f"redis://trainmedic:{PASSWORDS['SERVICE']}@127.0.0.1:{free_port()}/0"
    failed = subprocess.run([*cli, "--port", str(free_port()), "--redis-url", wrong], capture_output=True,
                            text=True, cwd=ROOT, env=env, timeout=60)
    assert failed.returncode == 1 and PASSWORDS["SERVICE"] not in failed.stdout + failed.stderr
    assert failed.stderr.startswith("trainmedic: cannot reach Redis at redis://trainmedic:***@"), failed.stderr


def test_docker_compose_gives_each_service_its_own_redis_user_with_its_password_from_env() -> None:
    import fnmatch
    from urllib.parse import urlsplit

    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    redis_svc = compose["redis"]
    argv = redis_svc["command"]
    aclfile = argv[argv.index("--aclfile") + 1]
    mount = {t: s for s, t, *_ in (v.split(":") for v in redis_svc["volumes"])}
    [render] = [a for a in redis_svc["entrypoint"] if a.endswith("render-acl.sh")]
    assert mount[str(Path(render).parent)] == "./config/redis" and (ROOT / "config/redis/render-acl.sh").is_file()
    assert redis_svc["environment"]["TRAINMEDIC_ACL_TEMPLATE"] == str(Path(render).parent / "users.acl")
    assert aclfile == "/tmp/users.acl" and argv[:2] == ["docker-entrypoint.sh", "redis-server"]
    for who in USERS:
        var = f"TRAINMEDIC_REDIS_{who}_PASSWORD"
        assert redis_svc["environment"][var].startswith(f"${{{var}:?")  # compose stops when it is not set
        assert f"{var}=" in (ROOT / ".env.example").read_text()
    stack = {"SERVICE": "trainmedic", "AGENT": "trainmedic-node-${TRAINMEDIC_NODE:-gpu-node-01}",
             "TRAINER": "trainmedic-job-example-job"}
    assert redis_svc["environment"]["TRAINMEDIC_NODE"] == "${TRAINMEDIC_NODE:-gpu-node-01}"
    agent_cmd = compose["agent"]["command"]
    assert agent_cmd[agent_cmd.index("--node") + 1] == "${TRAINMEDIC_NODE:-gpu-node-01}"
    job = compose["trainer"]["command"]
    assert redis_svc["environment"]["TRAINMEDIC_JOB"] == job[job.index("--job") + 1] == "example-job"
    for name, who in (("trainmedic", "SERVICE"), ("agent", "AGENT"), ("trainer", "TRAINER")):
        raw = compose[name]["environment"]["TRAINMEDIC_REDIS_URL"]
        url = urlsplit(raw.replace("${TRAINMEDIC_NODE:-gpu-node-01}", "NODE"))
        assert (url.username, url.password, url.hostname) == (
            stack[who].replace("${TRAINMEDIC_NODE:-gpu-node-01}", "NODE"), f"${{TRAINMEDIC_REDIS_{who}_PASSWORD}}",
            "redis"), name
        assert not any("redis://" in str(a) for a in compose[name]["command"]), name  # never on a command line
    for ignore in (".gitignore", ".dockerignore"):
        lines = [x.strip().lstrip("/") for x in (ROOT / ignore).read_text().splitlines()]
        assert any(x and not x.startswith("#") and fnmatch.fnmatch(".env", x) for x in lines), ignore


def test_render_acl_refuses_to_start_redis_without_a_password(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    env.update(TRAINMEDIC_ACL_TEMPLATE=str(acl.ACL), TRAINMEDIC_ACL_OUT=str(tmp_path / "users.acl"),
               TRAINMEDIC_REDIS_SERVICE_PASSWORD="x", TRAINMEDIC_REDIS_AGENT_PASSWORD="y")
    out = subprocess.run(["sh", str(acl.RENDER), "touch", str(tmp_path / "started")], env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 1 and not (tmp_path / "started").exists()
    assert out.stderr.strip() == ("render-acl: TRAINMEDIC_REDIS_TRAINER_PASSWORD is not set (docker-compose.yml "
                                  "takes it from .env; see .env.example)")


def test_the_acl_files_node_and_job_users_are_exactly_what_trainmedic_credentials_makes(acl_redis, inspector) -> None:
    from trainmedic.service.credentials import acl_line, user_name

    for target, who in ((keys.Target("node", NODE), "AGENT"), (keys.Target("job", JOB), "TRAINER")):
        line = acl_line(target, PASSWORDS[who])
        assert user_name(target) == USERS[who]
        # Redis describes both the same way: the rendered file's user, and one made from credentials' rules.
        inspector.execute_command("ACL", "SETUSER", "made-by-credentials", *line.split()[2:])
        try:
            made = inspector.execute_command("ACL", "GETUSER", "made-by-credentials")
            loaded = inspector.execute_command("ACL", "GETUSER", USERS[who])
            assert made == loaded, (made, loaded)
        finally:
            inspector.execute_command("ACL", "DELUSER", "made-by-credentials")


def credentials(acl_redis: EmbeddedRedis, kind: str, name: str) -> str:
    """`trainmedic credentials KIND NAME` against the test's Redis (as an admin); the URL it prints."""
    import sys

    admin = f"redis://inspector:inspector-pw@127.0.0.1:{acl_redis.port}/0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    out = subprocess.run([sys.executable, "-m", "trainmedic.service.cli", "credentials", kind, name, "--redis-url",
                          admin], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    [line] = [x for x in out.stdout.splitlines() if x.startswith("user ")]
    assert line.startswith(f"user trainmedic-{kind}-{name} on #") and "inspector-pw" not in out.stdout
    [url_line] = [x for x in out.stdout.splitlines() if x.startswith("TRAINMEDIC_REDIS_URL=")]
    return url_line.split("=", 1)[1]


def test_one_nodes_or_jobs_own_user_cannot_touch_another_nodes_or_jobs_keys(acl_redis, inspector) -> None:
    other_node = redis.Redis.from_url(credentials(acl_redis, "node", "other-node"), decode_responses=True)
    other_job = redis.Redis.from_url(credentials(acl_redis, "job", "other-job"), decode_responses=True)
    node, job = keys.Target("node", NODE), keys.Target("job", JOB)
    node_rid, job_rid = f"01ARZ3NDEKTSV4RRFFQ69G5FAV~node~{NODE}", f"01ARZ3NDEKTSV4RRFFQ69G5FAV~job~{JOB}"

    def attempts(who: redis.Redis, target: keys.Target, rid: str) -> dict[str, Any]:
        return {
            "rewrite a held record's decision": lambda: who.hset(keys.record(rid), "d", "{}"),
            "read a record": lambda: who.hget(keys.record(rid), "status"),
            "XADD into the mailbox": lambda: who.xadd(keys.mailbox(target), {"c": "{}", "s": ""}),
            "move the cursor": lambda: who.set(keys.cursor(target), "9999999999999-0"),
            "forge the heartbeat": lambda: who.set(keys.heartbeat(target), "{}"),
            "speak for it": lambda: who.publish(keys.up_channel(target), "acks"),
        }

    try:
        for who, target, rid in ((other_node, node, node_rid), (other_job, job, job_rid)):
            calls = attempts(who, target, rid)
            allowed = [what for what, call in calls.items() if not refused(call)]
            assert allowed == [], allowed
        # Each still works on its own keys.
        assert other_node.set(keys.cursor(keys.Target("node", "other-node")), "0-0")
        assert other_job.set(keys.cursor(keys.Target("job", "other-job")), "0-0")
        # Rotating a user ends its old password.
        credentials(acl_redis, "node", "other-node")
        other_node.connection_pool.disconnect()
        with pytest.raises(redis.exceptions.AuthenticationError):
            other_node.ping()
    finally:
        other_node.close()
        other_job.close()
        inspector.acl_log_reset()


def test_a_held_record_its_own_node_rewrote_is_refused_on_approval_and_nothing_is_signed_or_deleted(
        acl_redis, inspector, nvml_lib: Path, nvml_state: Any, tmp_path: Path) -> None:
    held_drain = tmp_path / "held.yaml"
    held_drain.write_text("playbooks:\n  - name: held-drain\n    matchers: ['alertname=\"HeldDrain\"']\n"
                          "    target: node\n    approval: true\n"
                          "    actions: [{drain_node: {reason: 'GPU hardware error'}, optional: true}]\n")
    g = Gunicorn({"TRAINMEDIC_REDIS_URL": url(acl_redis, "SERVICE"), "TRAINMEDIC_PLAYBOOKS": str(held_drain)}, 2,
                 tmp_path)
    root = tmp_path / "checkpoints"
    ckpts = []
    for s in range(1, 4):
        ckpt = root / "run" / f"checkpoint-{s}"
        ckpt.mkdir(parents=True)
        (ckpt / "model.pt").write_bytes(b"x" * 1000)
        ckpts.append(ckpt)
    agent = AgentProcess(NODE, url(acl_redis, "AGENT"), tmp_path / "agent.log", allow_roots=[root],
                         lib_dir=nvml_lib, state=nvml_state)
    service = redis.Redis.from_url(url(acl_redis, "SERVICE"), decode_responses=True)
    node_user = redis.Redis.from_url(url(acl_redis, "AGENT"), decode_responses=True)
    try:
        agent.wait_ready(service)
        held = webhook(g, alertname="HeldDrain", node=NODE)
        assert held["status"] == "pending_approval"
        mailbox = keys.mailbox(keys.Target("node", NODE))
        before = inspector.xlen(mailbox)
        # The node's own credentials turn its held drain into a cleanup of every checkpoint.
        decided = json.loads(node_user.hget(keys.record(held["id"]), "d"))
        decided["s"] = [["disk_cleanup", {"keep_last": 0, "older_than": "0s", "patterns": ["*"]}]]
        node_user.hset(keys.record(held["id"]), "d", json.dumps(decided))
        assert records.get(service, held["id"])["actions"][0]["action"] == "disk_cleanup"
        resp = requests.post(f"{g.url}/remediations/{held['id']}/approve", json={}, headers=OP_AUTH, timeout=10)
        assert resp.status_code == 200, resp.text
        rec = resp.json()
        assert (rec["status"], rec["reason"]) == ("skipped", "tampered"), rec
        assert rec["actions"][0]["status"] == "skipped" and rec["actions"][0]["reason"] == "tampered"
        assert inspector.xlen(mailbox) == before  # nothing was signed or sent
        time.sleep(1.0)  # the agent would have acted within this
        assert all(c.exists() for c in ckpts)
        metrics = requests.get(g.url + "/metrics", timeout=10).text
        assert "trainmedic_records_tampered_total 1.0" in metrics
        assert "was changed in Redis after it was decided" in (tmp_path / f"gunicorn-{g.port}.log").read_text()
    finally:
        agent.stop()
        g.stop()
        service.close()
        node_user.close()
        inspector.acl_log_reset()


def test_redis_url_file_is_read_like_the_other_file_settings(tmp_path: Path) -> None:
    from trainmedic.client.settings import Settings, SettingsError

    path = tmp_path / "redis-url"
    path.write_text("redis://trainmedic-node-n1:pw@redis.example:6379/0\n")
    assert Settings.from_env({"TRAINMEDIC_REDIS_URL_FILE": str(path)}).redis_url == \
        "redis://trainmedic-node-n1:pw@redis.example:6379/0"
    # The variable itself wins, as TRAINMEDIC_SIGNING_KEY wins over its _FILE.
    assert Settings.from_env({"TRAINMEDIC_REDIS_URL": "redis://other:6379/0",
                              "TRAINMEDIC_REDIS_URL_FILE": str(path)}).redis_url == "redis://other:6379/0"
    with pytest.raises(SettingsError, match=f"cannot read TRAINMEDIC_REDIS_URL_FILE {tmp_path / 'missing'}: "):
        Settings.from_env({"TRAINMEDIC_REDIS_URL_FILE": str(tmp_path / "missing")})


def test_a_node_agent_reads_its_own_users_url_from_a_file_and_runs_with_it(acl_redis, inspector,
                                                                            tmp_path: Path) -> None:
    import sys

    node = "file-node"
    url_file = tmp_path / "redis-url"
    url_file.write_text(credentials(acl_redis, "node", node) + "\n")
    url_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    env.update(TRAINMEDIC_REDIS_URL_FILE=str(url_file), TRAINMEDIC_VERIFY_KEY=VERIFY_KEY,
               LD_LIBRARY_PATH=str(tmp_path / "no-nvml-here"))
    log = open(tmp_path / "agent.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "trainmedic.service.cli", "agent", "--node", node,
                             "--state-dir", str(tmp_path / "state"), "--scheduler", "none"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        beat = keys.heartbeat(keys.Target("node", node))
        jobs.wait_until(lambda: inspector.exists(beat) or proc.poll() is not None, timeout=30, what="its heartbeat")
        assert proc.poll() is None, (tmp_path / "agent.log").read_text()
        users = {c.get("user") for c in inspector.client_list()}
        assert f"trainmedic-node-{node}" in users, users
        assert denials(inspector) == []
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()
        inspector.acl_log_reset()
