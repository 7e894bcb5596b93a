"""`trainmedic serve`: the service under gunicorn, an embedded Redis, a local node agent; Ctrl-C stops all."""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ...client.wire.keys import TARGET_NAME_RE

from ..hosts import loopback
from ..settings import ServiceSettings
from .common import CliError, UsageError, need

RECEIVER_SNIPPET = """\
# Alertmanager: paste under `receivers:` and route the training/GPU alerts to it.
receivers:
  - name: trainmedic
    webhook_configs:
      - url: http://{host}:{port}/webhook
        send_resolved: true
        max_alerts: 0{auth}
"""
AUTH_SNIPPET = """
        http_config:
          authorization:
            type: Bearer
            credentials_file: /etc/alertmanager/trainmedic.token"""


def add(sub: Any) -> None:
    s = sub.add_parser("serve", help="run the service (gunicorn), an embedded Redis and a local node agent")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=9095)
    s.add_argument("--workers", type=int, default=4)
    s.add_argument("--redis-url", help="use this Redis instead of starting one")
    s.add_argument("--redis-port", type=int, default=None, help="port of the embedded Redis (default 6390)")
    s.add_argument("--playbooks", help="playbook file or folder (default: TRAINMEDIC_PLAYBOOKS, else the shipped ones)")
    s.add_argument("--data-dir", default=".trainmedic", help="where the embedded Redis and generated secrets live")
    s.add_argument("--no-agent", action="store_true", help="do not run a node agent for this host")
    s.add_argument("--allow-root", action="append", default=[], metavar="PATH",
                   help="folder the local agent may clean (repeatable)")
    s.add_argument("--dry-run", action="store_true", help="decide and record, dispatch nothing")
    s.set_defaults(run=run)


def node_name() -> str:
    """This host's short name when it is a valid target name, else localhost."""
    name = socket.gethostname().split(".")[0]
    return name if TARGET_NAME_RE.match(name) else "localhost"


def _check_args(args: argparse.Namespace, settings: ServiceSettings) -> None:
    if args.workers < 1:
        raise UsageError("--workers must be at least 1")
    for flag, port in (("--port", args.port), ("--redis-port", args.redis_port)):
        if port is not None and not 1 <= port <= 65535:
            raise UsageError(f"{flag} must be from 1 to 65535")
    if not settings.webhook_token and not loopback(args.host):
        raise CliError(f"refusing to listen on {args.host} without a webhook token: set TRAINMEDIC_WEBHOOK_TOKEN "
                       "or TRAINMEDIC_WEBHOOK_TOKEN_FILE, or use --host 127.0.0.1")
    if not loopback(args.host) and not settings.allowed_hosts:
        raise CliError(f"listening on {args.host} needs TRAINMEDIC_ALLOWED_HOSTS: the host names people and "
                       "Alertmanager use to reach the service (comma-separated)")


def _secrets(data: Path, settings: ServiceSettings) -> tuple[ServiceSettings, dict[str, str]]:
    """The operator token and signing key: from the environment, else made once into the data dir (0600)."""
    from ...client.wire.signing import SigningError, Signer
    from ..embedded_redis import secret_file

    files: dict[str, str] = {}
    if not settings.operator_token:
        path = data / "operator.token"
        settings = settings.replace(operator_token=secret_file(path, lambda: secrets.token_urlsafe(32)))
        files["TRAINMEDIC_OPERATOR_TOKEN_FILE"] = str(path.resolve())
    if not settings.signing_key:
        path = data / "signing.key"
        settings = settings.replace(signing_key=secret_file(path, lambda: secrets.token_urlsafe(48)))
        files["TRAINMEDIC_SIGNING_KEY_FILE"] = str(path.resolve())
    try:
        Signer.from_secret(settings.signing_key or "")
    except SigningError as exc:
        raise CliError(str(exc)) from None
    return settings, files


