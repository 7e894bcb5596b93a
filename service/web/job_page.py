"""The job's time on its page (/targets/job/<name>): a bar by kind, its goodput, its incidents (README: Goodput)."""
from __future__ import annotations

from typing import Any

from .. import jobs

# The bar's width in its SVG's units, and its kinds in order (the page's CSS colours each: .gp-KIND).
WIDTH = 1000
KINDS = (("productive", "productive"), ("stall", "stalled"), ("recompute", "recomputed"), ("down", "down"),
         ("other", "other"))
WORDS = {
    "productive": "steps above the job's highest",
    "stall": "no step change for longer than the stall threshold",
    "recompute": "steps again, after a rollback or a resume from an older checkpoint",
    "down": "no process: from the last heartbeat of one that ended without close() to the next one's first",
    "other": "before the first step, or not yet reported (the next heartbeat says)",
}


def job_time(r: Any, name: str, now: float) -> dict[str, Any] | None:
    """The job's figures for its page, or None when the service has none for it (no heartbeat in 30 days)."""
    job = jobs.one(r, name, now)
    if job is None:
        return None
    d = job.as_dict()
    lost = d["lost_s"]
    wall = d["wall_s"]
    seconds = {"productive": d["productive_s"], "stall": lost["stall"], "recompute": lost["recompute"],
               "down": lost["down"]}
    seconds["other"] = max(0.0, wall - sum(seconds.values()))
    segments, x = [], 0.0
    for kind, word in KINDS:
        share = seconds[kind] / wall if wall > 0 else 0.0
        width = WIDTH * share
        segments.append({"kind": kind, "word": word, "seconds": seconds[kind], "share": share, "x": round(x, 2),
                         "width": round(width, 2), "about": WORDS[kind]})
        x += width
    return {"job": d, "segments": segments, "wall": wall, "incidents": d["incidents"]}
