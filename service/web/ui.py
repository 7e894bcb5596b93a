"""The history page for people: filtered records, a per-target timeline, live targets (server-rendered)."""
from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import redis
from flask import Blueprint, current_app, render_template, request, url_for
from flask.templating import Environment
from markupsafe import Markup, escape

from ...client.wire import keys
from ...client.wire.status import Outcome, RecordStatus

from ..store import record as record_store

from .. import history, outcomes
from ..errors import BadRequest
from . import charts, folds, job_page, metric_chart
from .common import ext as _ext, live_targets

bp = Blueprint("ui", __name__, template_folder="templates")

# Icons are inline SVG drawn in the text's colour (class "f" parts filled): a font without a glyph for a symbol
# such as U+23F8 draws an empty box, and which fonts a browser has is not ours to choose.
_SHAPES = {
    "check": '<path d="M3 8.5l3.2 3.2L13 4.8"/>',
    "cross": '<path d="M4 4l8 8M12 4l-8 8"/>',
    "half": '<circle cx="8" cy="8" r="5.5"/><path class="f" d="M8 2.5a5.5 5.5 0 0 1 0 11z"/>',
    "arrow": '<path d="M2.5 8h10M9 4.5L12.5 8 9 11.5"/>',
    "dots": '<circle class="f" cx="3.5" cy="8" r="1.4"/><circle class="f" cx="8" cy="8" r="1.4"/>'
            '<circle class="f" cx="12.5" cy="8" r="1.4"/>',
    "pause": '<path d="M5.5 3.5v9M10.5 3.5v9"/>',
    "dashed": '<circle cx="8" cy="8" r="5.5" stroke-dasharray="2.2 2.1"/>',
    "dash": '<path d="M4 8h8"/>',
    "blocked": '<circle cx="8" cy="8" r="5.5"/><path d="M4.2 11.8l7.6-7.6"/>',
    "clock": '<circle cx="8" cy="8" r="5.5"/><path d="M8 5v3.3l2.2 1.4"/>',
    "warning": '<path d="M8 2.5l6 11H2zM8 6.8v3"/><circle class="f" cx="8" cy="11.6" r=".9"/>',
    "question": '<path d="M5.6 6.2a2.4 2.4 0 1 1 3.4 2.2c-.7.3-1 .8-1 1.5v.3"/>'
                '<circle class="f" cx="8" cy="12.4" r=".9"/>',
    "caret": '<path d="M6 3.5l4.5 4.5L6 12.5"/>',
    "ring": '<circle cx="8" cy="8" r="4.5"/>',
    "disc": '<circle class="f" cx="8" cy="8" r="5.5"/>',
}
ICONS = {"applied": "check", "partially_applied": "half", "failed": "cross", "dispatched": "arrow",
         "delivered": "arrow", "pending": "dots", "pending_approval": "pause", "dry_run": "dashed", "skipped": "dash",
         "unsupported": "blocked", "expired": "clock", "lost": "warning"}
OUTCOME_ICONS = {"pending": "dots", "effective": "check", "ineffective": "cross", "unknown": "question"}
_SVG = {name: Markup(f'<svg class="ico" viewBox="0 0 16 16" aria-hidden="true" focusable="false">{shape}</svg>')
        for name, shape in _SHAPES.items()}
FILTERS = history.FILTERS
TARGET_PAGE_RECORDS = 200
HTML = {"Content-Type": "text/html; charset=utf-8"}