def _port_free(host: str, port: int) -> None:
    from ..embedded_redis import port_in_use

    if port_in_use(port, "0.0.0.0" if host in ("0.0.0.0", "::") else host):
        raise CliError(f"port {port} on {host} is in use: stop what listens there, or choose another with --port")


def run(args: argparse.Namespace, settings: ServiceSettings) -> int:
    need("serve", "flask", "gunicorn", "yaml", "prometheus_client", "cryptography")
    from ...client.wire.signing import Signer
    from ..embedded_redis import DEFAULT_PORT, EmbeddedRedis, secret_file
    from ..rules.playbooks import SHIPPED, PlaybookError, load, missing_alertmanager

    _check_args(args, settings)
    named = _people(settings)
    playbooks = args.playbooks or settings.playbooks or str(SHIPPED)
    try:
        problem = missing_alertmanager(load([playbooks]), settings.alertmanager_urls)
    except PlaybookError as exc:
        raise CliError(f"invalid playbooks: {exc}") from None
    if problem:
        raise CliError(problem)
    data = Path(args.data_dir)
    data.mkdir(parents=True, exist_ok=True, mode=0o700)
    settings, secret_env = _secrets(data, settings)
    verify_key = Signer.from_secret(settings.signing_key or "").public
    _port_free(args.host, args.port)
    url = args.redis_url or settings.redis_url
    embedded = None
    if url:
        _ping(url)
    else:
        password = secret_file(data / "redis" / "password", lambda: secrets.token_urlsafe(24))
        try:
            embedded = EmbeddedRedis(data / "redis", port=args.redis_port or DEFAULT_PORT, password=password,
                                     fsync=settings.redis_fsync).start()
        except (OSError, RuntimeError) as exc:
            raise CliError(f"cannot start the embedded Redis: {exc}") from None
        url = embedded.url
    env = {**os.environ, **secret_env, "TRAINMEDIC_REDIS_URL": url,
           "TRAINMEDIC_PLAYBOOKS": str(Path(playbooks).resolve()), "TRAINMEDIC_BIND": f"{args.host}:{args.port}",
           "TRAINMEDIC_WORKERS": str(args.workers), "TRAINMEDIC_DATA_DIR": str(data.resolve()),
           "PROMETHEUS_MULTIPROC_DIR": str((data / "metrics").resolve())}
    if args.dry_run:
        env["TRAINMEDIC_DRY_RUN"] = "1"
    conf = Path(__file__).resolve().parent.parent / "gunicorn.conf.py"
    # Ctrl-C / SIGTERM from here on stops the children: one that came before supervise() began (right after the
    # announcement, say) would otherwise end this process and leave gunicorn running.
    stop = _catch_stop()
    procs = [subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", str(conf)], env=env)]
    node = node_name()
    if not args.no_agent:
        procs.append(_agent(args, node, env, verify_key, data))
    _announce(args, settings, url, embedded is not None, data, verify_key, node,
              token_made="TRAINMEDIC_OPERATOR_TOKEN_FILE" in secret_env, named=named)
    return supervise(procs, embedded, stop)


def _people(settings: ServiceSettings) -> int:
    """Check the tokens files before anything starts (a bad line is one sentence naming it); how many people."""
    from ..people import People

    return len(People.from_settings(settings).names)


def add_person_lines(settings: ServiceSettings, data: Path, named: int) -> str:
    """The banner's two lines on adding a person: their own operator token, recorded as operator:NAME."""
    from ..people import MAKE_TOKEN

    path = settings.operator_tokens_file
    target = shlex.quote(str(Path(path).resolve()) if path else str((data / "operators.tokens").resolve()))
    then = (f"{named} named so far), then restart" if path else
            f"), then set TRAINMEDIC_OPERATOR_TOKENS_FILE={target} and restart")
    return (f"# Add a person with a token of their own (recorded as operator:NAME{'; ' if path else ''}{then}:\n"
            f"(umask 077; echo \"alice $({MAKE_TOKEN})\" >> {target})")


def _ping(url: str) -> None:
    import redis

    from ...client.wire.redis import connect

    try:
        r = connect(url)
        r.ping()
        r.close()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    except redis.RedisError as exc:
        raise CliError(f"cannot reach Redis at {masked(url)}: {exc}") from None


def masked(url: str) -> str:
    """A Redis URL with its password shown as ***: what goes into output and logs."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if not parts.password:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{parts.username or ''}:***@{host}").geturl()


def _agent(args: argparse.Namespace, node: str, env: dict[str, str], verify_key: str, data: Path) -> subprocess.Popen:
    """The local node agent: it gets the public key only, never the signing secret."""
    agent_env = {k: v for k, v in env.items() if not k.startswith("TRAINMEDIC_SIGNING_KEY")}
    agent_env["TRAINMEDIC_VERIFY_KEY"] = verify_key
    agent_env.pop("TRAINMEDIC_VERIFY_KEY_FILE", None)
    cmd = [sys.executable, "-m", "trainmedic.service.cli", "agent", "--node", node,
           "--state-dir", str((data / "agent").resolve())]
    for root in args.allow_root:
        cmd += ["--allow-root", root]
    if args.dry_run:
        cmd.append("--dry-run")
    return subprocess.Popen(cmd, env=agent_env)


def _announce(args: argparse.Namespace, settings: ServiceSettings, url: str, embedded: bool, data: Path,
              verify_key: str, node: str, token_made: bool = True, named: int = 0) -> None:
    shown = args.host if args.host not in ("0.0.0.0", "::") else socket.getfqdn()
    where = f", embedded, data in {data / 'redis'}" if embedded else ""
    agent = f", local agent for node {node}" if not args.no_agent else ""
    print(f"trainmedic: serving on http://{shown}:{args.port} (Redis{where}{agent})", flush=True)
    # Secrets it was given (a Redis user's password, the operator token) are never printed: output ends up in
    # logs. What it made itself into the data dir (the embedded Redis's password, a token) it prints, once per start.
    redis_line = (f"export TRAINMEDIC_REDIS_URL='{url}'" if embedded else
                  f"# Redis at {masked(url)}: give trainers and node agents their own Redis users "
                  "(config/redis/users.acl), not this one")
    token_line = (f"export TRAINMEDIC_OPERATOR_TOKEN='{settings.operator_token}'" if token_made else
                  "# (the TRAINMEDIC_OPERATOR_TOKEN this service was given)")
    reads = ("# Reads need TRAINMEDIC_READ_TOKEN or an operator token (the pages ask once, at /login)"
             if settings.read_token else
             "# Reads (history, pages) are open to whoever reaches this port; TRAINMEDIC_READ_TOKEN closes them")
    print("\n# Trainers and node agents: set these (the URL stays the same across restarts)\n"
          f"{redis_line}\nexport TRAINMEDIC_VERIFY_KEY='{verify_key}'\n"
          "# People's writes (trainmedic send, approve, reject) need the operator token:\n"
          f"{token_line}\n{add_person_lines(settings, data, named)}\n{reads}\n", flush=True)
    print(RECEIVER_SNIPPET.format(host=shown, port=args.port, auth=AUTH_SNIPPET if settings.webhook_token else ""),
          flush=True)


def _catch_stop() -> threading.Event:
    """An event that Ctrl-C / SIGTERM sets (instead of ending this process)."""
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def supervise(procs: list[subprocess.Popen], embedded: Any, stop: threading.Event) -> int:
    """Wait until `stop` is set (Ctrl-C / SIGTERM) or a child dies; then stop every child and the embedded Redis."""
    code = 0
    try:
        while not stop.is_set():
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                what = "gunicorn" if dead[0] is procs[0] else "the node agent"
                sys.stderr.write(f"trainmedic: {what} exited with code {dead[0].returncode}; stopping\n")
                code = 1
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        if embedded is not None:
            embedded.stop()
    return code
