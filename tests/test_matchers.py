"""Alertmanager matcher syntax."""
from __future__ import annotations

import pytest

from trainmedic.service.rules.matchers import MatcherError, parse_matcher

LABELS = {"alertname": "TrainingLossSpike", "severity": "critical", "job_name": "llama-ft-01"}


@pytest.mark.parametrize("text, expected", [
    ('alertname="TrainingLossSpike"', True),
    ('alertname="Other"', False),
    ("alertname=TrainingLossSpike", True),
    ('severity!="warning"', True),
    ('severity!="critical"', False),
    ('severity=~"critical|warning"', True),
    ('severity=~"crit"', False),  # regexes are anchored at both ends
    ('severity!~"info|debug"', True),
    ('job_name=~"llama-.*"', True),
    ('missing=""', True),  # an absent label is the empty string
    ('missing!=""', False),
    ('alertname = "TrainingLossSpike"', True),
    ('summary="say \\"hi\\""', False),
])
def test_matchers_follow_alertmanager_semantics(text: str, expected: bool) -> None:
    assert parse_matcher(text).matches(LABELS) is expected


def test_escaped_quotes_in_values_are_understood() -> None:
    assert parse_matcher('summary="say \\"hi\\""').value == 'say "hi"'


@pytest.mark.parametrize("text", ['alertname', '="x"', 'a=="x"', 'a=~"("', 'a="unclosed', 'a=x y', 3, None,
                                  '1abc="x"'])
def test_bad_matchers_are_refused(text: object) -> None:
    with pytest.raises(MatcherError):
        parse_matcher(text)
