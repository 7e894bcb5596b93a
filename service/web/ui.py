"""The history page for people: filtered records, a per-target timeline, live targets (server-rendered)."""
from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import redis
from flask import Blueprint, current_app, render_template, request, url_for
from flask.templating import Environment
from markupsafe import Markup, escape

from trainmedic.client.wire import keys
from trainmedic.client.wire import records as record_store

from .. import history, outcomes
from ..errors import BadRequest
from . import charts, metric_chart
from .common import ext as _ext, live_targets

bp = Blueprint("ui", __name__, template_folder="templates")

ICONS = {"applied": "✓", "partially_applied": "◐", "failed": "✗", "dispatched": "➜", "delivered": "➜",
         "pending": "…", "pending_approval": "⏸", "dry_run": "◌", "skipped": "–", "unsupported": "⊘",
         "expired": "⌛", "lost": "⚠"}
OUTCOME_ICONS = {"pending": "…", "effective": "✓", "ineffective": "✗", "unknown": "?"}
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
    return {"now": now, "icons": ICONS, "reset_at": _reset_at(),
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
    rows = []
    for name, st in stats.items():
        shown = {k: st.counts[k] for k in ("effective", "ineffective", "pending")}
        rows.append({"name": name, "counts": shown, "total": sum(shown.values()), "median": st.median})
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
    """One target: whether it is live, its remediations over time, its LR before and after, its records."""
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
    anchor = next((r for r in items if not r.get("on_resolved") and r.get("requested_by") != "operator"), None)
    around = metric_chart.around(ext.redis, ext.prometheus, anchor, items, now) if anchor else None
    return _page(
        "target.html", **_common(now), kind=kind, name=name, live=live, items=items, next=nxt,
        all_url=url_for("ui.index", target=label), timeline=charts.timeline(items, now),
        lr=charts.lr_chart(changes, now, current), lr_changes=changes, dot_r=charts.DOT_R, around=around,
        lr_groups=max((len(c.before) for c in changes), default=0)), 200, HTML


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
    return _page("record.html", **_common(now), rec=rec, ladder=ladder, around=around), 200, HTML


def _ladder(r: Any, rec: dict) -> list[dict]:
    """The record's escalation ladder in order: its first record, then each next stage (bounded)."""
    first = record_store.get(r, rec["escalation"]["parent"]) if rec["escalation"]["parent"] else rec
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
def badge(status: Any, cls: str = "badge") -> Markup:
    """A record's or an action's status with its icon."""
    s = str(status)
    return Markup(f'<span class="{escape(cls)} st-{escape(s)}">{escape(ICONS.get(s, ""))} {escape(word(s))}</span>')


@bp.app_template_global()
def outcome_badge(o: Any, cls: str = "badge") -> Markup:
    """A record's outcome with its icon."""
    s = str(o.get("status", "")) if isinstance(o, dict) else ""
    return Markup(f'<span class="{escape(cls)} oc-{escape(s)}">{escape(OUTCOME_ICONS.get(s, ""))} {escape(s)}</span>')


@bp.app_template_global()
def target_link(t: dict) -> Markup:
    """A target's name linking to its page (a bad label says so)."""
    kind, name = t.get("kind", ""), t.get("name")
    if name:
        return Markup(f'<a href="{escape(target_url(kind, name))}"><span class="kind">{escape(kind)}</span>'
                      f'{escape(name)}</a>')
    return Markup(f'<span class="kind">{escape(kind)}</span><span class="muted">none (bad label)</span>')


@bp.app_template_global()
def lr_change(result: Any) -> Markup:
    """An ack's learning rates, before and after, when it reports both."""
    old, new = (result.get("old_lr"), result.get("new_lr")) if isinstance(result, dict) else (None, None)
    if not (isinstance(old, Sequence) and isinstance(new, Sequence) and old and new):
        return Markup("")
    return Markup(f'\n<span class="lr" title="learning rate of each param group, before → after">LR '
                  f'{escape(lrs(old))} → {escape(lrs(new))}</span>')


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

