"""Redis memory per alert, by key kind: while every command waits, and once every command has ended.

Run: .venv/bin/python benchmarks/memory_per_alert.py [--alerts 1000000] [--jobs 10000] [--new-jobs 100000]
     .venv/bin/python benchmarks/memory_per_alert.py --quick          # 20,000 alerts over 200 jobs, 2,000 new jobs

In process (Flask's test client, no gunicorn, no HTTP: cost_model.py's in_process and fill), an embedded
redis-server as `trainmedic serve` runs it (AOF on, appendfsync everysec, hash-max-listpack-value 2048,
stream-node-max-bytes 512), signing on. Alerts are TrainingLossSpike, each its own fingerprint and start, in
notifications of 100, alert n on job n % jobs. Three cases, each on a fresh Redis:

- as shipped: the shipped playbooks. loss-spike cools down per job (10m, max_runs 3 per 24h), so a job's first
  alert dispatches a command and the rest are records `skipped` (cooldown) that send nothing;
- every alert dispatches: the shipped playbooks with loss-spike's cooldown 0s and no max_runs (a file written
  here), so each alert is a dispatched record with its signed command and a mailbox entry;
- new jobs: every alert names a job of its own (the shipped playbooks: every alert dispatches).

Each is measured (a) once the fill is indexed (history.catch_up, as the reconciler's next pass does), while every
command still waits: nobody claimed or acknowledged one; (b) once every command has ended, as the product ends
them: --end expire (default) runs the reconciler's pass (Reconciler.tick, its RECONCILE of every due target) at
now + expire_after + 1 s, so each command expires; --end ack acknowledges every action `applied` through the ACK
script (scripts.ack_calls, as a trainer does); (c) once the reconciler has followed up every record it follows
(its outcome counted, its ladder ended, its due item gone): the pass with its follow-ups, at the same time or, after
acks, at now + verify + 301 s (outcome ineffective: no resolve came). (c) is left out for a case with more than
--follow-up-max dispatched records (a follow-up takes a few ms of the reconciler here: a million take an hour).
The passes run with one page for every due target: as shipped (2,000 targets a page, one second a pass) a pass
whose due targets fill a page visits that page again for its whole second and never reaches the follow-ups.

Per alert: INFO memory's used_memory over the empty Redis, divided by the alerts sent; by key kind: MEMORY USAGE
(SAMPLES 0: every element) of a random sample of each kind's keys (--sample, default 2,000), scaled by the kind's
key count (one SCAN). No key's MEMORY USAGE holds the keyspace's own tables (the main dict's buckets, the
expires dict): `unaccounted` is the rest of used_memory.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
import yaml

from common import ROOT
from cost_model import fill, in_process
from history_scale import kind_of

from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import Ack
from trainmedic.client.wire.redis import run_scripts
from trainmedic.client.wire.scripts import ack_calls
from trainmedic.service import history
from trainmedic.service.decide.followup import INEFFECTIVE_AFTER

GROUPS = ("record hash", "mailbox stream", "playbook state", "due items", "history indexes", "journal", "other")
# Key kinds (history_scale.kind_of) by group; every other kind is `other`.
KIND_GROUP = {"rec": "record hash", "mailbox": "mailbox stream", "playbook": "playbook state", "due": "due items",
              "history": "history indexes", "hist": "history indexes", "hist:bm": "history indexes",
              "hist:seg": "history indexes", "hist:seq": "history indexes", "hist:journal": "journal",
              "hj": "journal"}
GOAL_WAITING = 2500  # bytes per alert (KB = 1,000 bytes)
GOAL_ENDED = 1500
PLAYBOOK = "loss-spike"


@dataclass(frozen=True)
class Case:
    """One fill: its name, alerts, jobs and playbooks folder."""

    name: str
    alerts: int
    jobs: int
    playbooks: Path


@dataclass(frozen=True)
class Memory:
    """What Redis holds at one moment, per alert: used_memory's growth, and each key kind's (count, bytes)."""

    used: int
    kinds: dict[str, tuple[int, float]]

    def group(self, name: str) -> tuple[int, float]:
        rows = [v for k, v in self.kinds.items() if KIND_GROUP.get(k, "other") == name]
        return sum(c for c, _ in rows), sum(b for _, b in rows)


@dataclass(frozen=True)
class Stage:
    """One moment of a case: what Redis holds, its records by status, the seconds it took, due items left."""

    memory: Memory
    statuses: dict[str, int]
    seconds: float
    due_left: int


@dataclass(frozen=True)
class Result:
    case: Case
    stages: dict[str, Stage]  # waiting, ended and (when run) followed up
    journal: int  # bytes the journal held before its first fold
    version: str  # redis-server's
    note: str = ""


def every_alert_playbooks(folder: Path) -> Path:
    """The shipped playbooks with loss-spike's cooldown 0s and no max_runs, in folder/default.yaml."""
    doc = yaml.safe_load((ROOT / "playbooks" / "default.yaml").read_text())
    pb = next(p for p in doc["playbooks"] if p["name"] == PLAYBOOK)
    pb["cooldown"] = "0s"
    pb.pop("max_runs", None)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "default.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder


