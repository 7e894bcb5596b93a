"""Which scheduler the node agent drains and resumes through: Slurm when asked, or when its controller answers.

scontrol being installed says nothing about a controller: a login image or a laptop may carry the tools of a
cluster they are not part of. Without `--scheduler`, the agent asks `scontrol ping` once, at start (an argv
with a timeout, never a shell); only a controller that answers UP makes it use Slurm. Otherwise drain_node,
resume_node and requeue_jobs stay unregistered, so the service decides them `unsupported` (optional steps
`skipped`), and the heartbeat says why there is no scheduler (GET /targets shows it).
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from .slurm import first_line

PING_TIMEOUT_S = 10.0  # slurmctld answers a ping in milliseconds; scontrol without a config retries for a minute


@dataclass(frozen=True)
class Scheduler:
    """The agent's scheduler, `slurm` or `none`, and why it has none (None when it has one)."""

    name: str
    reason: str | None = None


NONE = Scheduler("none", "--scheduler none")


def choose(asked: str | None, scontrol: str = "scontrol", timeout: float = PING_TIMEOUT_S) -> Scheduler:
    """--scheduler when given; else Slurm only when scontrol is on PATH and `scontrol ping` says a controller is UP."""
    if asked == "slurm":
        return Scheduler("slurm")
    if asked == "none":
        return NONE
    path = shutil.which(scontrol)
    if path is None:
        return Scheduler("none", f"{scontrol} is not on PATH")
    try:
        proc = subprocess.run([path, "ping"], capture_output=True, text=True, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Scheduler("none", f"{scontrol} ping did not answer within {timeout:g} seconds")
    except OSError as exc:
        return Scheduler("none", f"{scontrol} ping could not be run ({exc.strerror or exc})")
    if proc.returncode == 0 and any(line.rstrip().endswith(" is UP") for line in proc.stdout.splitlines()):
        return Scheduler("slurm")
    said = first_line(proc.stdout) or first_line(proc.stderr) or f"exit status {proc.returncode}"
    return Scheduler("none", f"{scontrol} ping: {said}")
