"""The Compose stack for real: build the images, `up` docker-compose.yml, drive one alert end to end, `down`.

Run by `make compose-test` (and so by `make test`), as root, with Podman and podman-compose (scripts/system-deps
installs them). No image registry is needed: the images docker-compose.yml names are stand-ins built from Debian's
packages (tests/compose/standins/, on a debootstrap base) and kept between runs under a hash of what they
contain; the trainmedic images are built from the repository's Dockerfile, their packages from a local wheel index
that this machine's pip fills once (cached the same way). Every container runs on Podman's private bridge network;
the host reaches only the ports docker-compose.yml publishes on its own addresses.

Stages, each printed with its time: images, up, alert (Prometheus's TrainingLossSpike rule fires on the example
trainer's loss, Alertmanager posts to trainmedic with the bearer token, the trainer applies scale_lr and acks),
record (read over HTTP from the host), acl (each container's Redis user does only its own part), restart (the
trainmedic container; the history survives) and down (containers, volumes and network removed). Then the record's
JSON. Grafana and dcgm-exporter stay in docker-compose.yml but are not started here: the line saying why is printed.
"""
from __future__ import annotations

import contextlib
import hashlib
import html
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
import yaml

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STANDINS = HERE / "standins"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainmedic" / "compose-test"
PROJECT = "trainmedic-compose-test"
LABEL = "io.trainmedic.standin"  # the hash of what a cached image was built from
DEBIAN_MIRROR = os.environ.get("TRAINMEDIC_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE = "localhost/trainmedic-standin/debian:bookworm"
# Tag -> recipe: every image docker-compose.yml or the Dockerfile names that a started service needs.
STANDIN_IMAGES = {
    "docker.io/library/python:3.11-slim": "python.Containerfile",
    "docker.io/library/redis:7.2-alpine": "redis.Containerfile",
    "docker.io/prom/prometheus:v2.53.0": "prometheus.Containerfile",
    "docker.io/prom/alertmanager:v0.27.0": "alertmanager.Containerfile",
    "docker.io/prom/node-exporter:v1.8.1": "node-exporter.Containerfile",
}
NOT_STARTED = {
    "grafana": "Grafana is not packaged by Debian and no image registry is reachable here",
    "dcgm-exporter": "NVIDIA's DCGM exporter is not packaged by Debian, and it needs a GPU and the NVIDIA "
                     "Container Toolkit",
}
SPIKE_AT = "2400"  # the corrupt shard from about two minutes in (at most 20 steps/s): 8 healthy scrapes first
OBSERVER = "compose-test-observer"  # an extra Redis user in the test's copy of users.acl, to read ACL LOG only
HTTP = "http://127.0.0.1:9095"
ALERT_TIMEOUT_S = 420
ENV = dict(os.environ, CONTAINERS_CONF=str(HERE / "containers.conf"))
STARTED = time.monotonic()


class Failed(Exception):
    """A stage found the stack not doing what it should."""


def say(line: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f}s] {line}", flush=True)


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Print the stage's start, and its end with how long it took."""
    t0 = time.monotonic()
    say(f"{name} ...")
    yield
    say(f"{name}: done in {time.monotonic() - t0:.1f} s")


def run(argv: list[str], *, cwd: Path = ROOT, timeout: float = 600, check: bool = True,
        quiet: bool = True) -> subprocess.CompletedProcess[str]:
    """A tool run with an argv list; its output shown only when it fails (or when not quiet)."""
    proc = subprocess.run(argv, cwd=cwd, env=ENV, text=True, timeout=timeout,
                          stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT if quiet else None)
    if check and proc.returncode != 0:
        raise Failed(f"{' '.join(argv[:4])} ... exited {proc.returncode}:\n{(proc.stdout or '')[-4000:]}")
    return proc


def podman(*args: str, timeout: float = 600, check: bool = True) -> str:
    return run(["podman", *args], timeout=timeout, check=check).stdout.strip()


def digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def cached(tag: str, key: str) -> bool:
    """Whether tag is an image built from the recipe hashed to key."""
    out = run(["podman", "image", "inspect", "--format", f'{{{{index .Labels "{LABEL}"}}}}', tag], check=False)
    return out.returncode == 0 and out.stdout.strip() == key


