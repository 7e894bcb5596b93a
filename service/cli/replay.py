"""`trainmedic replay --prometheus URL`: what the playbooks (and, with --against, another set) would have done
with the alerts Prometheus remembers."""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..settings import ServiceSettings
from .common import CliError, UsageError, need


def add(sub: Any) -> None:
    p = sub.add_parser("replay", help="what playbooks would have done with the alerts Prometheus remembers")
    p.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus's address, e.g. http://prom:9090")
    p.add_argument("--since", default="7d", metavar="DUR", help="how far back the window starts (default 7d, at "
                                                                "most 31d)")
    p.add_argument("--until", metavar="TIME", help="when the window ends: RFC 3339 or seconds since the epoch "
                                                   "(default now)")
    p.add_argument("--step", default="30s", metavar="DUR", help="the resolution alerts are read at (default 30s)")
    p.add_argument("--playbooks", metavar="PATH", help="playbook files or a folder (default: TRAINMEDIC_PLAYBOOKS, "
                                                       "else the shipped ones)")
    p.add_argument("--against", metavar="PATH", help="another set of playbooks to replay beside them, and compare")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def _window(args: argparse.Namespace) -> Any:
    from ...client.wire.durations import parse_duration
    from ...client.wire.protocol import parse_rfc3339
    from ..playtest.episodes import MAX_WINDOW, Window

    try:
        since, step = parse_duration(args.since), parse_duration(args.step)
    except ValueError as exc:
        raise UsageError(f"--since and --step are durations: {exc}") from None
    until = time.time()
    if args.until is not None:
        got = parse_rfc3339(args.until)
        if got is None:
            try:
                got = float(args.until)
            except ValueError:
                raise UsageError(f"--until {args.until!r} is not an RFC 3339 time or seconds since the epoch") from None
        until = got
    if not 0 < since <= MAX_WINDOW:
        raise UsageError(f"--since must be longer than zero and at most 31d (the longest window replay reads), "
                         f"not {args.since}")
    if step < 1:
        raise UsageError(f"--step must be at least 1s, not {args.step}")
    if step > since:
        raise UsageError(f"--step ({args.step}) is longer than the window (--since {args.since})")
    return Window(until - since, until, step)


def _playbooks(path: str) -> Any:
    from ..rules.playbooks import PlaybookError, load

    try:
        return load([path])
    except PlaybookError as exc:
        raise UsageError(f"invalid playbooks in {path}: {exc}") from None


def run(args: argparse.Namespace, settings: ServiceSettings) -> int:
    need("replay", "yaml")
    from ...client.wire.protocol import rfc3339
    from ..playtest import episodes as history
    from ..playtest.engine import EngineError
    from ..playtest.replay import changed, replay, workers_for
    from ..prometheus import Prometheus, PrometheusError
    from ..rules.playbooks import SHIPPED

    window = _window(args)
    mine = args.playbooks or settings.playbooks or str(SHIPPED)
    sets = [(mine, _playbooks(mine))] + ([(args.against, _playbooks(args.against))] if args.against else [])
    url = args.prometheus.rstrip("/")
    began = time.perf_counter()
    try:
        found, series = history.read(Prometheus(url, timeout=60.0), window)
    except PrometheusError as exc:
        raise UsageError(f"cannot read ALERTS from {url}: {exc}") from None
    if not found:
        raise UsageError(f"Prometheus at {url} holds no ALERTS series between {rfc3339(window.start)} and "
                         f"{rfc3339(window.end)}")
    read_s = time.perf_counter() - began
    try:
        done = [replay(found, pbs, window, url, workers_for(len(found))) for _, pbs in sets]
    except EngineError as exc:
        raise CliError(f"the replay stopped: {exc}") from None
    diff = changed(found, done[0], done[1]) if len(done) > 1 else []
    if args.json:
        out: dict[str, Any] = {"playbooks": {k: v.as_dict() for k, v in done[0].tallies.items()}}
        if len(done) > 1:
            out["against"] = {k: v.as_dict() for k, v in done[1].tallies.items()}
        out.update(changed=diff, episodes=len(found), series=series,
                   window={"start": rfc3339(window.start), "end": rfc3339(window.end), "step_s": window.step},
                   seconds={"read": round(read_s, 3), "replay": round(sum(d.seconds for d in done), 3)})
        print(json.dumps(out, indent=2))
        return 0
    seconds = sum(d.seconds for d in done)
    print(f"{len(found)} alert episode{'s' * (len(found) != 1)} of {series} series from {rfc3339(window.start)} "
          f"to {rfc3339(window.end)} ({args.step} steps): read in {read_s:.1f}s, replayed in {seconds:.1f}s")
    print()
    for line in table([d.tallies for d in done]):
        print(line)
    if len(done) > 1:
        print()
        print(f"{len(diff)} decision{'s' * (len(diff) != 1)} differ{'s' * (len(diff) == 1)} "
              f"({sets[0][0]} → {sets[1][0]}):")
        names = max((len(c["alertname"]) for c in diff), default=0)
        targets = max((len(c["target"]) for c in diff), default=0)
        for c in diff:
            print(f"  {c['alertname']:<{names}}  {c['target']:<{targets}}  {c['starts_at']}: {c['before']} → "
                  f"{c['after']}")
    return 0


def table(tallies: list[dict[str, Any]]) -> list[str]:
    """Each playbook's row; with two sets, each cell says `before → after`."""
    playbooks = list(tallies[0]) + [n for n in (tallies[1] if len(tallies) > 1 else {}) if n not in tallies[0]]

    def cell(pb: str, get: Any) -> str:
        values = [get(t[pb]) if pb in t else "-" for t in tallies]
        return " → ".join(map(str, values)) if len(values) > 1 and len(set(map(str, values))) > 1 else str(values[0])

    def skipped(pb: str) -> str:
        reasons = sorted({r for t in tallies if pb in t for r in t[pb].skipped})
        return ", ".join(f"{r} {cell(pb, lambda t, r=r: t.skipped.get(r, 0))}" for r in reasons) or "-"

    rows = [["PLAYBOOK", "MATCHED", "DISPATCHED", "HELD", "SKIPPED"]]
    for pb in playbooks:
        rows.append([pb, cell(pb, lambda t: t.matched), cell(pb, lambda t: t.dispatched), cell(pb, lambda t: t.held),
                     skipped(pb)])
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return ["  ".join(row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i]) for i in range(4))
            + "  " + row[4] for row in rows]