class PageEnvironment(Environment):
    """Flask's Jinja environment, reading a dict's keys before its attributes: the pages show records, which are
    dicts, and Jinja's usual order raises and catches an AttributeError for every `rec.field` (a fifth of
    rendering GET /). A key named like a dict method (get, items) would hide the method; none of ours is."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute in obj:
            return obj[attribute]
        return super().getattr(obj, attribute)


def _page(template: str, **context: Any) -> bytes:
    """A rendered page as UTF-8. A lone surrogate that reached Redis some other way (a trainer's heartbeat, a
    record written by hand) becomes "?" instead of failing every later request for the page (500)."""
    return render_template(template, **context).encode("utf-8", "replace")


def _common(now: float) -> dict:
    return {"now": now, "reset_at": _reset_at(),
            "refresh_seconds": int(current_app.config.get("UI_REFRESH_SECONDS", 10))}


def _reset_at() -> str | None:
    """When Redis last came back without trainmedic's data (within the banner's day), else None."""
    try:
        return _ext().redis.get(keys.RESET_AT)
    except redis.RedisError:  # the page itself reports Redis down; the banner is not worth failing for
        return None


def _strip(ext: Any, now: float) -> list[dict]:
    """Per playbook, its outcomes over 30 days (the index page's effectiveness strip)."""
    stats = outcomes.summaries(ext.redis, [p.name for p in ext.playbooks], now)
    breakers = ext.dispatcher.breaker.state(ext.playbooks, now)
    rows = []
    for name, st in stats.items():
        shown = {k: st.counts[k] for k in (Outcome.EFFECTIVE, Outcome.INEFFECTIVE, Outcome.PENDING, Outcome.UNKNOWN)}
        rows.append({"name": name, "counts": shown, "total": sum(shown.values()), "median": st.median,
                     "breaker": breakers.get(name)})
    return rows


@bp.get("/")
def index() -> Any:
    """The history: live targets, a filter form, records newest first, paged by the history cursor."""
    ext, now = _ext(), time.time()
    f = {k: request.args.get(k) or None for k in FILTERS}
    error, status = None, 200
    try:
        q = history.Query.from_args(request.args)
        items, nxt = history.page(ext.redis, q)
    except BadRequest as exc:
        # A person typed a URL or filter we cannot read: say why on the page itself.
        error, status, items, nxt, q = exc.message, 400, [], None, history.Query()
    filters = {k: v for k, v in f.items() if v}
    keep = {**filters, "limit": q.limit} if "limit" in request.args and not error else filters
    kind, _, name = (q.target or "").partition(":")
    target_page = None
    if kind in keys.TARGET_KINDS and keys.TARGET_NAME_RE.match(name):
        target_page = {"kind": kind, "name": name, "url": target_url(kind, name)}
    empty = ("No remediation matches these filters." if filters else
             "No remediations yet. They appear here as soon as Alertmanager calls POST /webhook.")
    return _page(
        "index.html", **_common(now), items=items, next=nxt, before=q.before, f=f, filtered=bool(filters),
        error=error, targets=live_targets(ext.redis), playbooks=[p.name for p in ext.playbooks],
        statuses=history.STATUSES, outcomes=history.OUTCOMES, target_page=target_page, empty_text=empty,
        strip=_strip(ext, now),
        next_url=url_for("ui.index", **keep, before=nxt) if nxt else None,
        newest_url=url_for("ui.index", **keep)), status, HTML


@bp.get("/targets/<kind>/<name>")
def target(kind: str, name: str) -> Any:
    """One target: whether it is live, its remediations over time, its LR before and after, its records; a job's
    time by kind, its goodput and incidents."""
    ext, now = _ext(), time.time()
    if kind not in keys.TARGET_KINDS or not keys.TARGET_NAME_RE.match(name):
        message = (f"There is no target {kind}/{name}: the kind is job or node, and the name is 1 to 128 "
                   "letters, digits or _.:@-")
        return _page("error.html", **_common(now), message=message), 404, HTML
    label = f"{kind}:{name}"
    items, nxt = history.page(ext.redis, history.Query(limit=TARGET_PAGE_RECORDS, target=label))
    live = next((t for t in live_targets(ext.redis) if t["kind"] == kind and t["name"] == name), None)
    changes = charts.lr_changes(items)
    current = charts.floats(live.get("lr")) if live else None
    # The metric around the newest remediation of an alert (on_resolved records have their own alert's).
    anchor = next((r for r in items if not r.get("on_resolved")
                   and not str(r.get("requested_by") or "").startswith("operator")), None)  # operator:NAME too
    around = metric_chart.around(ext.redis, ext.prometheus, anchor, items, now) if anchor else None
    return _page(
        "target.html", **_common(now), kind=kind, name=name, live=live, items=items, next=nxt,
        all_url=url_for("ui.index", target=label), timeline=charts.timeline(items, now),
        lr=charts.lr_chart(changes, now, current), lr_changes=changes, dot_r=charts.DOT_R, around=around,
        lr_groups=max((len(c.before) for c in changes), default=0),
        gp=job_page.job_time(ext.redis, name, now) if kind == "job" else None), 200, HTML


@bp.get("/records/<rid>")
def record(rid: str) -> Any:
    """One remediation: what it did, its outcome and ladder, the metric around it, approve and reject."""
    ext, now = _ext(), time.time()
    rec = record_store.get(ext.redis, rid)
    if rec is None:
        return _page("error.html", **_common(now),
                     message=f"There is no remediation {rid}: it may be past retention."), 404, HTML
    ladder = _ladder(ext.redis, rec)
    around = None
    if not rec.get("on_resolved"):
        around = metric_chart.around(ext.redis, ext.prometheus, rec, ladder, now)
    # A held record says what approving sends, and which of it the target's live process could not apply now.
    live = None
    if rec.get("status") == RecordStatus.PENDING_APPROVAL:
        t = rec.get("target") or {}
        live = next((x for x in live_targets(ext.redis) if x["kind"] == t.get("kind") and x["name"] == t.get("name")),
                    None)
    playbook = next((p for p in ext.playbooks if p.name == rec.get("playbook")), None)
    return _page("record.html", **_common(now), rec=rec, ladder=ladder, around=around, live=live,
                 description=playbook.description if playbook else None,
                 checkpoints=_checkpoints(ext.redis, rid, rec)), 200, HTML


# How a node record's wait for its jobs' checkpoints ended (the checkpoint_jobs step's result `waited`), in words.
WAITED = {
    "acknowledged": "The node's next actions went out once every job on the node acknowledged its checkpoint.",
    "acknowledged_or_gone": "The node's next actions went out once every job on the node acknowledged its "
                            "checkpoint or stopped heartbeating.",
    "timeout": "The node's next actions went out when the timeout passed before every job acknowledged its "
               "checkpoint.",
    "no_jobs": "No job had a live process on the node: the node's next actions went out at once.",
}


def _checkpoints(r: Any, rid: str, rec: dict) -> dict | None:
    """A node record's checkpoint_jobs step as the page shows it: each job's record (its link and status now)
    and how the wait ended in words, or that it still waits (and until when); None without such a step."""
    step = next((a for a in rec["actions"] if a.get("action") == "checkpoint_jobs"), None)
    if step is None:
        return None
    result = step.get("result") if isinstance(step.get("result"), dict) else {}
    if result.get("waited") or result.get("jobs"):
        jobs = [(str(j.get("job")), str(j.get("id"))) for j in result.get("jobs") or [] if isinstance(j, dict)]
        deadline = None
    else:  # still waiting (or not begun): the plan on the record names the jobs and the deadline
        plan = json.loads(record_store.field_of(r, rid, "ckpt") or "{}")
        jobs = [(str(job), str(cid)) for job, cid in plan.get("jobs") or []]
        deadline = int(plan["deadline_ms"]) / 1000 if plan.get("deadline_ms") else None
    pipe = r.pipeline(transaction=False)
    for _, cid in jobs:
        pipe.hget(keys.record(cid), "status")
    statuses = pipe.execute() if jobs else []
    waited = str(result.get("waited") or "")
    return {"jobs": [{"job": job, "id": cid, "status": st or "gone"} for (job, cid), st in zip(jobs, statuses)],
            "waited": waited, "words": WAITED.get(waited), "waited_s": result.get("waited_s"),
            "deadline": deadline, "status": step.get("status")}


def _ladder(r: Any, rec: dict) -> list[dict]:
    """The record's escalation ladder in order: its first record, then each next stage (bounded). A job's
    checkpoint record has a parent too (the node's record, stage 0): not a stage of that record's ladder."""
    esc = rec["escalation"]
    first = record_store.get(r, esc["parent"]) if esc["parent"] and esc["stage"] else rec
    out: list[dict] = []
    cur = first
    while cur is not None and len(out) < 32:
        out.append(cur)
        nxt = cur["escalation"]["next"]
        cur = record_store.get(r, nxt) if nxt else None
    return out or [rec]


# The links and badges a page repeats for every record and action, as Python rather than Jinja macros and
# url_for: a page of 50 records makes ~450 of them, and a macro call or url_for costs several times a Python
# call (a quarter of rendering GET /). They write exactly what the macros wrote.
_SEGMENT_SAFE = "!$&'()*+,/:;=@"  # what url_for leaves unquoted in a path segment
_PLAIN = re.compile(r"[A-Za-z0-9_.:@~-]*")  # record ids and target names: nothing to quote


def _segment(value: Any) -> str:
    s = str(value)
    return s if _PLAIN.fullmatch(s) else quote(s, safe=_SEGMENT_SAFE)


def _path(*segments: Any) -> str:
    """A path of this app (under the prefix it is mounted at), its segments quoted as url_for does."""
    return request.script_root + "".join("/" + _segment(s) for s in segments)


@bp.app_template_global()
def record_url(rid: str) -> str:
    """url_for('ui.record', rid=rid)."""
    return _path("records", rid)


@bp.app_template_global()
def target_url(kind: str, name: str) -> str:
    """url_for('ui.target', kind=kind, name=name)."""
    return _path("targets", kind, name)


@bp.app_template_global()
def icon(name: str) -> Markup:
    """An inline SVG icon by its shape's name (caret, check...); nothing for an unknown name."""
    return _SVG.get(name, Markup(""))


@bp.app_template_global()
def badge(status: Any, cls: str = "badge") -> Markup:
    """A record's or an action's status with its icon."""
    s = str(status)
    return Markup(f'<span class="{escape(cls)} st-{escape(s)}">{icon(ICONS.get(s, ""))}{escape(word(s))}</span>')


@bp.app_template_global()
def action_chip(a: dict) -> Markup:
    """An action of a history row: its name, with its status as icon, colour and tooltip."""
    s, name = str(a.get("status")), str(a.get("action"))
    return Markup(f'<span class="chip st-{escape(s)}" title="{escape(name)}: {escape(word(s))}">'
                  f'{icon(ICONS.get(s, ""))}{escape(name)}</span>')


@bp.app_template_global()
def outcome_badge(o: Any, cls: str = "badge") -> Markup:
    """A record's outcome with its icon."""
    s = str(o.get("status", "")) if isinstance(o, dict) else ""
    return Markup(f'<span class="{escape(cls)} oc-{escape(s)}">{icon(OUTCOME_ICONS.get(s, ""))}{escape(s)}</span>')


@bp.app_template_filter("stamp_text")
def stamp_text(text: Any) -> str:
    """A stored RFC 3339 time (to the nanosecond, from Alertmanager) as a person reads it: to the second, UTC."""
    t = charts.parse_time(text) if isinstance(text, str) else None
    return when(t) if t is not None else str(text or "—")


@bp.app_template_global()
def stamp(text: Any) -> Markup:
    """stamp_text in a <time> element that keeps the exact stored value."""
    if not isinstance(text, str) or charts.parse_time(text) is None:
        return Markup(escape(stamp_text(text)))
    return Markup(f'<time datetime="{escape(text)}">{escape(stamp_text(text))}</time>')


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[_.])")


