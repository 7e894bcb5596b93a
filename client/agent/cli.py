"""`trainmedic agent --node NAME`: the node agent for one GPU host (needs only the [agent] extra). It lives
with the agent, in the client package that GPU nodes install; the `trainmedic` command routes to it."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..settings import Settings
from ..wire.keys import TARGET_NAME_RE

from ..cli import CliError, UsageError, need


def add(sub: Any) -> None:
    a = sub.add_parser("agent", help="run the node agent for one GPU host")
    a.add_argument("--node", required=True, help="this node's name, as the alerts' node label says it")
    a.add_argument("--redis-url", help="default: TRAINMEDIC_REDIS_URL")
    a.add_argument("--allow-root", action="append", default=[], metavar="PATH",
                   help="folder disk_cleanup may delete in (repeatable)")
    a.add_argument("--state-dir", help="where the agent keeps what it applied (default /var/lib/trainmedic "
                                       "when writable, else $XDG_STATE_HOME/trainmedic)")
    a.add_argument("--scheduler", choices=("slurm", "none"), default=None,
                   help="drain and resume through this scheduler (default: slurm when `scontrol ping` finds a "
                        "controller UP)")
    a.add_argument("--slurm-node", help="the node's Slurm name when it differs from --node")
    a.add_argument("--dry-run", action="store_true", help="report what would be done, change nothing")
    a.add_argument("--insecure-unsigned", action="store_true",
                   help="run without TRAINMEDIC_VERIFY_KEY, applying unsigned commands (never in production)")
    # The agent runs on GPU nodes: it reads the client's settings only, so no service setting can stop it.
    a.set_defaults(run=run, reads=Settings)


def state_dir(given: str | None) -> Path:
    """--state-dir, else /var/lib/trainmedic when writable, else $XDG_STATE_HOME/trainmedic."""
    if given:
        return Path(given)
    system = Path("/var/lib/trainmedic")
    if os.access(system if system.exists() else system.parent, os.W_OK):
        return system
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "trainmedic"


def run(args: argparse.Namespace, settings: Settings) -> int:
    need("agent", "cryptography")
    from ..wire.redis import redis_url
    from ..wire.signing import SigningError, verifier_from

    if not TARGET_NAME_RE.match(args.node):
        raise UsageError("--node must be 1 to 128 letters, digits or _.:@-")
    if args.slurm_node is not None and not TARGET_NAME_RE.match(args.slurm_node):
        raise UsageError("--slurm-node must be 1 to 128 letters, digits or _.:@-")
    try:
        url = redis_url(args.redis_url or settings.redis_url)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        verifier = verifier_from(settings.verify_keys, settings.signing_key)
    except SigningError as exc:
        raise CliError(str(exc)) from None
    if verifier is None and not args.insecure_unsigned:
        raise CliError("the agent needs TRAINMEDIC_VERIFY_KEY (or _FILE) to check commands' signatures; "
                       "`trainmedic serve` prints it (use --insecure-unsigned only for a throwaway test)")
    from . import run_agent
    from .scheduler import choose

    scheduler = choose(args.scheduler)

    try:
        return run_agent(args.node, url, args.allow_root, dry_run=args.dry_run or settings.dry_run,
                         state_dir=state_dir(args.state_dir), verifier=verifier, scheduler=scheduler,
                         slurm_node=args.slurm_node or args.node)
    except ValueError as exc:
        raise CliError(str(exc)) from None