# -- images
def base_image() -> str:
    """A minimal Debian 12 from debootstrap, imported once; returns its recipe's hash."""
    recipe = f"debootstrap --variant=minbase bookworm {DEBIAN_MIRROR}; policy-rc.d 101; no docs".encode()
    key = digest(recipe, Path(__file__).read_bytes().split(b"# -- images", 1)[1].split(b"def standins", 1)[0])
    if cached(BASE, key):
        say(f"  {BASE}: cached ({key})")
        return key
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        rootfs = Path(tmp) / "rootfs"
        (CACHE / "debs").mkdir(exist_ok=True)
        run(["debootstrap", "--variant=minbase", f"--cache-dir={CACHE / 'debs'}", "bookworm", str(rootfs),
             DEBIAN_MIRROR], timeout=900)
        # As Debian's own images do: no services started by package scripts, no docs or man pages installed.
        policy = rootfs / "usr/sbin/policy-rc.d"
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        (rootfs / "etc/dpkg/dpkg.cfg.d/excludes").write_text(
            "path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\n"
            "path-exclude /usr/share/locale/*\npath-include /usr/share/locale/locale.alias\n")
        for folder in ("usr/share/doc", "usr/share/man", "usr/share/info", "var/cache/apt/archives",
                       "var/lib/apt/lists"):
            for child in (rootfs / folder).glob("*"):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                elif child.name != "lock":
                    child.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["podman", "import", "--change", f"LABEL {LABEL}={key}", "--change", 'CMD ["bash"]',
                        "-", BASE], stdin=tar.stdout, env=ENV, check=True, capture_output=True, timeout=600)
        if tar.wait() != 0:
            raise Failed("tar of the debootstrap root failed")
    say(f"  {BASE}: debootstrapped ({key})")
    return key


def standins(base_key: str) -> None:
    """The images of Redis, Python, Prometheus, Alertmanager and node_exporter, from Debian's packages."""
    for tag, recipe in STANDIN_IMAGES.items():
        files = sorted(p for p in STANDINS.iterdir() if p.name == recipe or p.suffix == ".sh")
        key = digest(base_key.encode(), *(p.name.encode() + p.read_bytes() for p in files))
        if cached(tag, key):
            say(f"  {tag}: cached ({key})")
            continue
        run(["podman", "build", "--pull=never", "--network=host", "--label", f"{LABEL}={key}",
             "-f", str(STANDINS / recipe), "-t", tag, str(STANDINS)], timeout=900)
        say(f"  {tag}: built from Debian's packages ({key})")


def wheel_index() -> Path:
    """A local PEP 503 index of every package the Dockerfile installs, filled by this machine's pip once."""
    constraints = ROOT / "deploy" / "docker" / "constraints.txt"
    torch = re.search(r'"(torch==[^"]+)"', (ROOT / "Dockerfile").read_text())
    if not torch:
        raise Failed("the Dockerfile pins no torch version")
    pins = [line for line in constraints.read_text().splitlines() if line and not line.startswith("#")]
    key = digest("\n".join(pins).encode(), torch.group(1).encode())
    index = CACHE / f"wheels-{key}"
    if (index / "simple" / "index.html").is_file():
        say(f"  wheels: cached ({key})")
        return index
    CACHE.mkdir(parents=True, exist_ok=True)
    for old in CACHE.glob("wheels-*"):  # an index for other pins is never used again
        shutil.rmtree(old)
    tmp = Path(tempfile.mkdtemp(dir=CACHE))
    try:
        files = tmp / "files"
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(files),
             torch.group(1), *pins], timeout=1800)
        projects: dict[str, list[str]] = {}
        for wheel in sorted(os.listdir(files)):
            projects.setdefault(re.sub(r"[-_.]+", "-", wheel.split("-")[0]).lower(), []).append(wheel)
        for name, wheels in projects.items():
            page = tmp / "simple" / name / "index.html"
            page.parent.mkdir(parents=True)
            page.write_text("".join(f'<a href="../../files/{html.escape(w)}">{html.escape(w)}</a>\n' for w in wheels))
        (tmp / "simple" / "index.html").write_text(
            "".join(f'<a href="{n}/">{n}</a>\n' for n in sorted(projects)))
        tmp.rename(index)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"  wheels: {sum(len(os.listdir(p)) for p in [index / 'files'])} downloaded ({key})")
    return index