@bp.app_template_filter("soft")
def soft(text: Any) -> Markup:
    """A name with line-break chances between its words (GPUMemory<wbr>Usage<wbr>High, a_<wbr>b), so that a
    narrow column wraps it where a person would rather than cutting it or splitting a word."""
    return Markup("<wbr>").join(escape(part) for part in _CAMEL.split(str(text)))


@bp.app_template_filter("from_now")
def from_now(text: Any, now: float) -> str:
    """How long until an RFC 3339 time: "in 3 h 59 min", or "now past"."""
    t = charts.parse_time(text) if isinstance(text, str) else None
    if t is None:
        return ""
    return f"in {duration(t - now)}" if t > now else "now past"


@bp.app_template_global()
def params_list(params: Any) -> Markup:
    """An action's parameters, one per line as name and JSON value: exactly what is sent, split between words
    only (a JSON block squeezed into a table column broke its keys mid-word)."""
    if not isinstance(params, dict) or not params:
        return Markup('<span class="muted">none</span>')
    rows = "".join(f'<div><span class="k">{escape(k)}</span> <span class="v">'
                   f'{escape(json.dumps(v, sort_keys=True, default=str))}</span></div>' for k, v in params.items())
    return Markup(f'<div class="params">{rows}</div>')


@bp.app_template_global()
def target_link(t: dict) -> Markup:
    """A target's name linking to its page (none when the alert named no usable target: the reason says why)."""
    kind, name = t.get("kind", ""), t.get("name")
    if name:
        return Markup(f'<a href="{escape(target_url(kind, name))}"><span class="kind">{escape(kind)}</span>'
                      f'{escape(name)}</a>')
    return Markup(f'<span class="kind">{escape(kind)}</span><span class="muted">none</span>')


