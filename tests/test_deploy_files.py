"""The deployment files (docker-compose.yml, Dockerfile, config/) are valid and agree with each other and the code.

`make compose-test` (tests/compose/run.py) starts the stack for real; these quicker checks run with the rest
of the suite: the files are checked with the real tools (promtool, amtool), parsed, and cross-checked: every
referenced file exists, every name and port one file uses is what another defines, every alert fires with the
labels its shipped playbook needs, and the example trainer really answers.
"""
from __future__ import annotations

import fnmatch
import glob
import importlib.util
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
import yaml

from trainmedic.client.wire import keys
from trainmedic.client.wire.actions import DEFAULT_CHECKPOINT_PATTERNS
from trainmedic.service.cli import parser as cli_parser
from trainmedic.service.embedded_redis import free_port
from trainmedic.service.rules.playbooks import SHIPPED, load
from tests.conftest import ROOT, post_json
from tests.support.jobs import entry_command

CONFIG = ROOT / "config"
RULE_FILES = sorted(glob.glob(str(CONFIG / "rules" / "*.yml")))
RULES_TEST = ROOT / "tests" / "rules_test.yml"
# NodeLemon's 7-day window is tested apart, at an evaluation interval of an hour.
LEMON_TEST = ROOT / "tests" / "rules_lemon_test.yml"
RULES_TESTS = (RULES_TEST, LEMON_TEST)
PROMISED_SERVICES = {"redis", "trainmedic", "agent", "prometheus", "alertmanager", "trainer"}
TOKEN_FILE = "config/trainmedic.token"  # made by the user (README); never committed
PLAYBOOK_ALERTS = {"GPUTemperatureHigh", "GPUMemoryUsageHigh", "GPUXidError", "TrainingLossSpike",
                   "TrainingThroughputDrop", "DiskSpaceLow", "NodeLemon"}
# Alerts trainmedic raises itself, with no Prometheus rule: the client's NaN and straggler detectors and the
# service's hang check.
RAISED_BY_TRAINMEDIC = {"TrainingLossNaN", "TrainingHang", "TrainingStraggler"}


