"""`trainmedic replay`: what playbooks would have done with the alerts a real Prometheus remembers (a history
backfilled with promtool), through the same engine as `trainmedic test` (README: "Replaying last week")."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Iterator

import pytest

from trainmedic.service.cli import main
from trainmedic.service.playtest import episodes
from trainmedic.service.playtest.episodes import Episode, Window, runs
from trainmedic.service.playtest.replay import replay, shards
from trainmedic.service.prometheus import Prometheus, PrometheusError
from trainmedic.service.rules.playbooks import load

from tests.support.history import HistoricPrometheus, backfill

TRAINMEDIC = Path(sys.executable).parent / "trainmedic"
ROOT = Path(__file__).resolve().parent.parent
HOUR = 3600
# The history's start: a whole hour, a day ago (what replay reads is relative to --until, given below).
T0 = (int(time.time()) // HOUR) * HOUR - 24 * HOUR
UNTIL = str(T0 + 8 * HOUR)

SPIKE_A = {"alertname": "TrainingLossSpike", "job_name": "job-a", "severity": "critical"}
SPIKE_B = {"alertname": "TrainingLossSpike", "job_name": "job-b", "severity": "critical"}
SPIKE_C = {"alertname": "TrainingLossSpike", "job_name": "job-c", "severity": "warning"}
HOT = {"alertname": "GPUTemperatureHigh", "node": "gpu-a1", "gpu_id": "0"}
XID = {"alertname": "GPUXidError", "node": "gpu-a2", "xid_class": "drain"}
OTHER = {"alertname": "SomethingNoPlaybookMatches", "job_name": "job-a"}
# (labels, start, end) of each firing run: job-a's spikes 20 minutes apart, job-b's hours apart, job-c's for 45
# minutes (long enough for a ladder's stages).
HISTORY = [(SPIKE_A, T0 + m * 60, T0 + m * 60 + 120) for m in (0, 20, 40, 120)] + [
    (SPIKE_B, T0, T0 + 120), (SPIKE_B, T0 + 3 * HOUR, T0 + 3 * HOUR + 120), (SPIKE_C, T0 + 4 * HOUR, T0 + 5 * HOUR),
    (HOT, T0 + HOUR, T0 + HOUR + 600), (XID, T0 + 2 * HOUR, T0 + 2 * HOUR + 300), (OTHER, T0, T0 + 60)]

COOL = """\
playbooks:
  - name: loss-spike
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
    cooldown: %s