def kind(key: str) -> str:
    """A key's kind; the global due-targets index is told apart from the targets' due items (both end in `due`)."""
    return "due (targets)" if key == keys.DUE else kind_of(key)


def measure(r: redis.Redis, base: int, sample: int, rng: random.Random) -> Memory:
    """used_memory over base, and per key kind its key count and MEMORY USAGE (a sample's mean times the count)."""
    used = int(r.info("memory")["used_memory"]) - base
    counts: dict[str, int] = {}
    picked: dict[str, list[str]] = {}
    for key in r.scan_iter(match=keys.PREFIX + "*", count=10_000):
        k = kind(key)
        n = counts[k] = counts.get(k, 0) + 1
        chosen = picked.setdefault(k, [])
        if len(chosen) < sample:
            chosen.append(key)
        elif (j := rng.randrange(n)) < sample:  # reservoir sampling: each key kept with probability sample/n
            chosen[j] = key
    kinds = {}
    for k, chosen in picked.items():
        pipe = r.pipeline(transaction=False)
        for key in chosen:
            pipe.memory_usage(key, samples=0)
        sizes = [s or 0 for s in pipe.execute()]
        kinds[k] = (counts[k], sum(sizes) / len(sizes) * counts[k])
    return Memory(used, kinds)


def statuses(r: redis.Redis) -> dict[str, int]:
    """Records by status, from the history index's bitmaps."""
    segments = (int(r.get(keys.HIST_SEQ) or 0) >> history.SEG_BITS) + 1
    out = {}
    for status in history.STATUSES:
        n = sum(int(r.bitcount(keys.hist_bitmap(seg, "s", status))) for seg in range(segments))
        if n:
            out[str(status)] = n
    return out


def passes(svc: Any, at: float, follow_ups: bool, limit_s: float = 7200.0) -> None:
    """The reconciler's pass at `at`, one page for every due target: RECONCILE only (no time left for follow-ups:
    interval 0) until no record changes, or with follow-ups (no time bound) until no target is due by `at`.
    (As shipped, 2,000 targets a page and one second a pass, a pass whose due targets fill a page visits them
    again for the whole second and never reaches their follow-ups; the README's section says more.)"""
    rec = svc.reconciler
    shipped = rec.settings
    rec.settings = replace(shipped, targets_per_tick=10**9, interval=1e6 if follow_ups else 0.0)
    deadline = time.monotonic() + limit_s
    try:
        while (report := rec.tick(at)).targets and (follow_ups or report.changed):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the reconciler still had targets due after {limit_s:.0f}s")
    finally:
        rec.settings = shipped


def dispatched_ids(r: redis.Redis) -> list[str]:
    """Every record still dispatched, read from the records the history lists."""
    ids = [rid for rid, _ in r.zscan_iter(keys.HISTORY, count=10_000)]
    out = []
    for i in range(0, len(ids), 10_000):
        pipe = r.pipeline(transaction=False)
        for rid in ids[i:i + 10_000]:
            pipe.hget(keys.record(rid), "status")
        out += [rid for rid, st in zip(ids[i:i + 10_000], pipe.execute()) if st == "dispatched"]
    return out


def end_commands(svc: Any, r: redis.Redis, how: str) -> float:
    """End every waiting command as the product does: the reconciler expires it, or a client acknowledges each
    action `applied`. Returns when the follow-ups are all due (the pass that runs them)."""
    pb = svc.playbook(PLAYBOOK)
    if how == "expire":
        at = time.time() + pb.expire_after + 1
        passes(svc, at, follow_ups=False)
        return at
    actions = [st.action for st in pb.actions]
    ids = dispatched_ids(r)
    for i in range(0, len(ids), 500):
        acks = [Ack(rid, n, action, "applied", {}, "bench:1") for rid in ids[i:i + 500]
                for n, action in enumerate(actions)]
        now = time.time()
        run_scripts(r, ack_calls(acks, now))  # as the client's Mailbox.ack does
    return time.time() + pb.verify + INEFFECTIVE_AFTER + 1


