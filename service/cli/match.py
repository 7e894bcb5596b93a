"""`trainmedic match [FILE|-]`: what each alert of a webhook payload would match and do; no Redis, no service."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..settings import ServiceSettings
from .common import CliError, UsageError, need

# The webhook refuses a larger body (413), so a larger payload is not one trainmedic would ever decide.
MAX_PAYLOAD = 1024 * 1024


def add(sub: Any) -> None:
    m = sub.add_parser("match", help="show which playbook each alert of a webhook payload matches (dry, offline)")
    m.add_argument("file", nargs="?", default="-", metavar="FILE",
                   help="an Alertmanager webhook payload (JSON); - or none: standard input")
    m.add_argument("--playbooks", help="playbook files or a folder (default: TRAINMEDIC_PLAYBOOKS, else the "
                                       "shipped ones)")
    m.set_defaults(run=run)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def read_payload(file: str) -> Any:
    """The payload's JSON from a file or standard input, or UsageError in one sentence."""
    try:
        data = sys.stdin.buffer.read(MAX_PAYLOAD + 1) if file == "-" else Path(file).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {file}: {exc.strerror or exc}") from None
    where = "standard input" if file == "-" else file
    if len(data) > MAX_PAYLOAD:
        raise UsageError(f"{where} is larger than {MAX_PAYLOAD // 1024} KiB, which the webhook refuses")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise UsageError(f"{where} is not UTF-8 text") from None
    except RecursionError:
        raise UsageError(f"{where} is JSON nested too deeply") from None
    except ValueError as exc:
        raise UsageError(f"{where} is not valid JSON: {exc}") from None


def _step(st: Any) -> str:
    text = f"{st.action} {json.dumps(st.params, sort_keys=True)}"
    if st.optional:
        text += " (optional)"
    if st.when:
        text += f" when {st.when}"
    return text


def lines(group: Any, playbooks: list[Any]) -> list[str]:
    """For each alert: its name, status and labels, then each playbook it matches and what it would do."""
    from ..decide.plan import plan

    decisions = plan(group, playbooks)
    out = []
    for i, alert in enumerate(group.alerts):
        labels = " ".join(f"{k}={v}" for k, v in sorted(alert.labels.items()) if k != "alertname")
        out.append(f"alert {i + 1}: {alert.alertname} ({alert.status})" + (f" {labels}" if labels else ""))
        mine = [d for d in decisions if d.alert is alert]
        if not mine:
            out.append("  no playbook")
        for d in mine:
            pb = d.playbook
            if d.resolution.target is None:
                out.append(f"  {pb.name}: no target ({d.resolution.detail}): recorded as skipped, nothing sent")
                continue
            steps = ", ".join(map(_step, d.steps)) or "none"
            what = f"on_resolved: {steps}" if d.mode == "resolved" else steps
            notes = [n for n, on in (("held for approval", pb.approval and d.mode != "resolved"),
                                     ("dry run", pb.dry_run)) if on]
            out.append(f"  {pb.name}: {d.target.label}: {what}" + (f" ({', '.join(notes)})" if notes else ""))
    return out


def run(args: argparse.Namespace, settings: ServiceSettings) -> int:
    need("match", "yaml")
    from ..errors import BadRequest
    from ..rules.alerts import parse_group
    from ..rules.playbooks import SHIPPED, PlaybookError, load

    body = read_payload(args.file)
    try:
        group = parse_group(body)
    except BadRequest as exc:
        raise UsageError(f"not an Alertmanager webhook payload: {exc.message}") from None
    try:
        playbooks = load([args.playbooks or settings.playbooks or str(SHIPPED)])
    except PlaybookError as exc:
        raise CliError(f"invalid playbooks: {exc}") from None
    for line in lines(group, playbooks):
        print(line)
    return 0