def trainmedic_images(index: Path) -> dict[str, int]:
    """The Dockerfile's two images, under the tags docker-compose.yml uses; their sizes in bytes."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    sizes = {}
    for svc in ("trainmedic", "trainer"):
        tag, target = compose[svc]["image"], compose[svc]["build"]["target"]
        found = run(["podman", "image", "inspect", "--format", "{{.Id}}", tag], check=False)
        before = found.stdout.strip() if found.returncode == 0 else ""
        # No network while building: every package comes from the mounted index, nothing from the internet.
        run(["podman", "build", "--pull=never", "--network=none", "--format=docker", "--target", target,
             "--volume", f"{index}:/wheels:ro", "--build-arg", "PIP_INDEX_URL=file:///wheels/simple/",
             "--build-arg", "TORCH_INDEX=file:///wheels/simple/", "-t", tag, "."], timeout=1800)
        sizes[tag] = int(podman("image", "inspect", "--format", "{{.Size}}", tag))
        # The image this one replaces would keep its own copy of the virtualenv (a GB with torch) on every run.
        if before and before != podman("image", "inspect", "--format", "{{.Id}}", tag):
            podman("rmi", before, check=False)
        say(f"  {tag} (target {target}): {sizes[tag] / 1e6:.0f} MB")
    health = json.loads(podman("image", "inspect", "--format", "{{json .Config.Healthcheck}}",
                               compose["trainmedic"]["image"]))
    if not health or "/readyz" not in " ".join(health.get("Test", [])):
        raise Failed(f"the service image has no HEALTHCHECK on /readyz: {health}")
    user = podman("image", "inspect", "--format", "{{.Config.User}}", compose["trainmedic"]["image"])
    if user in ("", "root", "0", "0:0"):
        raise Failed(f"the service image runs as {user or 'root'}")
    tools = podman("run", "--rm", "--entrypoint", "sh", compose["trainmedic"]["image"], "-c",
                   "for t in pip pip3 gcc cc make; do command -v $t; done; ls /opt/venv/bin", check=False)
    if any(line.rsplit("/", 1)[-1] in ("pip", "pip3", "gcc", "cc", "make") for line in tools.splitlines()):
        raise Failed(f"build tools left in the service image:\n{tools}")
    return sizes


# -- the stack
def project_dir(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the files docker-compose.yml reads, with the secrets and .env the README says to make."""
    proj = tmp / "stack"
    proj.mkdir()
    shutil.copy2(ROOT / "docker-compose.yml", proj)
    shutil.copytree(ROOT / "config", proj / "config", ignore=shutil.ignore_patterns(
        "trainmedic.token", "operator.token", "signing.key", "verify.key"))
    shutil.copytree(ROOT / "playbooks", proj / "playbooks", ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    cfg = proj / "config"
    (cfg / "trainmedic.token").write_text(secrets.token_hex(32) + "\n")
    (cfg / "operator.token").write_text(secrets.token_hex(32) + "\n")
    run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(cfg / "signing.key")])
    run(["openssl", "pkey", "-in", str(cfg / "signing.key"), "-pubout", "-out", str(cfg / "verify.key")])
    for name in ("trainmedic.token", "operator.token", "signing.key", "verify.key"):
        (cfg / name).chmod(0o644)
    passwords = {f"TRAINMEDIC_REDIS_{u}_PASSWORD": secrets.token_hex(32) for u in ("SERVICE", "AGENT", "TRAINER")}
    passwords["OBSERVER"] = secrets.token_hex(32)
    (proj / ".env").write_text("".join(f"{k}={v}\n" for k, v in passwords.items() if k != "OBSERVER"))
    # The one user the test adds: it reads ACL LOG (no stack user may), and does nothing else.
    sha = hashlib.sha256(passwords["OBSERVER"].encode()).hexdigest()
    with open(cfg / "redis" / "users.acl", "a") as acl:
        acl.write(f"\nuser {OBSERVER} on #{sha} resetkeys resetchannels -@all +acl|log +ping\n")
    return proj, passwords