def stage(r: redis.Redis, base: int, sample: int, rng: random.Random, t0: float, name: str) -> Stage:
    """Index what the journal holds, then measure."""
    history.catch_up(r, wait=600)
    seconds = time.perf_counter() - t0
    due = sum(int(r.zcard(k)) for k in r.scan_iter(match=keys.PREFIX + "{*}:due", count=10_000))
    out = Stage(measure(r, base, sample, rng), statuses(r), seconds, due)
    print(f"  {name} in {seconds:.0f}s: {out.statuses}, {out.memory.used / 2**20:,.0f} MiB", file=sys.stderr,
          flush=True)
    return out


def run_case(case: Case, sample: int, end: str, follow_up_max: int, rng: random.Random) -> Result:
    with in_process(case.playbooks) as (http, r):
        svc = http.application.extensions["trainmedic"]
        base = int(r.info("memory")["used_memory"])
        t0 = time.perf_counter()
        fill(http, case.alerts, case.jobs)
        journal = int(r.memory_usage(keys.HIST_JOURNAL, samples=0) or 0)
        stages = {"waiting": stage(r, base, sample, rng, t0, "filled")}
        followed = stages["waiting"].statuses.get("dispatched", 0)
        t0 = time.perf_counter()
        at = end_commands(svc, r, end)
        stages["ended"] = stage(r, base, sample, rng, t0, "ended")
        note = ""
        if followed <= follow_up_max:
            t0 = time.perf_counter()
            passes(svc, at, follow_ups=True)
            stages["followed up"] = stage(r, base, sample, rng, t0, "followed up")
        else:
            note = (f"follow-ups of its {followed:,} followed records not run (more than --follow-up-max "
                    f"{follow_up_max:,}; each takes a few ms of the reconciler here)")
        return Result(case, stages, journal, r.info("server")["redis_version"], note)


def verdict(per_alert: float, goal: int) -> str:
    return f"<= {goal:,}: {'met' if per_alert <= goal else 'NOT met'}"


def headings(end: str) -> dict[str, str]:
    """Each stage's column heading."""
    return {"waiting": "waiting", "ended": "expired" if end == "expire" else "acknowledged",
            "followed up": "followed up"}


def goal_of(name: str) -> int:
    return GOAL_WAITING if name == "waiting" else GOAL_ENDED


def table(res: Result, end: str) -> list[str]:
    """One case's figures by key kind, per alert, at each stage."""
    c, n, names = res.case, res.case.alerts, headings(end)
    stages = list(res.stages.items())
    out = [f"### {c.name}: {n:,} alerts over {c.jobs:,} jobs ({n // c.jobs:,} a job)", "",
           "| key kind | " + " | ".join(f"keys, {names[s]} | B/alert, {names[s]}" for s, _ in stages) + " |",
           "|---|" + "---:|---:|" * len(stages)]
    sums = [0.0] * len(stages)
    for g in GROUPS:
        cells = []
        for i, (_, st) in enumerate(stages):
            count, use = st.memory.group(g)
            sums[i] += use
            cells.append(f"{count:,} | {use / n:,.0f}")
        out.append(f"| {g} | " + " | ".join(cells) + " |")
    out += ["| sum of key kinds (MEMORY USAGE) | " + " | ".join(f" | {u / n:,.0f}" for u in sums) + " |",
            "| unaccounted (keyspace tables) | " + " | ".join(
                f" | {(st.memory.used - u) / n:,.0f}" for u, (_, st) in zip(sums, stages)) + " |",
            "| **used_memory (INFO), total** | " + " | ".join(
                f" | **{st.memory.used / n:,.0f}**" for _, st in stages) + " |",
            "| goal | " + " | ".join(f" | {verdict(st.memory.used / n, goal_of(s))}" for s, st in stages) + " |",
            ""]
    out.append("- records by status: " + "; ".join(f"{names[s]} {st.statuses}" for s, st in stages))
    for s, st in (stages[0], stages[-1]):
        others = {k: v for k, v in st.memory.kinds.items() if KIND_GROUP.get(k, "other") == "other"}
        top = sorted(others.items(), key=lambda kv: -kv[1][1])[:4]
        out.append(f"- `other`, {names[s]}: " + ", ".join(f"{k} ({cnt:,} keys, {b / n:,.1f} B/alert)"
                                                         for k, (cnt, b) in top))
    out += [
            f"- the journal before its first fold held {res.journal / n:,.0f} B/alert (the reconciler folds it "
            "each pass)",
            "- seconds: " + ", ".join(f"{names[s]} {st.seconds:.0f}" for s, st in stages)
            + f" (fill {n / res.stages['waiting'].seconds:,.0f} alerts/s with its fold); due items left: "
            + ", ".join(f"{names[s]} {st.due_left:,}" for s, st in stages)]
    return out + ([f"- {res.note}"] if res.note else []) + [""]


