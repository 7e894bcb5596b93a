"""`trainmedic check`: every kind of broken playbook file gives its FILE:LINE: message; shipped ones pass."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainmedic.service.app import create_app
from trainmedic.service.cli import main
from trainmedic.client.wire.actions import CATALOGUE
from trainmedic.service.rules.playbooks import _FIELDS, SHIPPED, PlaybookError, check, load

from tests.conftest import ROOT, SIGNING_KEY
from trainmedic.client.wire.durations import HINT

# The lists the messages name, as the catalogue and the playbook loader hold them.
KNOWN = ", ".join(sorted(CATALOGUE))
FIELDS = ", ".join(_FIELDS)


def pb(body: str, name: str = "p", target: str = "job", matchers: str = "['alertname=\"X\"']") -> str:
    """One playbook; `body` lines follow `target:` (line 5 is the first line of body)."""
    return f"playbooks:\n  - name: {name}\n    matchers: {matchers}\n    target: {target}\n{body}"


# (file text, [(line, message)]) — the exact messages a user sees.
BROKEN = {
    "unknown action": (
        pb("    actions:\n      - explode: {}\n"),
        [(6, f"unknown action 'explode' (known: {KNOWN})")]),
    "unknown parameter": (
        pb("    actions:\n      - scale_lr: {factr: 0.5}\n"),
        [(6, "scale_lr has no parameter 'factr' (did you mean factor? allowed: factor, min_lr)")]),
    "parameters of an action without any": (
        pb("    actions:\n      - empty_cache: {all: true}\n"),
        [(6, "empty_cache has no parameter 'all' (allowed: none)")]),
    "ill-typed parameter": (
        pb("    actions:\n      - scale_lr: {factor: half}\n"),
        [(6, "scale_lr: factor must be a number, not 'half'")]),
    "parameter out of range": (
        pb("    actions:\n      - scale_lr:\n          factor: 20\n"),
        [(7, "scale_lr: factor must be <= 10, not 20")]),
    "missing parameter": (
        pb("    actions:\n      - set_lr: {}\n"),
        [(6, "set_lr needs parameter 'lr'")]),
    "both watts and fraction": (
        pb("    actions:\n      - power_limit: {watts: 250, fraction: 0.5}\n", target="node"),
        [(6, "power_limit needs exactly one of 'watts' or 'fraction'")]),
    "a path as a cleanup pattern": (
        pb("    actions:\n      - disk_cleanup: {patterns: ['../*.pt']}\n", target="node"),
        [(6, "disk_cleanup: patterns: pattern '../*.pt' must name an entry, not a path")]),
    "bad cleanup duration": (
        pb("    actions:\n      - disk_cleanup: {older_than: 7days}\n", target="node"),
        [(6, f"disk_cleanup: older_than: '7days' is not a duration ({HINT})")]),
    "node action in a job playbook": (
        pb("    actions:\n      - scale_lr: {factor: 0.5}\n      - power_limit: {fraction: 0.8}\n"),
        [(7, "action power_limit runs on a node, but this playbook targets a job")]),
    "job action in a node playbook's on_resolved": (
        pb("    actions: [{power_limit: {fraction: 0.8}}]\n    on_resolved:\n      - empty_cache: {}\n", target="node"),
        [(7, "action empty_cache runs on a job, but this playbook targets a node")]),
    "bad matcher regex": (
        pb("    actions: []\n", matchers="['alertname=~\"(X\"']"),
        [(3, "bad matcher 'alertname=~\"(X\"': invalid regular expression (missing ), unterminated subpattern "
             "at position 0)")]),
    "bad matcher syntax": (
        pb("    actions: []\n", matchers="\n      - severity==\"x\"\n      - just-a-word"),
        [(4, "bad matcher 'severity==\"x\"': quote the value with double quotes"),
         (5, "bad matcher 'just-a-word': expected name=\"value\", name!=\"value\", name=~\"re\" or name!~\"re\"")]),
    "no matchers": (
        pb("    actions: []\n", matchers="[]"),
        [(3, "matchers must be a non-empty list like - alertname=\"GPUTemperatureHigh\"")]),
    "bad cooldown": (
        pb("    actions: []\n    cooldown: 10 minutes\n"),
        [(6, f"cooldown: '10 minutes' is not a duration ({HINT})")]),
    "a duration too long": (
        pb("    actions: []\n    cooldown: 3651d\n"),
        [(6, "cooldown: duration '3651d' is too long: the longest duration allowed is 3650d (315360000 seconds)")]),
    "bad budget window": (
        pb("    actions: []\n    max_runs: {count: 3, per: forever}\n"),
        [(6, f"max_runs.per: 'forever' is not a duration ({HINT})")]),
    "budget of zero": (
        pb("    actions: []\n    max_runs: {count: 0, per: 1h}\n"),
        [(6, "max_runs.count must be an integer >= 1")]),
    "zero expiry": (
        pb("    actions: []\n    expire_after: 0s\n    approval_timeout: 0\n"),
        [(6, "expire_after must be longer than zero"), (7, "approval_timeout must be longer than zero")]),
    "approval not a boolean": (
        pb("    actions: []\n    approval: maybe\n"),
        [(6, "approval must be true or false")]),
    "unknown field": (
        pb("    actions: []\n    cooldwn: 10m\n"),
        [(6, f"unknown playbook field 'cooldwn' (did you mean cooldown? allowed: {FIELDS})")]),
    "bad target": (
        pb("    actions: []\n", target="gpu"),
        [(4, "target must be 'job' or 'node', not 'gpu'")]),
    "missing target": (
        "playbooks:\n  - name: p\n    matchers: ['alertname=\"X\"']\n    actions: []\n",
        [(2, "playbook is missing 'target'")]),
    "duplicate name": (
        pb("    actions: []\n") + "  - name: p\n    matchers: ['alertname=\"Y\"']\n    target: job\n",
        [(6, "duplicate playbook name 'p' (first at {file}:2)")]),
    "duplicate name after an invalid first": (
        pb("    actions: [{explode: {}}]\n") + "  - name: p\n    matchers: ['alertname=\"Y\"']\n    target: job\n",
        [(5, f"unknown action 'explode' (known: {KNOWN})"), (6, "duplicate playbook name 'p' (first at {file}:2)")]),
    "duplicate key": (
        pb("    actions: []\n    cooldown: 1m\n    cooldown: 2m\n"),
        [(7, "duplicate key 'cooldown' in a playbook")]),
    "unknown top-level key": (
        "playbook:\n  - name: p\n",
        [(1, "unknown top-level key 'playbook' (expected `playbooks:`)")]),
    "invalid YAML": (
        "playbooks:\n  - name: p\n   matchers: [\n",
        [(3, "invalid YAML: expected <block end>, but found '<block mapping start>'")]),
    "empty file": (
        "",
        [(1, "the file is empty; expected a top-level `playbooks:` list")]),
    "not a list": (
        "playbooks: {name: p}\n",
        [(1, "playbooks must be a list")]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_playbook_file_gives_its_expected_messages(case: str, tmp_path: Path) -> None:
    text, expected = BROKEN[case]
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    _, problems = check([path])
    assert problems == [f"{path}:{line}: {msg.format(file=path)}" for line, msg in expected]


@pytest.mark.parametrize("case", ["unknown action", "node action in a job playbook", "bad matcher syntax"])
def test_the_cli_prints_each_problem_and_exits_1(case: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN[case][0])
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{path}:{line}: {msg}" for line, msg in BROKEN[case][1]]


def test_problems_of_several_files_are_all_reported_with_duplicates_across_files(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.yaml").write_text(pb("    actions: []\n"))
    (tmp_path / "b.yml").write_text(pb("    actions: [{explode: {}}]\n", name="q") + pb("    actions: []\n")[11:])
    (tmp_path / "notes.txt").write_text("not a playbook")
    assert main(["check", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{tmp_path / 'b.yml'}:5: unknown action 'explode' (known: {KNOWN})",
                   f"{tmp_path / 'b.yml'}:6: duplicate playbook name 'p' (first at {tmp_path / 'a.yaml'}:2)"]


def test_a_path_that_does_not_exist_fails_without_a_line_number(tmp_path: Path, capsys) -> None:
    assert main(["check", str(tmp_path / "nope.yaml")]) == 1
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'nope.yaml'}: no such file or folder"
    (tmp_path / "empty").mkdir()
    assert main(["check", str(tmp_path / "empty")]) == 1
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'empty'}: no playbook files (*.yaml) found"


def test_a_misspelt_field_beside_an_action_gets_the_near_one_and_the_action_is_still_checked(
        tmp_path: Path, capsys) -> None:
    path = tmp_path / "pb.yaml"
    path.write_text(pb("    actions:\n      - rollback_checkpoint: {}\n        optinal: true\n"
                       "      - scale_lr: {factor: 99}\n        whne: 'up == 1'\n"))
    assert main(["check", str(path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{path}:7: unknown field 'optinal' in an item of actions: did you mean optional? (an item is one action, "
        "with optional: or when: beside it)",
        f"{path}:8: scale_lr: factor must be <= 10, not 99",
        f"{path}:9: unknown field 'whne' in an item of actions: did you mean when? (an item is one action, "
        "with optional: or when: beside it)"]


def test_every_shipped_playbook_passes(capsys) -> None:
    assert main(["check"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    files = sorted(SHIPPED.glob("*.y*ml"))
    playbooks = load(files)
    assert out == [f"ok: {len(playbooks)} playbooks in {len(files)} file{'s' * (len(files) != 1)}"]
    for f in files:
        assert check([f])[1] == [], f
    assert {p.name for p in playbooks} >= {"gpu-temperature-high", "gpu-memory-high", "loss-spike", "disk-space-low",
                                           "throughput-drop"}


def test_the_check_command_runs_as_a_console_script_and_exits_nonzero(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN["unknown action"][0])
    bad = subprocess.run([sys.executable, "-m", "trainmedic.service.cli", "check", str(path)], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    good = subprocess.run([sys.executable, "-m", "trainmedic.service.cli", "check", str(ROOT / "playbooks")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 1 and bad.stdout.startswith(f"{path}:6: unknown action 'explode'")
    assert good.returncode == 0 and good.stdout.startswith("ok: ")


def test_the_service_refuses_to_start_with_invalid_playbooks(tmp_path: Path, redis_url: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN["bad matcher syntax"][0])
    with pytest.raises(PlaybookError) as err:
        create_app({"TESTING": True, "redis_url": redis_url, "playbooks": str(path), "signing_key": SIGNING_KEY})
    assert len(err.value.problems) == 2
    assert str(err.value) == f"{path}:4: bad matcher 'severity==\"x\"': quote the value with double quotes (and 1 more)"


def test_trainmedic_serve_says_why_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN["node action in a job playbook"][0])
    out = subprocess.run([sys.executable, "-m", "trainmedic.service.cli", "serve", "--playbooks", str(path),
                          "--no-agent", "--port", "1", "--data-dir", str(tmp_path / "data")], capture_output=True,
                         text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"trainmedic: invalid playbooks: {path}:7: action power_limit runs on a node, but this playbook targets a job"]
    assert not (tmp_path / "data").exists()  # refused before starting anything


def test_one_file_reports_every_problem_a_misspelt_field_does_not_hide_the_others(tmp_path: Path, capsys) -> None:
    path = tmp_path / "typos.yaml"
    path.write_text("playbooks:\n  - name: p\n    matcher: ['alertname=\"X\"']\n    target: job\n"
                    "    actions:\n      - scale_lrr: {factor: 0.5}\n    cooldown: 10mins\n"
                    "  - name: q\n    matchers: ['alertname=\"Y\"']\n    target: job\n"
                    "    actions:\n      - scale_lr: {factor: 50}\n"
                    "    escalate:\n      - after: 10m\n        actions: [{scale_lr: {factor: 0.5}}]\n")
    assert main(["check", str(path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{path}:3: unknown playbook field 'matcher' (did you mean matchers? allowed: {FIELDS})",
        f"{path}:6: unknown action 'scale_lrr' (did you mean scale_lr? known: {KNOWN})",
        f"{path}:7: cooldown: '10mins' is not a duration ({HINT})",
        # Its only action's parameter is what is wrong: not "escalate needs actions".
        f"{path}:12: scale_lr: factor must be <= 10, not 50",
    ]


def test_every_bad_parameter_of_an_action_is_reported_on_its_own_line(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(pb("    actions:\n      - scale_lr:\n          factor: 50\n          min_lr: -1\n"
                       "          bogus: 1\n      - set_lr: {}\n        optional: maybe\n"))
    assert check([path])[1] == [
        f"{path}:7: scale_lr: factor must be <= 10, not 50",
        f"{path}:8: scale_lr: min_lr must be >= 0, not -1",
        f"{path}:9: scale_lr has no parameter 'bogus' (allowed: factor, min_lr)",
        f"{path}:10: set_lr needs parameter 'lr'",
        f"{path}:11: optional must be true or false",
    ]


def test_a_playbook_missing_its_target_still_has_its_other_fields_checked(tmp_path: Path) -> None:
    path = tmp_path / "no-target.yaml"
    path.write_text("playbooks:\n  - name: bad name!\n    matchers: ['alertname=~\"(X\"']\n"
                    "    actions: [{explode: {}}]\n    approval: maybe\n")
    assert check([path])[1] == [
        f"{path}:2: playbook is missing 'target'",
        f"{path}:2: name must be 1 to 64 letters, digits, '_', '.' or '-'",
        f"{path}:3: bad matcher 'alertname=~\"(X\"': invalid regular expression (missing ), unterminated "
        "subpattern at position 0)",
        f"{path}:4: unknown action 'explode' (known: {KNOWN})",
        f"{path}:5: approval must be true or false",
    ]


def test_every_file_is_reported_in_one_run(tmp_path: Path, capsys) -> None:
    for name, body in (("a.yaml", "    actions: [{explode: {}}]\n"), ("b.yaml", "    cooldown: soon\n")):
        (tmp_path / name).write_text(pb(body, name=name[0]))
    assert main(["check", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{tmp_path / 'a.yaml'}:5: unknown action 'explode' (known: {KNOWN})",
        f"{tmp_path / 'b.yaml'}:5: cooldown: 'soon' is not a duration ({HINT})",
    ]
