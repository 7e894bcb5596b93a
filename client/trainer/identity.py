"""The training job's name: what its alerts' job_name label says, from the arguments or the scheduler."""
from __future__ import annotations

from collections.abc import Mapping

from ..wire.keys import TARGET_NAME_RE


def job_name(job: str | None, environ: Mapping[str, str]) -> str:
    """`job`, else TRAINMEDIC_JOB, else SLURM_JOB_NAME when it is a valid name, else slurm-<SLURM_JOB_ID>."""
    for name in (job, environ.get("TRAINMEDIC_JOB")):
        if name:
            if not TARGET_NAME_RE.match(name):
                raise ValueError(f"the job name {name!r} must be 1 to 128 letters, digits or _.:@-")
            return name
    slurm = environ.get("SLURM_JOB_NAME") or ""
    if TARGET_NAME_RE.match(slurm):
        return slurm
    job_id = environ.get("SLURM_JOB_ID") or ""
    if job_id.isascii() and job_id.isdigit():
        return f"slurm-{job_id}"
    raise ValueError("no job name: pass job=, or set TRAINMEDIC_JOB (under Slurm, the job's name is used); it "
                     "must equal the job_name label of the job's alerts")
