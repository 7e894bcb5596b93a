"""Durations are bounded by their value, not by how many digits a term has; the error names the exact maximum."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmedic.client.wire.actions import CATALOGUE, ParamError
from trainmedic.client.wire import durations
from trainmedic.client.wire.durations import HINT, MAX_SECONDS, PATTERN, POSITIVE, parse_duration
from trainmedic.service.rules.playbooks import check

from tests.conftest import post_json

DAY = 86400
TOO_LONG = "is too long: the longest duration allowed is 3650d (315360000 seconds)"


@pytest.mark.parametrize(("text", "seconds"), [
    ("1000d", 1000 * DAY),              # 2.7 years, in four digits
    ("3650d", 3650 * DAY),              # the maximum, however it is written
    ("10y", 3650 * DAY),
    ("521w3d", 3650 * DAY),
    ("87600h", 3650 * DAY),
    ("5256000m", 3650 * DAY),
    ("315360000s", 3650 * DAY),
    ("315360000000ms", 3650 * DAY),
    ("3649d23h60m", 3650 * DAY),
    ("9y364d86399s", 3650 * DAY - 1),
    ("1500ms", 1.5),
    ("1h30m", 5400),
    ("0s", 0),
])
def test_any_duration_up_to_the_maximum_is_accepted(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["3651d", "11y", "10y1ms", "315360001s", "315360000001ms", "522w",
                                  "9y9y9y", "9999999999999s", "1" + "0" * 5000 + "ms"])
def test_a_duration_over_the_maximum_is_refused_naming_the_maximum(text: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_duration(text)
    assert str(err.value) == f"duration {text!r} {TOO_LONG}"


@pytest.mark.parametrize("text", ["7days", "10 minutes", "007d", "1h1m1s1ms", "-1d", "1.5h", "d", ""])
def test_what_is_not_a_duration_gets_the_hint_with_the_maximum(text: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_duration(text)
    assert str(err.value) == f"{text!r} is not a duration ({HINT})"
    assert "3650d" in HINT and "years" not in HINT


def test_a_plain_number_of_seconds_is_bounded_by_the_same_maximum() -> None:
    assert parse_duration(315360000) == MAX_SECONDS == 3650 * DAY
    with pytest.raises(ValueError) as err:
        parse_duration(315360000.5)
    assert str(err.value) == "duration 315360000.5 must be from 0 to 315360000 seconds (3650d)"


def test_disk_cleanup_takes_older_than_1000d() -> None:
    assert CATALOGUE["disk_cleanup"].parse({"older_than": "1000d"}).older_than == 1000 * DAY
    with pytest.raises(ParamError) as err:
        CATALOGUE["disk_cleanup"].parse({"older_than": "3651d"})
    assert str(err.value) == f"older_than: duration '3651d' {TOO_LONG}"


def test_a_playbook_with_long_durations_passes_check_and_one_over_the_maximum_does_not(tmp_path: Path) -> None:
    path = tmp_path / "long.yaml"
    path.write_text("playbooks:\n  - name: disk\n    matchers: ['alertname=\"DiskSpaceLow\"']\n    target: node\n"
                    "    actions:\n      - disk_cleanup: {keep_last: 3, older_than: 1000d}\n"
                    "    cooldown: 1000d\n    max_runs: {count: 1, per: 3650d}\n")
    [playbook], problems = check([path])
    assert problems == []
    assert playbook.cooldown == 1000 * DAY and playbook.actions[0].params["older_than"] == "1000d"
    path.write_text(path.read_text().replace("older_than: 1000d", "older_than: 3651d"))
    _, problems = check([path])
    assert problems == [f"{path}:6: disk_cleanup: older_than: duration '3651d' {TOO_LONG}"]


def test_the_api_takes_a_long_duration_and_refuses_one_over_the_maximum_in_one_sentence(http) -> None:
    ok = post_json(http, "/commands", {"target": "node:gpu-node-1", "action": "disk_cleanup",
                                       "params": {"older_than": "1000d"}, "expire_after": "1000d"})
    assert ok.status_code == 201, ok.get_json()
    assert ok.get_json()["actions"][0]["params"] == {"older_than": "1000d"}
    bad = post_json(http, "/commands", {"target": "node:gpu-node-1", "action": "disk_cleanup",
                                        "params": {"older_than": "1001w"}})
    assert bad.status_code == 400
    assert bad.get_json() == {"error": f"bad parameters for disk_cleanup: older_than: duration '1001w' {TOO_LONG}"}


# -- the OpenAPI document's patterns: whatever they match, the service accepts


def test_the_count_regex_matches_exactly_one_to_n() -> None:
    for n in (1, 9, 10, 99, 100, 173, 521, 1216, 3650, 29200, 87600):
        regex = re.compile(durations._at_most(n))
        near = [*range(n + 1000), n * 10, n * 10 + 1, n * 100]
        assert [i for i in near if regex.fullmatch(str(i))] == list(range(1, n + 1)), n
        assert not regex.fullmatch("0" + str(n))


@pytest.mark.parametrize("text", ["1000d", "3650d", "10y", "521w", "87600h", "5256000m", "315360000s",
                                  "315360000000ms", "1216d1216d1216d", "1h30m", "3y173w"])
def test_the_schema_pattern_admits_every_single_term_up_to_the_maximum_and_short_sums(text: str) -> None:
    assert re.fullmatch(POSITIVE, text) and re.fullmatch(PATTERN, text)
    parse_duration(text)


@pytest.mark.parametrize("text", ["3651d", "11y", "522w", "315360001s", "1217d1d", "0s0s", "007d"])
def test_the_schema_pattern_refuses_what_it_cannot_vouch_for(text: str) -> None:
    assert not re.fullmatch(POSITIVE, text) and not re.fullmatch(PATTERN, text)


def test_zero_is_a_duration_but_not_a_positive_one() -> None:
    assert re.fullmatch(PATTERN, "0s") and not re.fullmatch(POSITIVE, "0s")
    assert parse_duration("0s") == 0


@settings(max_examples=300, deadline=None)
@given(st.from_regex(PATTERN, fullmatch=True))
def test_every_text_the_schema_pattern_matches_is_accepted(text: str) -> None:
    assert 0 <= parse_duration(text) <= MAX_SECONDS