def run(argv: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A tool run with an argv list (no shell), its output kept for the failure message."""
    assert shutil.which(argv[0]), f"{argv[0]} is not installed"
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(compose_text())


def compose_text() -> str:
    return (ROOT / "docker-compose.yml").read_text()


@pytest.fixture(scope="module")
def alertmanager() -> dict:
    return yaml.safe_load((CONFIG / "alertmanager.yml").read_text())


@pytest.fixture(scope="module")
def prometheus() -> dict:
    return yaml.safe_load((CONFIG / "prometheus.yml").read_text())


def rules() -> list[dict]:
    return [rule for f in RULE_FILES for g in yaml.safe_load(Path(f).read_text())["groups"] for rule in g["rules"]]


def binds(service: dict) -> list[tuple[str, str]]:
    """(source, target) of a compose service's volumes, short syntax."""
    out = []
    for v in service.get("volumes", []):
        parts = v.split(":")
        out.append((parts[0], parts[1]))
    return out


def option(argv: list[str], flag: str) -> str:
    """The value of `--flag value` or `--flag=value` in an argv list."""
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {argv}")


# -- the tools accept the files
def test_promtool_accepts_the_prometheus_config_and_loads_every_rule_file_through_it() -> None:
    out = run(["promtool", "check", "config", str(CONFIG / "prometheus.yml")])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in out.stdout + out.stderr
    assert len(RULE_FILES) >= 3


def test_promtool_accepts_every_rule_file() -> None:
    out = run(["promtool", "check", "rules", *RULE_FILES])
    assert out.returncode == 0, out.stdout + out.stderr
    assert {r["alert"] for r in rules() if "alert" in r} == PLAYBOOK_ALERTS


def test_each_rule_fires_with_exactly_the_labels_and_annotations_of_its_unit_test() -> None:
    out = run(["promtool", "test", "rules", *map(str, RULES_TESTS)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULES_TESTS)
    # Together the unit tests load every rule file.
    loaded = {(path.parent / f).resolve() for path in RULES_TESTS
              for f in yaml.safe_load(path.read_text())["rule_files"]}
    assert loaded == {Path(f).resolve() for f in RULE_FILES}


@pytest.mark.parametrize("tests", RULES_TESTS, ids=lambda p: p.name)
def test_the_rule_unit_tests_can_fail(tests: Path) -> None:
    # The same tests with one expected label changed must fail, so the passing run above means something.
    text = tests.read_text().replace("node: gpu-node-01", "node: gpu-node-99", 1)
    broken = ROOT / "tests" / f".rules_test_broken_{free_port()}.yml"
    broken.write_text(text)
    try:
        out = run(["promtool", "test", "rules", str(broken)])
    finally:
        broken.unlink()
    assert out.returncode != 0
    assert "gpu-node-99" in out.stdout + out.stderr


def test_amtool_accepts_the_alertmanager_config() -> None:
    out = run(["amtool", "check-config", str(CONFIG / "alertmanager.yml")])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@pytest.mark.parametrize("alertname", sorted(PLAYBOOK_ALERTS))
def test_alertmanager_routes_each_playbook_alert_to_trainmedic(alertname: str) -> None:
    out = run(["amtool", "config", "routes", "test", f"--config.file={CONFIG / 'alertmanager.yml'}",
               f"alertname={alertname}", "severity=critical"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["trainmedic"]


def test_alertmanager_keeps_other_alerts_away_from_trainmedic() -> None:
    out = run(["amtool", "config", "routes", "test", f"--config.file={CONFIG / 'alertmanager.yml'}",
               "alertname=NodeDown"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "trainmedic" not in out.stdout.split()


# -- the alerts carry what the playbooks need
def _expected_alerts() -> list[dict]:
    """Every alert the promtool unit tests prove the rules fire, as Alertmanager would send it."""
    out = []
    for test in (t for path in RULES_TESTS for t in yaml.safe_load(path.read_text())["tests"]):
        for case in test.get("alert_rule_test", []):
            for exp in case.get("exp_alerts") or []:
                labels = {"alertname": case["alertname"], **{k: str(v) for k, v in exp["exp_labels"].items()}}
                out.append({"status": "firing", "labels": labels, "annotations": exp.get("exp_annotations", {}),
                            "startsAt": "2026-11-22T01:25:24.115697517Z", "endsAt": "0001-01-01T00:00:00Z",
                            "generatorURL": "", "fingerprint": f"{len(out):016x}"})
    return out


def test_the_rule_unit_tests_cover_every_alert_and_every_shipped_playbook() -> None:
    fired = {a["labels"]["alertname"] for a in _expected_alerts()}
    assert fired == PLAYBOOK_ALERTS
    for a in _expected_alerts():
        assert a["annotations"].get("summary") and a["annotations"].get("description"), a
        assert a["labels"]["severity"] in ("critical", "warning")
    shipped = load([SHIPPED])
    matched = {pb.name for pb in shipped for a in _expected_alerts() if pb.matches(a["labels"])}
    ours = {pb.name for pb in shipped for name in RAISED_BY_TRAINMEDIC if pb.matches({"alertname": name})}
    assert len(ours) == len(RAISED_BY_TRAINMEDIC) and not matched & ours
    assert matched | ours == {pb.name for pb in shipped}


def test_every_alert_the_rules_fire_resolves_to_a_target_and_is_dispatched(http: Any, r: Any) -> None:
    alerts = _expected_alerts()
    body = {"version": "4", "status": "firing", "receiver": "trainmedic", "groupKey": "{}:{}",
            "truncatedAlerts": 0, "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {},
            "externalURL": "http://alertmanager:9093", "alerts": alerts}
    resp = post_json(http, "/webhook", body)
    assert resp.status_code == 200, resp.get_json()
    made = resp.get_json()["remediations"]
    assert len(made) == len(alerts)  # one playbook per alert, none left out
    xid = []
    for m in made:
        record = http.get(f"/remediations/{m['id']}").get_json()
        name = record["alert"]["labels"]["alertname"]
        if name == "GPUXidError":  # a drain waits for a person; the node's other XID class cools down behind it
            xid.append((record["status"], record["reason"]))
        elif name == "NodeLemon":  # so does a lemon's
            assert (record["playbook"], record["status"]) == ("lemon-node", "pending_approval"), record
        else:
            # Nothing runs the targets here: the record says so, and the commands wait for them.
            assert (record["status"], record["reason"]) == ("dispatched", "no_live_target"), record
        kind = "node" if name in ("GPUTemperatureHigh", "DiskSpaceLow", "GPUXidError", "NodeLemon") else "job"
        assert record["target"]["kind"] == kind
        assert record["target"]["name"] in ("gpu-node-01", "llama-ft-01", "llama-eval-01", "gpt-sft-03")
    assert sorted(xid) == [("pending_approval", None), ("skipped", "cooldown")], xid
    # The hot GPU's command names the GPU, so the agent throttles that one and no other.
    node = keys.Target("node", "gpu-node-01")
    power = [entry_command(r, node, f)[0] for _, f in r.xrange(keys.mailbox(node))]
    power = [c for c in power if c.actions and c.actions[0].action == "power_limit"]
    assert len(power) == 1
    assert power[0].context == {"gpu_id": "0", "gpu_uuid": "GPU-5fd4d6a0-1b7e-8f2c-3d4e-a1b2c3d4e5f6"}


# -- docker-compose.yml
def test_compose_runs_every_service_the_contract_names(compose: dict) -> None:
    assert PROMISED_SERVICES <= set(compose["services"])


def test_every_file_and_folder_the_compose_file_mounts_or_builds_exists(compose: dict) -> None:
    for name, svc in compose["services"].items():
        for source, _ in binds(svc):
            if source.startswith("./"):  # absolute sources are the host's own folders (node-exporter's /)
                assert (ROOT / source).exists(), f"{name}: {source}"
        build = svc.get("build")
        if build:
            assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).is_file(), name
            stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M | re.I)
            assert build["target"] in stages, f"{name}: no Dockerfile stage {build['target']}"
    ignore = [line.strip().lstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()]
    assert (ROOT / f"{TOKEN_FILE}.example").is_file()
    for secret in compose["secrets"].values():
        # The user creates every secret (README, and the compose file's first lines); git ignores them all.
        path = secret["file"].removeprefix("./")
        assert any(line and fnmatch.fnmatch(path, line) for line in ignore), f"{path} not ignored"
        assert path in compose_text(), path
    named = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for source, _ in binds(svc):
            if not source.startswith(("./", "/")):
                assert source in named, f"{name}: volume {source} is not declared"


def test_redis_keeps_an_append_only_file_on_a_volume(compose: dict) -> None:
    redis_svc = compose["services"]["redis"]
    argv = redis_svc["command"]
    assert option(argv, "--appendonly") == "yes"
    assert ("redis-data", "/data") in binds(redis_svc)


def test_the_service_runs_gunicorn_through_trainmedic_serve_with_its_token_from_a_file(compose: dict) -> None:
    svc = compose["services"]["trainmedic"]
    argv = svc["command"]
    assert argv[:2] == ["trainmedic", "serve"]
    args = cli_parser().parse_args(argv[1:])
    assert (args.host, args.no_agent) == ("0.0.0.0", True)
    assert args.redis_url is None  # its URL holds a password: in the environment, never on the command line
    url = urlsplit(svc["environment"]["TRAINMEDIC_REDIS_URL"])
    assert url.scheme == "redis" and url.hostname in compose["services"] and url.port == 6379
    env = svc["environment"]
    # Every secret from a file under /run/secrets, none in the environment itself.
    assert {env[f"TRAINMEDIC_{k}_FILE"] for k in ("WEBHOOK_TOKEN", "OPERATOR_TOKEN", "SIGNING_KEY")} == {
        f"/run/secrets/{s}" for s in svc["secrets"]}
    assert set(svc["secrets"]) <= set(compose["secrets"]) and "verify_key" not in svc["secrets"]
    assert not {"TRAINMEDIC_WEBHOOK_TOKEN", "TRAINMEDIC_OPERATOR_TOKEN", "TRAINMEDIC_SIGNING_KEY"} & set(env)
    assert urlsplit(env["TRAINMEDIC_ALERTMANAGER_URL"]).hostname in compose["services"]
    assert urlsplit(env["TRAINMEDIC_PROMETHEUS_URL"]).hostname in compose["services"]
    assert "trainmedic" in env["TRAINMEDIC_ALLOWED_HOSTS"].split(",")  # Alertmanager's Host header
    assert any(target == args.playbooks and (ROOT / source).is_dir() for source, target in binds(svc))
    assert f"{args.port}:{args.port}" in svc["ports"]


def test_the_agent_gets_the_gpus_the_driver_library_and_its_allow_root(compose: dict) -> None:
    svc = compose["services"]["agent"]
    argv = svc["command"]
    assert argv[:2] == ["trainmedic", "agent"]
    args = cli_parser().parse_args(argv[1:])
    assert args.allow_root == ["/checkpoints"]
    assert any(target == "/checkpoints" for _, target in binds(svc))
    # The trainer writes its checkpoints to the same volume the agent may clean.
    trainer_mounts = dict((t, s) for s, t in binds(compose["services"]["trainer"]))
    assert dict((t, s) for s, t in binds(svc))["/checkpoints"] == trainer_mounts["/checkpoints"]
    [device] = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    env = svc["environment"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")  # libnvidia-ml.so for NVML
    assert args.redis_url is None and urlsplit(env["TRAINMEDIC_REDIS_URL"]).hostname in compose["services"]
    # Agent and trainer verify with the public half only; the signing key stays with the service.
    for name in ("agent", "trainer"):
        who = compose["services"][name]
        assert who["secrets"] == ["verify_key"] and who["environment"]["TRAINMEDIC_VERIFY_KEY_FILE"] == \
            "/run/secrets/verify_key"


def test_the_agent_node_name_is_the_one_the_exporters_report(compose: dict) -> None:
    # The rules take node from dcgm-exporter's Hostname and node_exporter's nodename: the container host names.
    node = option(compose["services"]["agent"]["command"], "--node")
    assert compose["services"]["dcgm-exporter"]["hostname"] == node
    assert compose["services"]["node-exporter"]["hostname"] == node
    resolved = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", node)
    assert keys.TARGET_NAME_RE.match(resolved)


def test_alertmanager_posts_to_the_trainmedic_service_webhook_with_a_bearer_token_file(
        compose: dict, alertmanager: dict) -> None:
    [receiver] = [rc for rc in alertmanager["receivers"] if rc["name"] == "trainmedic"]
    [hook] = receiver["webhook_configs"]
    url = urlsplit(hook["url"])
    serve = cli_parser().parse_args(compose["services"]["trainmedic"]["command"][1:])
    assert (url.scheme, url.hostname, url.port, url.path) == ("http", "trainmedic", serve.port, "/webhook")
    assert url.hostname in compose["services"]
    assert hook["send_resolved"] is True
    auth = hook["http_config"]["authorization"]
    assert auth["type"] == "Bearer"
    am = compose["services"]["alertmanager"]
    [secret] = am["secrets"]
    assert auth["credentials_file"] == f"/run/secrets/{secret}"
    svc = compose["services"]["trainmedic"]
    assert svc["environment"]["TRAINMEDIC_WEBHOOK_TOKEN_FILE"] == f"/run/secrets/{secret}"  # the same token
    assert ("./config/alertmanager.yml", option(am["command"], "--config.file")) in binds(am)


def test_prometheus_mounts_its_config_and_rules_where_the_config_looks_and_scrapes_compose_services(
        compose: dict, prometheus: dict) -> None:
    svc = compose["services"]["prometheus"]
    config_in = option(svc["command"], "--config.file")
    mounts = dict((t, s) for s, t in binds(svc))
    assert mounts[config_in] == "./config/prometheus.yml"
    rules_glob = str(Path(config_in).parent / prometheus["rule_files"][0])
    assert mounts[str(Path(rules_glob).parent)] == "./config/rules"
    ports = {"trainmedic": str(cli_parser().parse_args(compose["services"]["trainmedic"]["command"][1:]).port),
             "trainer": option(compose["services"]["trainer"]["command"], "--metrics-port")}
    for job in prometheus["scrape_configs"]:
        for sc in job["static_configs"]:
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                assert host == "localhost" or host in compose["services"], target
                if host in ports:
                    assert port == ports[host], target
    [am] = prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am.split(":")[0] in compose["services"]


def test_the_trainer_command_is_one_the_example_trainer_accepts(compose: dict) -> None:
    argv = compose["services"]["trainer"]["command"]
    assert argv[:2] == ["python", "/app/train.py"]
    assert "COPY examples/train.py /app/train.py" in (ROOT / "Dockerfile").read_text()
    args = _example_trainer().parser().parse_args(argv[2:])
    assert args.checkpoint_dir == Path("/checkpoints")
    assert urlsplit(compose["services"]["trainer"]["environment"]["TRAINMEDIC_REDIS_URL"]).hostname == "redis"


# -- Dockerfile
def test_the_dockerfile_builds_non_root_images_from_python_311_slim_without_build_tools() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM\s+", text, flags=re.M)[1:]
    assert stages[0].startswith("python:3.11-slim AS base")
    named = {re.match(r"\S+\s+AS\s+(\S+)", s).group(1): s for s in stages}
    service = stages[-1]  # the default target
    assert service.startswith("base AS service")
    assert re.search(r"pip install \"?'?/src\[service\]", named["service-build"])
    for final in ("service", "trainer"):
        # Only the build stage's virtualenv reaches a final image: no pip run there, no compiler, no sources.
        body = named[final]
        assert re.search(rf"^COPY --from={final}-build /opt/venv /opt/venv$", body, re.M), final
        assert not re.search(r"^RUN\b", body, re.M), final
        user = re.findall(r"^USER\s+(\S+)", body, re.M)
        assert user and user[-1] not in ("root", "0", "0:0"), final
    assert "pip uninstall -q -y pip setuptools" in named["service-build"]
    # The trainer verifies signed commands (compose gives it the verify key): the client needs cryptography.
    assert re.search(r"^RUN pip install /src cryptography", named["trainer-build"], re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*/readyz", service, re.M)
    assert "torch==2.13.0" in text  # the trainer pins torch like the project does
    assert "COPY deploy/docker/constraints.txt /etc/trainmedic-constraints.txt" in text
    assert "PIP_CONSTRAINT=/etc/trainmedic-constraints.txt" in text
    pins = [line for line in (ROOT / "deploy/docker/constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[a-z0-9-]+==[0-9][0-9A-Za-z.+]*", line) for line in pins)
    for src in re.findall(r"^COPY\s+(?!--)(.+)\s+\S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"COPY source {path} is missing"
    ignore = [line for line in (ROOT / ".dockerignore").read_text().split() if not line.startswith("#")]
    for kept_out in (".git", ".venv", ".env", TOKEN_FILE, "config/operator.token", "config/signing.key"):
        parts = kept_out.split("/")
        assert any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for pattern in ignore
                   for i in range(1, len(parts) + 1)), kept_out


def test_every_package_the_images_install_is_pinned() -> None:
    # The images install with the pins as constraints; a requirement added to pyproject.toml needs its pin here.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["agent"],
              *project["optional-dependencies"]["service"], "prometheus-client", "cryptography"]
    names = {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", req).group(0)).lower() for req in wanted}
    pinned = {line.split("==")[0] for line in (ROOT / "deploy/docker/constraints.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    assert names - {"trainmedic"} <= pinned, sorted(names - {"trainmedic"} - pinned)


# -- the example trainer
def _example_trainer() -> Any:
    spec = importlib.util.spec_from_file_location("example_train", ROOT / "examples" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _metrics(url: str) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url, timeout=5).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_the_example_trainer_exports_what_the_rules_use_and_answers_a_loss_spike(
        http: Any, redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    job = "example-job"
    log = open(tmp_path / "trainer.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--job", job, "--redis-url", redis_url,
         "--metrics-port", str(port), "--metrics-addr", "127.0.0.1", "--step-time", "0.02", "--steps", "3000",
         "--checkpoint-every", "20", "--checkpoint-dir", str(tmp_path / "ckpt"), "--spike-at", "60",
         "--no-detect"],  # the spike is for the rules' path here (the client's own detectors would answer it first)
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 60
        m: dict = {}
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                m = _metrics(url)
                if m.get("training_step") and m["training_step"][0].value >= 70:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        assert m.get("training_step") and m["training_step"][0].value >= 70, (tmp_path / "trainer.log").read_text()
        # Every training_* series a rule reads is exported, labelled by job_name (GPU info needs a GPU).
        used = {n for r in rules() for n in re.findall(r"\b(training_[a-z_]+)\b", r["expr"])}
        assert used >= {"training_loss", "training_throughput_samples_per_second", "training_gpu_info"}
        for name in used - {"training_gpu_info"}:
            assert m.get(name), f"{name} is not exported"
            assert all(s.labels.get("job_name") == job for s in m[name]), m[name]
        assert "training_gpu_info" in m  # declared; it has samples only on a CUDA device
        assert m["training_loss"][0].value > 10  # the corrupt shard from step 60 spiked the loss
        lr_before = m["training_learning_rate"][0].value

        alert = {"status": "firing", "labels": {"alertname": "TrainingLossSpike", "job_name": job,
                                                "severity": "critical"},
                 "annotations": {}, "startsAt": "2026-11-22T01:25:24.1Z", "fingerprint": "00000000000000aa"}
        resp = post_json(http, "/webhook", {"version": "4", "status": "firing", "alerts": [alert]})
        [made] = resp.get_json()["remediations"]
        record: dict = {}
        deadline = time.monotonic() + 60  # its own minute: the trainer's start (torch import) had the first
        while time.monotonic() < deadline:
            record = http.get(f"/remediations/{made['id']}").get_json()
            if record["status"] != "dispatched":
                break
            time.sleep(0.1)
        assert record["status"] == "applied", record
        rollback, scale = record["actions"]
        assert rollback["action"] == "rollback_checkpoint" and rollback["result"]["restored_step"] <= 60
        assert scale["action"] == "scale_lr"
        assert scale["result"]["new_lr"][0] == pytest.approx(scale["result"]["old_lr"][0] / 2)
        after = _metrics(url)
        until = time.monotonic() + 10  # the next steps export the restored model's loss
        while after["training_loss"][0].value >= 1 and time.monotonic() < until:
            time.sleep(0.2)
            after = _metrics(url)
        assert after["training_loss"][0].value < 1  # the shard is skipped and the model restored
        assert after["training_learning_rate"][0].value < lr_before * 0.75
        acted = {s.labels["action"]: s.value for s in after["training_remediation_actions"]
                 if s.name.endswith("_total")}
        assert acted == {"rollback_checkpoint": 1.0, "scale_lr": 1.0}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert proc.returncode == 0, (tmp_path / "trainer.log").read_text()[-2000:]
    saved = sorted((tmp_path / "ckpt" / job).glob("checkpoint-*.pt"))
    assert saved, "no checkpoint was written"
    assert not list((tmp_path / "ckpt" / job).glob("*.tmp"))
    # Named so the agent's disk_cleanup recognises them as checkpoints (and keeps the newest).
    assert all(any(fnmatch.fnmatch(p.name, pat) for pat in DEFAULT_CHECKPOINT_PATTERNS) for p in saved)


def test_the_example_trainer_needs_no_exporter_its_signals_reach_the_services_metrics_and_its_detector(
        http: Any, r: Any, redis_url: str, tmp_path: Path) -> None:
    job = "example-plain"
    with open(tmp_path / "trainer.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "train.py"), "--job", job, "--redis-url", redis_url,
             "--step-time", "0.01", "--steps", "3000", "--checkpoint-every", "0", "--spike-at", "120"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    stream = keys.detections(keys.Target("job", job))
    try:
        deadline = time.monotonic() + 90
        text = ""
        names = ("loss", "step", "learning_rate", "grad_norm", "samples_per_second")
        while time.monotonic() < deadline and proc.poll() is None:
            # The throughput needs two heartbeats (5 s apart): it comes last.
            text = http.get("/metrics").data.decode()
            if all(f'trainmedic_training_{n}{{job_name="{job}"}} ' in text for n in names) and r.xlen(stream):
                break
            time.sleep(0.2)
        out = (tmp_path / "trainer.log").read_text()
        for name in names:
            assert f'trainmedic_training_{name}{{job_name="{job}"}} ' in text, out[-2000:]
        # The client judged the corrupt shard's losses itself, in the loop: no exporter, no Prometheus rule.
        [(_, first)] = r.xrange(stream, count=1)
        assert first["alertname"] == "TrainingLossSpike" and first["status"] == "firing"
        assert 120 < int(first["step"]) <= 126, first
        assert "own metrics on :-" in out  # nothing served on a port of its own
    finally:
        proc.terminate()
        proc.wait(15)