def spike_command(proj: Path) -> list[str]:
    """The trainer's command with --spike-at: the compose file's own, plus two flags, in an override file."""
    base = yaml.safe_load((proj / "docker-compose.yml").read_text())["services"]["trainer"]["command"]
    # --no-detect: the client's own detectors would answer the spike within a few steps, before Prometheus's rule
    # could fire; this test drives the rule, Alertmanager and the webhook's token.
    want = [*base, "--no-detect", "--spike-at", SPIKE_AT]
    # The Compose spec replaces a list given in an override; podman-compose 1.0 appends to it instead. Whichever
    # this one does, its dry run shows the command it would start the trainer with.
    for override in (want, want[len(base):]):
        (proj / "spike.yml").write_text(yaml.safe_dump({"services": {"trainer": {"command": override}}}))
        dry = run(compose_cmd(proj, "--dry-run", "up", "-d", "--no-build", "trainer"), cwd=proj).stdout
        line = next((x for x in dry.splitlines() if f"--name={container('trainer')}" in x), "")
        if line.endswith(" " + " ".join(want)) and line.count("/app/train.py") == 1:
            return want
    raise Failed(f"podman-compose would not start the trainer with {' '.join(want)}")


def compose_cmd(proj: Path, *args: str) -> list[str]:
    options = [a for a in args if a == "--dry-run"]  # podman-compose's own option, before the command
    return ["podman-compose", *options, "-p", PROJECT, "-f", str(proj / "docker-compose.yml"),
            "-f", str(proj / "spike.yml"), *[a for a in args if a != "--dry-run"]]


def container(service: str) -> str:
    return f"{PROJECT}_{service}_1"