@bp.app_template_global()
def lr_change(result: Any) -> Markup:
    """An ack's learning rates, before and after, when it reports both."""
    old, new = (result.get("old_lr"), result.get("new_lr")) if isinstance(result, dict) else (None, None)
    if not (isinstance(old, Sequence) and isinstance(new, Sequence) and old and new):
        return Markup("")
    return Markup(f'\n<span class="lr" title="learning rate of each param group, before → after">LR '
                  f'{escape(lrs(old))} → {escape(lrs(new))}</span>')


# A rollback's passed-over checkpoints (its result's passed_over), each reason in words.
PASSED_OVER_WHY = {"missing_file": "a file its manifest lists is missing",
                   "size_mismatch": "a file is not the size its manifest lists",
                   "digest_mismatch": "a file's SHA-256 differs from its manifest's",
                   "incomplete": "no manifest, and a file the framework writes is missing",
                   "unreadable": "its manifest or weights do not parse"}


@bp.app_template_global()
def passed_over(result: Any) -> Markup:
    """The checkpoints a rollback passed over, newest first, each with why, when its result lists any."""
    items = result.get("passed_over") if isinstance(result, dict) else None
    if not isinstance(items, list) or not items:
        return Markup("")
    rows = "".join(f'<li><span class="mono">{escape(str(i.get("path")))}</span> '
                   f'<span class="muted">{escape(PASSED_OVER_WHY.get(str(i.get("why")), str(i.get("why"))))}'
                   f'</span></li>' for i in items if isinstance(i, dict))
    return Markup(f'\n<div class="passed-over">Passed over, newest first:<ul>{rows}</ul></div>')