def summary(results: list[Result], end: str) -> list[str]:
    names = headings(end)
    out = ["| case | alerts | jobs | " + " | ".join(f"B/alert, {names[s]} | goal" for s in names) + " |",
           "|---|---:|---:|" + "---:|---|" * len(names)]
    for res in results:
        n = res.case.alerts
        cells = []
        for s in names:
            st = res.stages.get(s)
            used = st.memory.used / n if st else None
            cells.append(f"{used:,.0f} | {verdict(used, goal_of(s))}" if used is not None else "- | not run")
        out.append(f"| {res.case.name} | {n:,} | {res.case.jobs:,} | " + " | ".join(cells) + " |")
    return out + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--alerts", type=int, default=1_000_000, help="alerts of the first two cases (default 1,000,000)")
    ap.add_argument("--jobs", type=int, default=10_000, help="jobs they spread over (default 10,000)")
    ap.add_argument("--new-jobs", type=int, default=100_000,
                    help="alerts of the third case, each its own job (default 100,000; 0: skip it)")
    ap.add_argument("--quick", action="store_true", help="20,000 alerts over 200 jobs, 2,000 new jobs")
    ap.add_argument("--case", choices=("shipped", "every", "new-jobs"), action="append",
                    help="run only these cases (default all three)")
    ap.add_argument("--end", choices=("expire", "ack"), default="expire",
                    help="how the commands end: the reconciler expires them (default), or clients acknowledge them")
    ap.add_argument("--follow-up-max", type=int, default=100_000,
                    help="run the follow-ups of a case with at most this many dispatched records (default 100,000)")
    ap.add_argument("--sample", type=int, default=2000, help="keys measured per key kind (default 2,000)")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/memory_per_alert.txt; "
                                                "with --quick, memory_per_alert_quick.txt)")
    args = ap.parse_args()
    if args.quick:
        args.alerts, args.jobs, args.new_jobs = 20_000, 200, 2_000
    wanted = set(args.case or ("shipped", "every", "new-jobs"))
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-memory-"))
    shipped = ROOT / "playbooks"
    cases = [(k, c) for k, c in (
        ("shipped", Case("as shipped (loss-spike: cooldown 10m, max_runs 3/24h)", args.alerts, args.jobs, shipped)),
        ("every", Case("every alert dispatches (loss-spike: cooldown 0s, no max_runs)", args.alerts, args.jobs,
                       every_alert_playbooks(tmp / "every"))),
        ("new-jobs", Case("every alert a new job (shipped playbooks)", args.new_jobs, args.new_jobs, shipped)),
    ) if k in wanted and c.alerts > 0]
    rng = random.Random(1)
    started = datetime.now(UTC)
    results = []
    for _, case in cases:
        print(f"{case.name}: {case.alerts:,} alerts over {case.jobs:,} jobs", file=sys.stderr, flush=True)
        results.append(run_case(case, args.sample, args.end, args.follow_up_max, rng))
    # The command as measured: where the table was written is no part of it (and may be a machine's path).
    argv = " ".join(a for i, a in enumerate(sys.argv[1:]) if "--out" not in (a.split("=")[0], sys.argv[i]))
    version = results[0].version if results else "?"
    lines = [f"memory per alert: in-process webhook (Flask test client), notifications of 100 alerts, redis-server "
             f"{version}, AOF appendfsync everysec, hash-max-listpack-value 2048, stream-node-max-bytes 512, signing "
             f"on; commands ended by {'expiry (the reconciler)' if args.end == 'expire' else 'acks (ACK script)'}; "
             f"MEMORY USAGE SAMPLES 0 over up to {args.sample:,} random keys a kind, scaled by its key count; bytes "
             f"per alert sent (goals: KB = 1,000 bytes)",
             f"run {started:%Y-%m-%d %H:%M} UTC: .venv/bin/python benchmarks/memory_per_alert.py {argv}".rstrip(), ""]
    lines += summary(results, args.end)
    for res in results:
        lines += table(res, args.end)
    text = "\n".join(lines)
    print(text)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        "memory_per_alert_quick.txt" if args.quick else "memory_per_alert.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(f"written to {out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out.name}")


if __name__ == "__main__":
    main()