def wait_ready(timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            r = requests.get(f"{HTTP}/readyz", timeout=3)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except requests.RequestException as exc:
            last = str(exc)
        time.sleep(1)
    raise Failed(f"trainmedic was not ready at {HTTP}/readyz within {timeout:.0f} s: {last}")


def up(proj: Path) -> None:
    services = yaml.safe_load((proj / "docker-compose.yml").read_text())["services"]
    for name, why in NOT_STARTED.items():
        if name in services:
            say(f"  not started: {name}: {why} (it stays in docker-compose.yml)")
    started = [s for s in services if s not in NOT_STARTED]
    want = spike_command(proj)
    run(compose_cmd(proj, "up", "-d", "--no-build", *started), cwd=proj, timeout=600)
    got = json.loads(podman("inspect", "--format", "{{json .Config.Cmd}}", container("trainer")))
    if got != want:
        raise Failed(f"the trainer runs {got}, not {want}")
    wait_ready()
    for svc in started:
        state = podman("inspect", "--format", "{{.State.Status}}", container(svc), check=False)
        if state != "running":
            logs = podman("logs", "--tail", "40", container(svc), check=False)
            raise Failed(f"{svc} is {state or 'missing'}:\n{logs}")
    say(f"  running: {', '.join(started)}; {HTTP}/readyz answers 200")


def alert() -> dict[str, Any]:
    """The TrainingLossSpike record, once the trainer has acked its scale_lr."""
    deadline = time.monotonic() + ALERT_TIMEOUT_S
    seen = ""
    while time.monotonic() < deadline:
        r = requests.get(f"{HTTP}/history", params={"alertname": "TrainingLossSpike"}, timeout=5)
        r.raise_for_status()
        items = r.json()["items"]
        if items:
            rec = items[-1]
            if rec["id"] not in seen:
                say(f"  record {rec['id']}: {rec['status']}")
                seen += rec["id"]
            steps = {a["action"]: a for a in rec["actions"]}
            if steps.get("scale_lr", {}).get("status") == "applied":
                return rec
        time.sleep(3)
    raise Failed(f"no applied scale_lr for TrainingLossSpike within {ALERT_TIMEOUT_S} s "
                 f"(records: {seen or 'none'})")


def check_record(rec: dict[str, Any]) -> dict[str, Any]:
    """The record read back by id from the host, with what the whole path must have left in it."""
    r = requests.get(f"{HTTP}/remediations/{rec['id']}", timeout=5)
    if r.status_code != 200:
        raise Failed(f"GET /remediations/{rec['id']} answered {r.status_code}: {r.text[:300]}")
    got = r.json()
    step = next(a for a in got["actions"] if a["action"] == "scale_lr")
    checks = {
        "sent by Alertmanager's webhook (bearer token accepted)": got["requested_by"] == "webhook",
        "for the example job": got["target"] == {"kind": "job", "name": "example-job"},
        "the rule's alert": got["alert"]["alertname"] == "TrainingLossSpike",
        "scale_lr applied": step["status"] == "applied",
        "acked by the trainer container": bool(step["acked_at"]) and bool(step["acked_by"]),
        "the learning rate halved": bool(step["result"]) and all(
            abs(new - old / 2) <= 1e-9 + old * 1e-6 or new == step["params"].get("min_lr")
            for old, new in zip(step["result"]["old_lr"], step["result"]["new_lr"])),
    }
    bad = [what for what, ok in checks.items() if not ok]
    if bad:
        raise Failed(f"the record is not what the flow should leave ({', '.join(bad)}):\n{json.dumps(got, indent=1)}")
    say(f"  GET /remediations/{got['id']}: 200, {'; '.join(checks)}")
    return got


# Run inside each container with its own TRAINMEDIC_REDIS_URL: what it may do, then what it must not.
PROBE = """
import json, os, sys, redis
r = redis.Redis.from_url(os.environ["TRAINMEDIC_REDIS_URL"], socket_timeout=5)
out = {}
for label, argv in json.loads(sys.argv[1]):
    try:
        r.execute_command(*argv)
        out[label] = "ok"
    except redis.exceptions.NoPermissionError as exc:
        out[label] = "NOPERM " + str(exc)
    except redis.exceptions.ResponseError as exc:
        out[label] = "ERR " + str(exc)
print(json.dumps(out))
"""
NODE_KEY = "trainmedic:{node:gpu-node-01}:mailbox"
JOB_KEY = "trainmedic:{job:example-job}:mailbox"
PROBES: dict[str, tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]] = {
    # service: every trainmedic key, nothing else, no admin or keyspace-wide command
    "trainmedic": ([("its keys", ["EXISTS", JOB_KEY, NODE_KEY])],
                   [("CONFIG GET", ["CONFIG", "GET", "maxmemory"]), ("KEYS", ["KEYS", "*"]),
                    ("a key outside trainmedic:*", ["GET", "otherapp:secret"])]),
    # node agent: its own node's keys only
    "agent": ([("its node's keys", ["EXISTS", NODE_KEY])],
              [("a job's key", ["EXISTS", JOB_KEY]),
               ("another node's key", ["EXISTS", "trainmedic:{node:other}:mailbox"]),
               ("Lua of its own", ["EVAL", "return 1", "0"])]),
    # trainer: its own job's keys only
    "trainer": ([("its job's keys", ["EXISTS", JOB_KEY])],
                [("a node's key", ["EXISTS", NODE_KEY]),
                 ("another job's key", ["EXISTS", "trainmedic:{job:other}:mailbox"]),
                 ("Lua of its own", ["EVAL", "return 1", "0"])]),
}


def acl_log(observer_password: str) -> list[dict[str, Any]]:
    url = f"redis://{OBSERVER}:{observer_password}@redis:6379/0"
    code = (f"import json, redis; r = redis.Redis.from_url({url!r}, decode_responses=True);"
            "print(json.dumps(r.acl_log(count=1000), default=str))")
    return list(json.loads(podman("exec", container("trainmedic"), "python", "-c", code)))