"""


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HistoricPrometheus]:
    work = tmp_path_factory.mktemp("history")
    server = HistoricPrometheus(work, backfill(work, HISTORY))
    yield server
    server.stop()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["replay", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_against_shows_exactly_the_episodes_a_cooldown_change_affects(prometheus: HistoricPrometheus,
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       tmp_path: Path) -> None:
    (tmp_path / "short.yaml").write_text(COOL % "10m")
    (tmp_path / "long.yaml").write_text(COOL % "1h")
    argv = ["--prometheus", prometheus.url, "--until", UNTIL, "--playbooks", str(tmp_path / "short.yaml"),
            "--against", str(tmp_path / "long.yaml")]
    code, out, err = cli(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    got = json.loads(out)
    assert got["playbooks"] == {"loss-spike": {"matched": 7, "dispatched": 7, "held": 0, "skipped": {}}}
    assert got["against"] == {"loss-spike": {"matched": 7, "dispatched": 5, "held": 0, "skipped": {"cooldown": 2}}}
    starts = [time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(T0 + m * 60)) for m in (20, 40)]
    assert got["changed"] == [
        {"alertname": "TrainingLossSpike", "target": "job:job-a", "starts_at": at, "before": "dispatched",
         "after": "skipped/cooldown"} for at in starts]
    assert got["episodes"] == 10 and got["series"] == 6
    code, out, _ = cli(capsys, *argv)
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("10 alert episodes of 6 series from ")
    assert lines[2:4] == ["PLAYBOOK    MATCHED  DISPATCHED  HELD  SKIPPED",
                          "loss-spike        7       7 → 5     0  cooldown 0 → 2"]
    assert lines[5:] == [f"2 decisions differ ({tmp_path / 'short.yaml'} → {tmp_path / 'long.yaml'}):"] + [
        f"  TrainingLossSpike  job:job-a  {at}: dispatched → skipped/cooldown" for at in starts]


def test_the_shipped_playbooks_replay_with_holds_the_breaker_and_cooldowns(prometheus: HistoricPrometheus,
                                                                            capsys: pytest.CaptureFixture[str]
                                                                            ) -> None:
    code, out, _ = cli(capsys, "--prometheus", prometheus.url, "--until", UNTIL, "--json")
    assert code == 0
    got = json.loads(out)
    tallies = {k: v for k, v in got["playbooks"].items() if v["matched"]}
    assert tallies == {
        "gpu-temperature-high": {"matched": 1, "dispatched": 1, "held": 0, "skipped": {}},
        "gpu-xid-error": {"matched": 1, "dispatched": 0, "held": 1, "skipped": {}},
        # 10m cooldown: job-a's spikes 20 minutes apart all go out; 3 a day: the fourth does not.
        "loss-spike": {"matched": 7, "dispatched": 6, "held": 0, "skipped": {"budget_exhausted": 1}},
    }
    assert got["changed"] == [] and "against" not in got


def test_a_week_at_30s_is_more_than_one_query_may_ask_and_is_read_in_chunks(prometheus: HistoricPrometheus) -> None:
    week = Window(float(UNTIL) - 7 * 86400, float(UNTIL), 30.0)
    with pytest.raises(PrometheusError, match="maximum resolution"):
        Prometheus(prometheus.url, timeout=30).query_range('ALERTS{alertstate="firing"}', week.start, week.end, 30,
                                                          limit=None)
    assert len(week.chunks()) == 3 and all((e - s) / 30 + 1 <= 10_000 for s, e in week.chunks())


def test_a_replay_in_parts_decides_as_one_in_a_single_process(prometheus: HistoricPrometheus) -> None:
    window = Window(float(UNTIL) - 7 * 86400, float(UNTIL), 30.0)
    found, _ = episodes.read(Prometheus(prometheus.url), window)
    shipped = load([ROOT / "playbooks"])
    parts = shards(found, shipped, 3)
    # The bounded playbooks (max_active) keep every episode of theirs; the others are split by target.
    assert {pb.name for pb in parts[0].playbooks} == {"gpu-temperature-high", "gpu-xid-error", "straggler"}
    assert len(parts) >= 2 and sorted(i for x in parts[1:] for i in x.episodes) == [
        i for i, ep in enumerate(found) if ep.alertname == "TrainingLossSpike"]
    one = replay(found, shipped, window, prometheus.url, workers=1)
    three = replay(found, shipped, window, prometheus.url, workers=3)
    assert {k: v.as_dict() for k, v in three.tallies.items()} == {k: v.as_dict() for k, v in one.tallies.items()}
    assert three.decisions == one.decisions and len(one.decisions) == 9


def test_leaving_out_follow_ups_that_change_no_decision_changes_no_decision(prometheus: HistoricPrometheus) -> None:
    window = Window(float(UNTIL) - 7 * 86400, float(UNTIL), 30.0)
    found, _ = episodes.read(Prometheus(prometheus.url), window)
    # The shipped playbooks (two with max_active), and a ladder whose stages count against its budget.
    ladder = load([ROOT / "playbooks" / "tests" / "ladder.yaml"])
    for playbooks in (load([ROOT / "playbooks"]), ladder):
        full = replay(found, playbooks, window, prometheus.url, prune=False)
        pruned = replay(found, playbooks, window, prometheus.url)
        assert pruned.decisions == full.decisions and full.decisions
        assert {k: v.as_dict() for k, v in pruned.tallies.items()} == {k: v.as_dict() for k, v in full.tallies.items()}


@pytest.mark.parametrize(("argv", "says"), [
    (["--since", "32d"], "--since must be longer than zero and at most 31d"),
    (["--since", "a week"], "--since and --step are durations"),
    (["--until", "yesterday"], "--until 'yesterday' is not an RFC 3339 time or seconds since the epoch"),
    (["--step", "500ms"], "--step must be at least 1s"),
    (["--since", "1h", "--until", str(T0 - 2 * HOUR)], "holds no ALERTS series between"),
    (["--playbooks", "/nonexistent/playbooks"], "invalid playbooks in /nonexistent/playbooks"),
])
def test_bad_flags_and_an_empty_window_are_one_line_and_exit_2(prometheus: HistoricPrometheus,
                                                               capsys: pytest.CaptureFixture[str],
                                                               argv: list[str], says: str) -> None:
    code, out, err = cli(capsys, "--prometheus", prometheus.url, *argv)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith("trainmedic: ") and says in line


def test_an_unreachable_prometheus_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from trainmedic.service.embedded_redis import free_port

    out = subprocess.run([str(TRAINMEDIC), "replay", "--prometheus", f"http://127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    [line] = out.stderr.splitlines()
    assert "cannot read ALERTS from http://127.0.0.1:" in line and "cannot be reached" in line


def test_an_unbroken_run_is_one_episode_resolved_a_step_after_its_last_sample() -> None:
    w = Window(0.0, 3000.0, 30.0)
    labels = {"alertname": "X"}
    assert runs(labels, [60, 90, 120, 300, 330, 2970, 3000], w) == [
        Episode(labels, 60, 150), Episode(labels, 300, 360), Episode(labels, 2970, None)]
    assert runs(labels, [0.0], w) == [Episode(labels, 0.0, 30.0)]
