"""Parsing Alertmanager payloads into frozen dataclasses."""
from __future__ import annotations

import dataclasses

import pytest

from trainmedic.service.rules.alerts import parse_group
from trainmedic.service.errors import BadRequest

from tests.conftest import load_fixture


@pytest.mark.parametrize("name", ["firing_single.json", "firing_group.json", "resolved.json"])
def test_every_captured_payload_parses(name: str) -> None:
    body = load_fixture(name)
    group = parse_group(body)
    assert len(group.alerts) == len(body["alerts"])
    for alert, raw in zip(group.alerts, body["alerts"]):
        assert alert.fingerprint == raw["fingerprint"]
        assert dict(alert.labels) == raw["labels"]
        assert alert.status == raw["status"]


def test_alerts_are_frozen() -> None:
    alert = parse_group(load_fixture("firing_single.json")).alerts[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        alert.status = "resolved"  # type: ignore[misc]
    with pytest.raises(TypeError):
        alert.labels["job_name"] = "other"  # type: ignore[index]


def test_resolved_and_firing_of_one_episode_share_the_episode_start() -> None:
    # The resolved notification carries startsAt without nanoseconds (see fixtures/README.md).
    firing = parse_group(load_fixture("firing_single.json")).alerts[0]
    resolved = parse_group(load_fixture("resolved.json")).alerts[0]
    assert firing.starts_at != resolved.starts_at
    assert firing.episode_start == resolved.episode_start == "2026-11-22T01:25:24Z"


def test_time_offsets_are_normalised_to_utc() -> None:
    body = load_fixture("firing_single.json")
    body["alerts"][0]["startsAt"] = "2026-11-22T02:25:24.5+01:00"
    assert parse_group(body).alerts[0].episode_start == "2026-11-22T01:25:24Z"


def test_grouped_alerts_keep_their_own_labels() -> None:
    group = parse_group(load_fixture("firing_group.json"))
    assert [a.labels["instance"] for a in group.alerts] == ["gpu-node-01:9445", "gpu-node-02:9445"]


def test_a_missing_fingerprint_is_derived_from_the_labels() -> None:
    body = load_fixture("firing_single.json")
    del body["alerts"][0]["fingerprint"]
    first = parse_group(body).alerts[0].fingerprint
    assert first == parse_group(body).alerts[0].fingerprint and len(first) == 16


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b.update(alerts="x"), "alerts must be a list"),
    (lambda b: b.update(version="3"), "version"),
    (lambda b: b["alerts"][0].update(status="weird"), "status"),
    (lambda b: b["alerts"][0].update(labels={"alertname": 3}), "labels"),
    (lambda b: b["alerts"][0]["labels"].pop("alertname"), "alertname"),
    (lambda b: b["alerts"][0].update(startsAt="yesterday"), "startsAt"),
    (lambda b: b["alerts"][0].update(fingerprint="../../etc"), "fingerprint"),
    (lambda b: b["alerts"][0].update(annotations=[]), "annotations"),
    (lambda b: b.update(receiver=5), "receiver"),
    (lambda b: b["alerts"][0].update(fingerprint="071ff15f8faead0f\n"), "fingerprint"),
    (lambda b: b["alerts"][0].update(startsAt="٢٠٢٦-11-22T01:25:24Z"), "startsAt"),
])
def test_malformed_payloads_are_refused_with_one_sentence(mutate, message: str) -> None:
    body = load_fixture("firing_single.json")
    mutate(body)
    with pytest.raises(BadRequest) as exc:
        parse_group(body)
    assert message in exc.value.message and "\n" not in exc.value.message


@pytest.mark.parametrize("text", ["2026-13-01T00:00:00Z", "2026-02-30T00:00:00Z", "2026-01-01T25:00:00Z",
                                  "2026-01-01T00:00:00+01:00:00", "2026-01-01 00:00:00Z"])
def test_impossible_or_malformed_times_are_refused(text: str) -> None:
    body = load_fixture("firing_single.json")
    body["alerts"][0]["startsAt"] = text
    with pytest.raises(BadRequest):
        parse_group(body)


def test_negative_offsets_are_normalised_too() -> None:
    body = load_fixture("firing_single.json")
    body["alerts"][0]["startsAt"] = "2026-11-21T20:25:24-05:00"
    assert parse_group(body).alerts[0].episode_start == "2026-11-22T01:25:24Z"