def acl(observer_password: str) -> None:
    # redis-py sends CLIENT SETINFO on connecting, which users.acl leaves out on purpose (Redis 7.2+ logs it).
    def log() -> list[dict[str, Any]]:
        return [e for e in acl_log(observer_password) if e.get("object") != "client|setinfo"]

    before = log()
    if before:
        raise Failed(f"Redis refused the stack something it needed (ACL LOG):\n{json.dumps(before, indent=1)}")
    say("  ACL LOG empty after the whole flow: every container's user could do its part")
    seen = 0
    for svc, (allowed, forbidden) in PROBES.items():
        got = json.loads(podman("exec", container(svc), "python", "-c", PROBE, json.dumps(allowed + forbidden)))
        for label, _ in allowed:
            if got[label] != "ok":
                raise Failed(f"{svc}: {label}: {got[label]}")
        for label, _ in forbidden:
            if not got[label].startswith("NOPERM"):
                raise Failed(f"{svc}: {label} was not refused: {got[label]}")
        now = log()
        users = {e["username"] for e in now[:len(now) - seen]}  # ACL LOG lists the newest first
        if len(users) != 1:
            raise Failed(f"{svc}: its refusals should show in ACL LOG under its one user, not {users or 'none'}")
        seen = len(now)
        say(f"  {svc} as Redis user {users.pop()}: {', '.join(label for label, _ in allowed)} allowed; "
            f"{', '.join(label for label, _ in forbidden)} refused (NOPERM, in ACL LOG)")


def restart(rec: dict[str, Any]) -> None:
    podman("restart", container("trainmedic"), timeout=120)
    wait_ready()
    r = requests.get(f"{HTTP}/remediations/{rec['id']}", timeout=5)
    if r.status_code != 200:
        raise Failed(f"after the restart GET /remediations/{rec['id']} answered {r.status_code}")
    after = r.json()
    for field in ("id", "created_at", "alert", "target", "actions", "requested_by"):
        if after[field] != rec[field]:
            raise Failed(f"the record's {field} changed over the restart: {rec[field]} -> {after[field]}")
    say(f"  {container('trainmedic')} restarted; the record reads the same from Redis")


def leftovers() -> dict[str, list[str]]:
    """What of the test's project is still there: containers, volumes, networks."""
    label = f"label=io.podman.compose.project={PROJECT}"
    found = {"container": podman("ps", "-a", "--filter", label, "--format", "{{.Names}}").split(),
             "volume": podman("volume", "ls", "--filter", label, "--format", "{{.Name}}").split(),
             "network": [n for n in podman("network", "ls", "--format", "{{.Name}}").split() if n.startswith(PROJECT)]}
    return {kind: names for kind, names in found.items() if names}


def down(proj: Path) -> None:
    out = run(compose_cmd(proj, "down", "-v"), cwd=proj, timeout=300, check=False)
    left = leftovers()
    # podman-compose 1.0 leaves the project's network behind, and a volume whose container was still going away.
    if set(left) - {"network"}:
        say(f"  podman-compose down left {left} (exit {out.returncode}); removing them")
    for name in left.get("container", []):
        podman("rm", "-f", "-t", "0", name, check=False)
    for kind in ("volume", "network"):
        for name in left.get(kind, []):
            podman(kind, "rm", "-f", name, check=False)
    left = leftovers()
    if left:
        raise Failed(f"down left these behind: {left}")
    say("  containers, volumes and network removed")


def main() -> int:
    if os.geteuid() != 0:
        print("compose-test runs as root: debootstrap and rootful Podman need it", file=sys.stderr)
        return 2
    for tool in ("podman", "podman-compose", "debootstrap", "openssl"):
        if not shutil.which(tool):
            print(f"compose-test needs {tool}: run `make system-deps` as root", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # interrupted: still take the stack down
    rec: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="trainmedic-compose-") as tmp:
        proj, passwords = project_dir(Path(tmp))
        try:
            if leftovers():
                say(f"  a previous run left {leftovers()}: removing them first")
                down(proj)
            with stage("images"):
                standins(base_image())
                trainmedic_images(wheel_index())
            with stage("up"):
                up(proj)
            with stage("alert"):
                rec = alert()
            with stage("record"):
                rec = check_record(rec)
            with stage("acl"):
                acl(passwords["OBSERVER"])
            with stage("restart"):
                restart(rec)
        except (Failed, requests.RequestException, subprocess.TimeoutExpired) as exc:
            say(f"FAILED: {exc}")
            for svc in yaml.safe_load((proj / "docker-compose.yml").read_text())["services"]:
                if svc not in NOT_STARTED:
                    logs = podman("logs", "--tail", "25", container(svc), check=False)
                    print(f"--- {svc} (last lines)\n{logs}", flush=True)
            rec = {}
        finally:
            with stage("down"):
                down(proj)
    if not rec:
        return 1
    say(f"passed in {time.monotonic() - STARTED:.0f} s; the record:")
    print(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
