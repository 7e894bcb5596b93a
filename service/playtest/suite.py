"""Running test files: each test on a fresh keyspace of the scratch Redis, its events fed to the engine in
time order, its records compared with the expected ones at `until`."""
from __future__ import annotations

import time
from typing import Any


from .engine import Engine, EngineError, instant, ms
from .outside import Table
from .scratch import captured
from .report import Record, Result, diff, span
from .cases import Case, TestFile


def run_case(r: Any, tf: TestFile, case: Case) -> Result:
    """One test, from an empty keyspace; its result says every way it failed."""
    began = time.perf_counter()
    result = Result(tf.path, case.name, case.line, 0.0)
    r.flushall()
    start_ms = int(time.time()) * 1000  # the clock's 0s: the moment the test starts, to the second
    start = instant(start_ms)

    def clock(at: float) -> float:
        return instant(start_ms + ms(at))

    with captured() as log:
        engine = Engine(r, tf.playbooks, tf.targets, start, case.answer, Table(case.conditions))
        try:
            for ev in case.events:
                if ev.verb and ev.playbook:
                    got = engine.decide_held(clock(ev.at), ev.playbook, ev.verb)
                    if got is None:
                        result.problems.append(f"event at {span(ev.at)} (line {ev.line}): {ev.describe()} found "
                                               f"no record of {ev.playbook} held for approval")
                    elif got[1] not in ("dispatched", "rejected"):
                        result.problems.append(f"event at {span(ev.at)} (line {ev.line}): {ev.describe()} found "
                                               f"{got[0]} no longer held (the service answered {got[1]})")
                else:
                    engine.notify(clock(ev.at), ev.firing, ev.resolved)
            engine.advance(clock(case.until))
            made = []
            for m in engine.made:
                rec = engine.record(m.record_id)
                if rec is not None:
                    made.append(Record.of(rec, (m.at - start)))
        except EngineError as exc:
            result.problems.append(f"the test could not run to its end: {exc}")
            made = []
        finally:
            engine.close()
    result.problems.extend(f"the service logged an error: {x}" for x in log.errors)
    if not any(p.startswith("the test could not") for p in result.problems):
        result.problems.extend(diff(case.expect, made))
    result.seconds = time.perf_counter() - began
    return result


def run_file(r: Any, tf: TestFile) -> list[Result]:
    return [run_case(r, tf, case) for case in tf.cases]
