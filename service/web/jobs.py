"""GET /jobs and GET /jobs/<name>: every job's time, what made progress and what was lost (README: Goodput)."""
from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, jsonify, request

from .. import jobs
from ..errors import NotFound
from .common import ext

bp = Blueprint("jobs", __name__)


@bp.get("/jobs")
def list_jobs() -> Any:
    """Jobs seen within 30 days, live ones first, then by name, a page at a time."""
    items, nxt = jobs.page(ext().redis, jobs.Query.from_args(request.args), time.time())
    return jsonify(jobs.JobsPage(items=items, next=nxt).as_dict())


@bp.get("/jobs/<name>")
def get_job(name: str) -> Any:
    """One job, with its incidents."""
    job = jobs.one(ext().redis, name, time.time())
    if job is None:
        raise NotFound(f"no job named {name[:140]!r} was seen in the last 30 days")
    return jsonify(job.as_dict())
