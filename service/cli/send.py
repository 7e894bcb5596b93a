"""`trainmedic send --job NAME ACTION [KEY=VALUE]... [--yes]`: one command through the service's POST /commands."""
from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import time
from typing import Any

from ...client.wire.actions import CATALOGUE, ParamError
from ...client.wire.status import RecordStatus
from ...client.wire.keys import TARGET_NAME_RE

from ..settings import ServiceSettings
from .common import CliError, UsageError, api, call, need, operator_token
from .show import lines

_INT = re.compile(r"^[+-]?[0-9]+\Z")
_FLOAT = re.compile(r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")
_WORDS = {"true": True, "false": False, "null": None}
# Statuses after which a record changes no more (pending_approval and dispatched still may).
FINAL = tuple(s for s in RecordStatus if s.final)


def add(sub: Any) -> None:
    s = sub.add_parser("send", help="send one in-loop command to a training job through the service")
    s.add_argument("--job", required=True, help="the job's name (its job_name label)")
    s.add_argument("--url", help="the service (default: TRAINMEDIC_URL, else http://127.0.0.1:9095)")
    s.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to SECONDS for the job to apply it, and print the record")
    s.add_argument("--yes", action="store_true", help="send it even though it raises the learning rate")
    s.add_argument("--json", action="store_true", help="print the record as the API gives it")
    s.add_argument("action")
    s.add_argument("params", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(run=run)


def value(text: str) -> Any:
    """A KEY=VALUE value: a number, true/false/null, a JSON list or object, else the text itself."""
    t = text.strip()
    if t in _WORDS:
        return _WORDS[t]
    if _INT.match(t):
        return int(t)
    if _FLOAT.match(t):
        f = float(t)
        if not math.isfinite(f):
            raise UsageError(f"{text!r} is not a finite number")
        return f
    if t[:1] in ("[", "{"):
        try:
            return json.loads(t, parse_constant=_no_constant)
        except ValueError as exc:
            raise UsageError(f"{text!r} is not valid JSON ({exc})") from None
    if t.lower() in ("nan", "inf", "+inf", "-inf", "infinity", "-infinity"):
        raise UsageError(f"{text!r} is not a finite number")
    return text


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def parse(args: argparse.Namespace) -> dict:
    """The validated params, or UsageError (exit 2) naming what is wrong, exactly as `check` would."""
    if not TARGET_NAME_RE.match(args.job):
        raise UsageError("--job must be 1 to 128 letters, digits or _.:@-")
    spec = CATALOGUE.get(args.action)
    known = sorted(name for name, s in CATALOGUE.items() if s.kind == "job")  # what a job can be sent
    if spec is None:
        close = difflib.get_close_matches(args.action, known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"unknown action {args.action!r}: {hint}known for a job: {', '.join(known)}")
    if spec.kind != "job":
        raise UsageError(f"{args.action} runs on a node agent, not in a training job (known for a job: "
                         f"{', '.join(known)})")
    params: dict[str, Any] = {}
    for item in args.params:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise UsageError(f"parameter {item!r} must be KEY=VALUE")
        params[key] = value(raw)
    try:
        spec.parse(params)
    except ParamError as exc:
        msg = str(exc)
        raise UsageError(msg if args.action in msg else f"{args.action}: {msg}") from None
    factor = params.get("factor")
    if args.action == "scale_lr" and isinstance(factor, (int, float)) and factor > 1 and not args.yes:
        # A raised learning rate can make a run diverge: say so, and send it only when asked twice.
        raise UsageError(f"scale_lr factor={factor:g} raises the learning rate {factor:g}-fold; add --yes to send it")
    return params


def run(args: argparse.Namespace, settings: ServiceSettings) -> int:
    need("send", "requests")
    params = parse(args)
    if args.wait < 0 or not math.isfinite(args.wait):
        raise UsageError("--wait must be a number of seconds, 0 or more")
    http = api(settings, args.url, operator_token(settings), writes=True)
    rec = call(http.post, "/commands", {"target": f"job:{args.job}", "action": args.action, "params": params})
    if not args.json:
        note = f" ({rec['reason'].replace('_', ' ')})" if rec.get("reason") else ""
        print(f"sent {args.action} to job {args.job}: remediation {rec['id']} ({rec['status']}){note}", flush=True)
    if args.wait > 0:
        deadline = time.monotonic() + args.wait
        while rec["status"] not in FINAL and time.monotonic() < deadline:
            time.sleep(0.1)
            rec = call(http.get, f"/remediations/{rec['id']}")
    if args.json or args.wait > 0:  # the record, as `trainmedic show` prints it
        print(json.dumps(rec, indent=2) if args.json else "\n".join(lines(rec)), flush=True)
    if args.wait <= 0 or rec["status"] == RecordStatus.APPLIED:
        return 0
    raise CliError(_why_not(rec, args, http, settings))


def _why_not(rec: dict, args: argparse.Namespace, http: Any, settings: ServiceSettings) -> str:
    """One line: why the command did not end applied."""
    action = rec["actions"][0] if rec.get("actions") else {}
    if rec["status"] in FINAL:
        detail = (action.get("result") or {}).get("error") or action.get("reason") or rec.get("reason") or ""
        return f"{args.action} ended {rec['status']}" + (f": {str(detail).rstrip('.')}" if detail else "")
    live = any(t["kind"] == "job" and t["name"] == args.job for t in call(http.get, "/targets")["targets"])
    if not live:
        return (f"{args.action} was not applied within {args.wait:g}s: no live target (no training process "
                f"of job {args.job} has sent a heartbeat in the last minute); it stays queued until it expires")
    return (f"{args.action} was not applied within {args.wait:g}s: job {args.job} is live but has not applied it "
            f"yet (action {action.get('status', 'pending')}); it stays queued until it expires")
