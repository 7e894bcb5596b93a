"""`trainmedic test`: playbook tests run through the service's own decisions on a scratch Redis and a virtual clock
(README: "Testing playbooks")."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
import redis
import yaml

from trainmedic.client.wire import keys
from trainmedic.service.cli import main
from trainmedic.service.playtest.engine import Engine
from trainmedic.service.playtest.outside import Live
from trainmedic.service.playtest.scratch import scratch
from trainmedic.service.rules.playbooks import load

from tests.conftest import FIXTURES
from tests.support.receiver import Receiver

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "playbooks"
TRAINMEDIC = Path(sys.executable).parent / "trainmedic"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    """`trainmedic ARGV` in this process: its exit code and its output's lines."""
    code = main(list(argv))
    return code, capsys.readouterr().out.splitlines()


def copy_shipped(tmp_path: Path, playbook: str, change: dict[str, Any], file: str = "default.yaml") -> Path:
    """The shipped playbooks and their tests in tmp_path, with one playbook's fields changed (None: removed)."""
    folder = tmp_path / "playbooks"
    shutil.copytree(SHIPPED, folder, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    path = folder / file if file == "default.yaml" else folder / "tests" / file
    doc = yaml.safe_load(path.read_text())
    [pb] = [p for p in doc["playbooks"] if p["name"] == playbook]
    for key, value in change.items():
        if value is None:
            pb.pop(key)
        else:
            pb[key] = value
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder / "tests"


def block(lines: list[str], test: str) -> list[str]:
    """A failing test's line and the lines under it."""
    [start] = [i for i, line in enumerate(lines) if f": test {test}: " in line]
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return lines[start:end]


def test_the_shipped_playbooks_pass_their_tests() -> None:
    out = subprocess.run([str(TRAINMEDIC), "test", "playbooks/tests/"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    files = len(list((SHIPPED / "tests").glob("*.test.yaml")))
    assert lines[-1].endswith(f"tests passed ({files} files)") and out.stderr == ""
    tests = lines[:-1]
    assert len(tests) >= 28 and all(line.endswith(": ok") and ": test " in line for line in tests), lines
    assert any(line.startswith("playbooks/tests/nodes.test.yaml:") for line in tests)


def test_a_test_expecting_a_cooldown_fails_against_a_playbook_without_one(capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path) -> None:
    tests = copy_shipped(tmp_path, "loss-spike", {"cooldown": None})
    code, lines = run(capsys, "test", str(tests / "training.test.yaml"))
    assert code == 1
    where = f"{tests / 'training.test.yaml'}:8"
    assert block(lines, "a loss spike is cut once per episode, and it worked") == [
        f"{where}: test a loss spike is cut once per episode, and it worked: FAILED",
        "  expected (-) and made (+) records, in the order they were made:",
        "      {at: 0s, playbook: loss-spike, target: job:llama-ft-01, status: applied, actions: [rollback_checkpoint, "
        "{scale_lr: {factor: 0.5, min_lr: 1e-07}}], outcome: effective}",
        "    - {at: 9m, playbook: loss-spike, status: skipped, reason: cooldown, outcome: null}  (line 25)",
        "    + {at: 9m, playbook: loss-spike, target: job:llama-ft-01, status: applied, reason: null, actions: "
        "[rollback_checkpoint, scale_lr], outcome: ineffective}",
        "        status: expected skipped, made applied",
        "        reason: expected cooldown, made null",
        "        outcome: expected null, made ineffective",
        "      {at: 10m30s, playbook: loss-spike, status: applied, outcome: effective}",
    ]
    # The other tests of the file do not depend on the cooldown.
    assert sum(line.endswith(": ok") for line in lines) == 12


@pytest.mark.parametrize(("playbook", "change", "file", "test", "says"), [
    ("loss-spike", {"max_runs": None}, "training.test.yaml", "a loss spike's budget is three remediations a day",
     "reason: expected budget_exhausted, made null"),
    ("loss-spike", {"verify": "6h"}, "training.test.yaml", "a spike that goes on firing after the rollback is "
     "ineffective", "outcome: expected ineffective, made pending"),
    ("loss-spike", {"dry_run": True}, "training.test.yaml", "a loss spike is cut once per episode, and it worked",
     "status: expected applied, made dry_run"),
    ("gpu-xid-error", {"approval": None}, "nodes.test.yaml", "an XID error a person rejects is not drained",
     "reject gpu-xid-error found no record of gpu-xid-error held for approval"),
    ("gpu-xid-error", {"approval_timeout": "8h"}, "nodes.test.yaml", "an XID error nobody approves within four "
     "hours expires", "status: expected expired, made pending_approval"),
    ("gpu-temperature-high", {"max_active": None}, "nodes.test.yaml", "a rack-wide heat alert throttles a quarter "
     "of the live nodes at most", "reason: expected breaker_open, made null"),
    ("gpu-temperature-high", {"resolve_timeout": "24h"}, "nodes.test.yaml", "a power limit is restored 12h after "
     "the last firing notification when no resolve comes", "expected, but not made"),
    ("loss-spike-ladder", {"escalate": None}, "ladder.test.yaml", "a spike that goes on is halved again after 10m, "
     "then checkpointed and stopped after 20m more", "expected, but not made"),
])
def test_a_shipped_test_fails_when_its_guard_is_gone(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     playbook: str, change: dict[str, Any], file: str, test: str,
                                                     says: str) -> None:
    tests = copy_shipped(tmp_path, playbook, change, "ladder.yaml" if file == "ladder.test.yaml" else "default.yaml")
    code, lines = run(capsys, "test", str(tests / file))
    assert code == 1
    failed = block(lines, test)
    assert failed[0].endswith(": FAILED") and any(says in line for line in failed), "\n".join(failed)


def test_a_test_of_conditions_no_step_has_any_more_is_invalid(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    tests = copy_shipped(tmp_path, "throughput-drop", {"actions": [
        {"reduce_dataloader_workers": {"factor": 0.5, "min": 1}, "optional": True},
        {"enable_gradient_accumulation": {"steps": 2}, "optional": True}]})
    code, lines = run(capsys, "test", str(tests / "training.test.yaml"))
    assert code == 2
    assert [line.split(": ", 1)[1] for line in lines] == [
        "no `when:` of these playbooks sends this query for these targets"] * 2


def test_an_approval_that_finds_nothing_held_fails_and_names_its_event(capsys: pytest.CaptureFixture[str],
                                                                       tmp_path: Path) -> None:
    path = tmp_path / "approve.test.yaml"
    path.write_text(f"""\
playbooks: [{SHIPPED}]
targets: [{{kind: job, name: llama-ft-01}}]
tests:
  - name: loss-spike is never held
    events:
      - {{at: 0s, firing: [{{alertname: TrainingLossSpike, job_name: llama-ft-01, severity: critical}}]}}
      - {{at: 5m, approve: loss-spike}}
    expect:
      - {{at: 0s, playbook: loss-spike, status: applied}}
""")
    code, lines = run(capsys, "test", str(path))
    assert code == 1
    assert lines[:2] == [f"{path}:4: test loss-spike is never held: FAILED",
                         "  event at 5m (line 7): approve loss-spike found no record of loss-spike held for approval"]


GOOD = f"""\
playbooks: [{SHIPPED}]
targets: [{{kind: job, name: llama-ft-01}}]
tests:
  - name: fine
    events:
      - {{at: 0s, firing: [{{alertname: TrainingLossSpike, job_name: llama-ft-01, severity: critical}}]}}
    expect: []
"""


@pytest.mark.parametrize(("text", "line", "says"), [
    (GOOD.replace("    expect: []", "    expcet: []"), 7,
     "unknown key 'expcet' in a test (did you mean expect? allowed:"),
    (GOOD.replace("at: 0s", "at: 10 minutes"), 6, "at: '10 minutes' is not a duration"),
    (GOOD.replace("      - {at: 0s", "      - {at: 5m, resolved: [{alertname: X}]}\n      - {at: 1m"), 7,
     "events go in time order: at 1m comes before the event above it (5m)"),
    (GOOD.replace("expect: []", "expect: [{playbook: loss-spikes}]"), 7,
     "playbook: no playbook named 'loss-spikes' in this test's playbooks (did you mean loss-spike?"),
    (GOOD.replace("severity: critical}", "severity: critical, gpu_id: 3}"), 6,
     'label gpu_id must be a string: quote it (gpu_id: "3")'),
    (GOOD.replace("kind: job", "kind: jobs"), 2, "a target's kind must be job or node (did you mean job?)"),
    (GOOD.replace("tests:", "tets:"), 3, "unknown key 'tets' in the file (did you mean tests?"),
    (GOOD + "    acks: sometimes\n", 8, "acks must be applied, failed or none, not 'sometimes'"),
    (GOOD.replace("expect: []", "expect: [{status: aplied}]"), 7, "status 'aplied' is not a record's status "
     "(did you mean applied?"),
    (GOOD + "    conditions: {'up{job=\"x\"} == 1': true}\n", 8,
     "no `when:` of these playbooks sends this query for these targets"),
    (GOOD.replace(f"playbooks: [{SHIPPED}]", "playbooks: [../nowhere]"), 1, "playbooks: no such file or folder: "),
    ("[1, 2]\n", 1, "the file must be a mapping"),
    ("playbooks: [x\n", 2, "invalid YAML"),
    ("", 1, "the file is empty"),
])
def test_an_invalid_test_file_says_where_and_nothing_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           text: str, line: int, says: str) -> None:
    path = tmp_path / "bad.test.yaml"
    path.write_text(text)
    other = tmp_path / "good.test.yaml"
    other.write_text(GOOD)
    code, lines = run(capsys, "test", str(tmp_path))
    assert code == 2
    assert f"{path}:{line}: {says}" in "\n".join(lines), lines
    assert all(x.startswith(f"{path}:") for x in lines), lines  # the good file's test did not run either


def test_a_condition_written_with_its_variable_left_in_gets_the_query_as_sent(capsys: pytest.CaptureFixture[str],
                                                                           tmp_path: Path) -> None:
    when = (SHIPPED / "tests" / "training.test.yaml").read_text().split("conditions:")[1].split("\n")
    path = tmp_path / "cond.test.yaml"
    body = "\n".join(when[1:3]).replace("gpu-b7", "$node")
    path.write_text(GOOD.replace("kind: job, name: llama-ft-01", "kind: job, name: llama-ft-01, node: gpu-b7")
                    + f"    conditions:\n{body}\n      : true\n")
    code, lines = run(capsys, "test", str(path))
    assert code == 2
    [said] = lines
    assert "(did you mean 1 - avg by (nodename)" in said and 'nodename="gpu-b7"' in said


def test_missing_paths_and_folders_without_tests_are_one_line_each(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    code, lines = run(capsys, "test", str(tmp_path / "nope.test.yaml"), str(tmp_path))
    assert code == 2
    assert lines == [f"{tmp_path / 'nope.test.yaml'}:0: no such file or folder",
                     f"{tmp_path}:0: no test files (*.test.yaml) in this folder"]


def test_a_bad_file_prints_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.test.yaml"
    path.write_text("tests: {not: a list}\nplaybooks: 3\n")
    out = subprocess.run([str(TRAINMEDIC), "test", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr == ""
    assert out.stdout.splitlines() == [f"{path}:1: tests must be a list",
                                       f"{path}:2: each item of playbooks (a file or folder) must be text"]


def test_junit_holds_a_case_per_test_and_the_diff_of_a_failure(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    path = tmp_path / "two.test.yaml"
    path.write_text(GOOD.replace("expect: []", "expect: [{status: applied}]")
                    + "  - name: wrong\n    events: []\n    expect: [{status: applied}]\n")
    report = tmp_path / "out" / "junit.xml"
    report.parent.mkdir()
    code, _ = run(capsys, "test", str(path), "--junit", str(report))
    assert code == 1
    suites = ElementTree.parse(report).getroot()
    assert (suites.tag, suites.get("tests"), suites.get("failures")) == ("testsuites", "2", "1")
    [suite] = suites
    cases = {c.get("name"): c for c in suite}
    assert cases["fine"].find("failure") is None
    failure = cases["wrong"].find("failure")
    assert failure is not None and "expected, but not made" in (failure.text or "")


def test_the_engine_gives_alerts_alertmanagers_fingerprints(redis_url: str) -> None:
    group = json.loads((FIXTURES / "firing_group.json").read_text())
    with scratch() as r:
        engine = Engine(r, load([SHIPPED]), [], 1_700_000_000.0)
        for sent in group["alerts"]:
            assert engine.alert(sent["labels"], True)["fingerprint"] == sent["fingerprint"]
        engine.close()


def test_tests_run_on_a_scratch_redis_and_never_touch_the_users(r: redis.Redis, redis_url: str,
                                                                capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    r.set("users-own-key", "kept")
    monkeypatch.setenv("TRAINMEDIC_REDIS_URL", redis_url)
    code, lines = run(capsys, "test", str(SHIPPED / "tests" / "ladder.test.yaml"))
    assert code == 0, lines
    assert r.keys("*") == ["users-own-key"]
    with scratch() as scratch_r:
        where = scratch_r.connection_pool.connection_kwargs["path"]
        scratch_r.set("x", "1")
        Engine(scratch_r, [], [Live(keys.Target("job", "a"))], 1_700_000_000.0).close()
    assert not Path(where).parent.exists()
    with pytest.raises(redis.ConnectionError):
        redis.Redis(unix_socket_path=where).ping()


def test_a_playbooks_notify_url_hears_nothing_from_a_test(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    hook = Receiver()
    try:
        (tmp_path / "held.yaml").write_text(f"""\
playbooks:
  - name: held
    matchers: ['alertname="X"']
    target: job
    actions: [{{scale_lr: {{factor: 0.5}}}}]
    approval: true
    notify: {hook.url}
""")
        (tmp_path / "held.test.yaml").write_text("""\
playbooks: [held.yaml]
targets: [{kind: job, name: a}]
tests:
  - name: held and expired
    events: [{at: 0s, firing: [{alertname: X, job_name: a}]}]
    until: 2h
    expect: [{at: 0s, playbook: held, status: expired, reason: approval_expired}]
""")
        code, lines = run(capsys, "test", str(tmp_path / "held.test.yaml"))
        assert code == 0, lines
        with scratch() as r:
            engine = Engine(r, load([tmp_path / "held.yaml"]), [Live(keys.Target("job", "a"))], 1_700_000_000.0)
            engine.notify(1_700_000_000.0, [{"alertname": "X", "job_name": "a"}])
            engine.close()
        assert [n.events for n in engine.notices.sent] == [("held",)]
        assert hook.bodies == []
    finally:
        hook.close()


def test_the_engine_leaves_out_only_steps_the_reconciler_still_has() -> None:
    # The engine's passes skip the history's upkeep and the epoch check, and a replay's follow-ups of what cannot
    # change a decision, by overriding these: a rename in the reconciler must rename them here too.
    from trainmedic.service.decide.detections import Detections
    from trainmedic.service.decide.reconciler import Reconciler

    for name in ("_retention", "_check_epoch", "_follow"):
        assert name in vars(Reconciler), name
    assert "scan_hangs" in vars(Detections) and "waiting" in vars(Detections)


def test_output_cut_short_by_its_reader_is_no_traceback() -> None:
    proc = subprocess.Popen([str(TRAINMEDIC), "test", "playbooks/tests/"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().endswith(b": ok\n")
    proc.stdout.close()  # as `| head -1` does
    assert proc.wait(timeout=300) == 141  # the next test's line found nobody reading
    assert proc.stderr.read() == b""
