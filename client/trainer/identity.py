"""Which job a training process is: the name its alerts carry as `job_name`."""
from __future__ import annotations

import re
from collections.abc import Mapping

from ..wire.keys import TARGET_NAME_RE

_DIGITS = re.compile(r"^[0-9]{1,20}\Z")


def job_name(job: str | None, environ: Mapping[str, str]) -> str:
    """`job`, else TRAINMEDIC_JOB, else SLURM_JOB_NAME when it is a valid target name, else slurm-<SLURM_JOB_ID>.

    A name given explicitly (`job` or TRAINMEDIC_JOB) must be valid: it is never silently replaced by another.
    Raises ValueError with one sentence when no name can be found.
    """
    for given, where in ((job, "job="), (environ.get("TRAINMEDIC_JOB"), "TRAINMEDIC_JOB")):
        if given:
            if not isinstance(given, str) or not TARGET_NAME_RE.match(given):
                raise ValueError(f"The job name {str(given)[:140]!r} from {where} is not valid: use 1 to 128 letters, "
                                 "digits and _.:@- (not only dots), the same as the job_name label of its alerts.")
            return given
    slurm_name = environ.get("SLURM_JOB_NAME") or ""
    if TARGET_NAME_RE.match(slurm_name):
        return slurm_name
    slurm_id = environ.get("SLURM_JOB_ID") or ""
    if _DIGITS.match(slurm_id):
        return f"slurm-{slurm_id}"
    raise ValueError("No job name: pass job= to RemediationClient or set TRAINMEDIC_JOB (or run under Slurm) to "
                     "the job_name label of its alerts, 1 to 128 letters, digits and _.:@-.")


def node_name(environ: Mapping[str, str]) -> str | None:
    """The node this process runs on, as node agents and alerts name it: TRAINMEDIC_NODE, else Slurm's
    SLURMD_NODENAME, else the short host name (None when none of them is a valid target name)."""
    import socket

    for name in (environ.get("TRAINMEDIC_NODE"), environ.get("SLURMD_NODENAME"), socket.gethostname().split(".")[0]):
        if name and TARGET_NAME_RE.match(name):
            return name
    return None
