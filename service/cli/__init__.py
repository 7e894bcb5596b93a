"""The `trainmedic` command: serve, agent, check, send, history."""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, NoReturn, Sequence

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


class CliError(Exception):
    """A one-line error for the user; the command exits 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, no usage dump: the contract wants a one-line human error.
        sys.stderr.write(f"trainmedic: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="trainmedic", description="Auto-remediation for ML training clusters.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("serve", help="run the service (gunicorn), an embedded Redis and a local agent")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=9095)
    s.add_argument("--workers", type=int, default=4)
    s.add_argument("--redis-url")
    s.add_argument("--playbooks")
    s.add_argument("--data-dir", default=".trainmedic")
    s.add_argument("--no-agent", action="store_true", help="do not run a node agent for this host")
    s.add_argument("--allow-root", action="append", default=[], metavar="PATH",
                   help="folder the local agent may clean (repeatable)")
    s.add_argument("--dry-run", action="store_true", help="decide and record, dispatch nothing")

    a = sub.add_parser("agent", help="run the node agent for one GPU host")
    a.add_argument("--node", required=True)
    a.add_argument("--redis-url")
    a.add_argument("--allow-root", action="append", default=[], metavar="PATH")
    a.add_argument("--dry-run", action="store_true")

    c = sub.add_parser("check", help="validate playbook files")
    c.add_argument("paths", nargs="*")

    se = sub.add_parser("send", help="send an in-loop command to a training job")
    se.add_argument("--job", required=True)
    se.add_argument("--redis-url")
    se.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                    help="wait up to SECONDS for the job's ack and print the record")
    se.add_argument("action")
    se.add_argument("params", nargs="*", metavar="KEY=VALUE")

    h = sub.add_parser("history", help="show remediation records")
    h.add_argument("--url", default=os.environ.get("TRAINMEDIC_URL", "http://127.0.0.1:9095"))
    h.add_argument("--limit", type=int, default=20)
    h.add_argument("--follow", action="store_true")
    h.add_argument("--json", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("serve", "agent"):
        # Long-running commands log as JSON lines (service/logs.py); the others print for people.
        from trainmedic.client.logs import setup

        setup()
    try:
        return {"serve": cmd_serve, "agent": cmd_agent, "check": cmd_check, "send": cmd_send,
                "history": cmd_history}[args.command](args)
    except KeyboardInterrupt:
        return 130
    except CliError as exc:
        sys.stderr.write(f"trainmedic: {exc}\n")
        return 1


# -- check
def cmd_check(args: argparse.Namespace) -> int:
    from trainmedic.service.rules.playbooks import SHIPPED, check, files_of

    paths = args.paths or [os.environ.get("TRAINMEDIC_PLAYBOOKS") or str(SHIPPED)]
    playbooks, problems = check(paths)
    if not problems and not files_of(paths):
        problems = [f"{', '.join(paths)}:0: no playbook files (*.yaml) found"]
    for line in problems:
        print(line)
    if problems:
        return 1
    files = len(files_of(paths))
    print(f"ok: {len(playbooks)} playbook{'s' * (len(playbooks) != 1)} in {files} file{'s' * (files != 1)}")
    return 0


# -- shared helpers
def _redis(url: str | None) -> Any:
    from trainmedic.client.wire.redis import connect
    import redis

    try:
        r = connect(url)
        r.ping()
        return r
    except ValueError as exc:
        raise CliError(str(exc)) from None
    except redis.RedisError as exc:
        raise CliError(f"cannot reach Redis at {url or os.environ.get('TRAINMEDIC_REDIS_URL')}: {exc}") from None


def _load_playbooks(path: str) -> list:
    from trainmedic.service.rules.playbooks import PlaybookError, load

    try:
        return load([path])
    except PlaybookError as exc:
        raise CliError(f"invalid playbooks: {exc}") from None


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- serve
def cmd_serve(args: argparse.Namespace) -> int:
    from trainmedic.service.config import _token
    from trainmedic.service.embedded_redis import EmbeddedRedis
    from trainmedic.service.rules.playbooks import SHIPPED

    try:
        token = _token()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not token and not _loopback(args.host):
        raise CliError(f"refusing to listen on {args.host} without a token: set TRAINMEDIC_WEBHOOK_TOKEN "
                       "or TRAINMEDIC_WEBHOOK_TOKEN_FILE, or use --host 127.0.0.1")
    if args.workers < 1:
        raise CliError("--workers must be at least 1")
    playbooks = args.playbooks or os.environ.get("TRAINMEDIC_PLAYBOOKS") or str(SHIPPED)
    _load_playbooks(playbooks)
    data = Path(args.data_dir)
    url = args.redis_url or os.environ.get("TRAINMEDIC_REDIS_URL")
    embedded = None
    if url:
        _redis(url).close()
    else:
        try:
            embedded = EmbeddedRedis(data / "redis").start()
        except (OSError, RuntimeError) as exc:
            raise CliError(f"cannot start the embedded Redis: {exc}") from None
        url = embedded.url
    env = dict(os.environ, TRAINMEDIC_REDIS_URL=url, TRAINMEDIC_PLAYBOOKS=str(Path(playbooks).resolve()),
               TRAINMEDIC_BIND=f"{args.host}:{args.port}", TRAINMEDIC_WORKERS=str(args.workers),
               PROMETHEUS_MULTIPROC_DIR=str((data / "metrics").resolve()))
    if args.dry_run:
        env["TRAINMEDIC_DRY_RUN"] = "1"
    conf = Path(__file__).resolve().parent.parent / "gunicorn.conf.py"
    procs: list[subprocess.Popen] = [
        subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", str(conf)], env=env)]
    if not args.no_agent:
        cmd = [sys.executable, "-m", "trainmedic.service.cli", "agent", "--node", _node_name()]
        for root in args.allow_root:
            cmd += ["--allow-root", root]
        if args.dry_run:
            cmd.append("--dry-run")
        procs.append(subprocess.Popen(cmd, env=env))
    print(f"trainmedic: serving on http://{args.host}:{args.port} (Redis {url}"
          f"{', embedded, data in ' + str(data / 'redis') if embedded else ''}"
          f"{', local agent for ' + _node_name() if not args.no_agent else ''})", flush=True)
    print(RECEIVER_SNIPPET.format(host=args.host if args.host not in ("0.0.0.0", "::") else socket.getfqdn(),
                                  port=args.port, auth=AUTH_SNIPPET if token else ""), flush=True)
    return _supervise(procs, embedded)


def _node_name() -> str:
    from trainmedic.client.wire.keys import TARGET_NAME_RE

    name = socket.gethostname().split(".")[0]
    return name if TARGET_NAME_RE.match(name) else "localhost"


def _supervise(procs: list[subprocess.Popen], embedded: Any) -> int:
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = 0
    try:
        while not stopping:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                sys.stderr.write(f"trainmedic: {' '.join(dead[0].args[2:4])} exited with code "
                                 f"{dead[0].returncode}; stopping\n")
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


# -- agent
def cmd_agent(args: argparse.Namespace) -> int:
    from trainmedic.client.wire.keys import TARGET_NAME_RE
    from trainmedic.client.wire.redis import redis_url

    if not TARGET_NAME_RE.match(args.node):
        raise CliError("--node must match [A-Za-z0-9_.:@-]{1,128}")
    try:
        url = redis_url(args.redis_url)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    from trainmedic.client.agent import run_agent

    try:
        return run_agent(args.node, url, [Path(p) for p in args.allow_root],
                         dry_run=args.dry_run or os.environ.get("TRAINMEDIC_DRY_RUN") == "1")
    except ValueError as exc:
        raise CliError(str(exc)) from None


# -- send
def _value(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        return text


def cmd_send(args: argparse.Namespace) -> int:
    import re

    from trainmedic.client.wire.actions import CATALOGUE, ParamError
    from trainmedic.client.wire.keys import TARGET_NAME_RE, Target

    from trainmedic.service.rules import alerts
    from trainmedic.service.decide import dispatch
    from trainmedic.service import history
    from trainmedic.service.rules.playbooks import Playbook, Step
    from trainmedic.service.rules.targets import Resolution

    if not TARGET_NAME_RE.match(args.job):
        raise CliError("--job must match [A-Za-z0-9_.:@-]{1,128}")
    if not re.match(r"^[a-z][a-z0-9_]{0,63}$", args.action):
        raise CliError(f"action {args.action!r} is not an action name")
    params: dict[str, Any] = {}
    for item in args.params:
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise CliError(f"parameter {item!r} must be KEY=VALUE")
        params[key] = _value(val)
    spec = CATALOGUE.get(args.action)
    if spec is not None:
        if spec.kind != "job":
            raise CliError(f"{args.action} runs on a node, not in a training job")
        try:
            spec.parse(params)
        except ParamError as exc:
            raise CliError(str(exc)) from None
    r = _redis(args.redis_url)
    target = Target("job", args.job)
    pb = Playbook(name="manual", matchers=(), target="job", actions=(Step(args.action, params),))
    alert = alerts.parse_alert({"status": "firing", "startsAt": _now(),
                                "labels": {"alertname": "manual", "job_name": args.job}}, "send")
    d = dispatch.Decision(pb, "manual", alert, Resolution(target, {}))
    outcome = dispatch.Dispatcher(r, dispatch.Settings()).execute([d])[0]
    print(f"sent {args.action} to job {args.job}: remediation {outcome.record_id} ({outcome.status})")
    if args.wait > 0:
        deadline = time.monotonic() + args.wait
        rec = history.get(r, outcome.record_id)
        while rec and rec["status"] == "dispatched" and time.monotonic() < deadline:
            time.sleep(0.1)
            rec = history.get(r, outcome.record_id)
        print(json.dumps(rec, indent=2))
        return 0 if rec and rec["status"] == "applied" else 1
    return 0


def _now() -> str:
    from trainmedic.client.wire.protocol import rfc3339

    return rfc3339()


# -- history
def _get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            msg = json.loads(exc.read()).get("error")
        except Exception:
            msg = exc.reason
        raise CliError(f"{url}: HTTP {exc.code}: {msg}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise CliError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None


def _line(rec: dict) -> str:
    t = rec["target"]
    acts = ", ".join(f"{a['action']}={a['status']}" for a in rec["actions"]) or "-"
    reason = f" ({rec['reason']})" if rec.get("reason") else ""
    return (f"{rec['created_at'][:19].replace('T', ' ')}  {rec['status'] + reason:<28} {rec['playbook']:<22} "
            f"{t['kind']}:{t.get('name') or '?':<20} {rec['alert'].get('alertname', ''):<24} {acts}")


def cmd_history(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= 500:
        raise CliError("--limit must be from 1 to 500")
    base = args.url.rstrip("/") + "/history"
    page = _get_json(f"{base}?{urllib.parse.urlencode({'limit': args.limit})}")
    items = list(reversed(page["items"]))  # oldest first, like a log
    shown = {r["id"]: r["status"] for r in items}
    for rec in items:
        print(json.dumps(rec) if args.json else _line(rec), flush=True)
    while args.follow:
        time.sleep(2)
        for rec in reversed(_get_json(f"{base}?limit=100")["items"]):
            if shown.get(rec["id"]) != rec["status"]:
                shown[rec["id"]] = rec["status"]
                print(json.dumps(rec) if args.json else _line(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