@bp.app_template_filter("fold")
def fold(items: list[dict]) -> list[folds.Row]:
    """A page's records as its lines: each repeat of a remediation folded under it (web/folds.py)."""
    return folds.fold(items)


@bp.app_template_filter("word")
def word(value: Any) -> str:
    """A status or reason as words: partially_applied -> partially applied."""
    return str(value).replace("_", " ")


@bp.app_template_filter("ago")
def ago(text: str | None, now: float) -> str:
    """An RFC 3339 time as a person says it: 42 s ago, 5 min ago, 3 h ago, else the date."""
    t = charts.parse_time(text)
    if t is None:
        return text or "—"
    d = now - t
    if d < 5:
        return "just now"
    if d < 60:
        return f"{int(d)} s ago"
    if d < 3600:
        return f"{int(d // 60)} min ago"
    if d < 86400:
        return f"{int(d // 3600)} h {int(d % 3600 // 60)} min ago"
    return time.strftime("%b %d %H:%M UTC", time.gmtime(t))


@bp.app_template_filter("when")
def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


@bp.app_template_filter("duration")
def duration(seconds: Any) -> str:
    """Seconds as a person reads them: 42 s, 3 min 12 s, 2 h 5 min."""
    if not isinstance(seconds, (int, float)):
        return "—"
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


@bp.app_template_filter("pretty")
def pretty(value: Any) -> str:
    """JSON for reading (autoescaped by the template like any other text)."""
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def rounded(value: Any, digits: int = 4) -> Any:
    """Every float in a JSON value to `digits` significant digits (0.00015000000000499997 -> 0.00015)."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


@bp.app_template_global()
def result_json(result: Any) -> Markup:
    """An action's result as JSON for reading, its numbers rounded; the exact value on hover when they were."""
    full, shown = pretty(result), pretty(rounded(result))
    exact = f' title="exact: {escape(full)}"' if shown != full else ""
    return Markup(f'<pre class="result"{exact}>{escape(shown)}</pre>')


@bp.app_template_filter("lrs")
def lrs(values: Any) -> str:
    """Learning rates, compactly: 0.001, 0.0005 (param groups with the same LR shown once)."""
    if not isinstance(values, (list, tuple)):
        return str(values)
    shown = [f"{v:.3g}" if isinstance(v, (int, float)) else str(v) for v in values]
    if len(set(shown)) == 1 and len(shown) > 1:
        return f"{shown[0]} (×{len(shown)} groups)"
    return ", ".join(shown)


@bp.app_template_filter("web_url")
def web_url(value: Any) -> bool:
    """Only plain http(s) links from annotations become clickable (never javascript: or data:)."""
    return isinstance(value, str) and value.startswith(("https://", "http://")) and " " not in value

