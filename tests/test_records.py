"""The record's types: its statuses and reasons as StrEnums that the scripts, the API and the schema share."""
from __future__ import annotations

import json
import re
from pathlib import Path

from trainmedic.client.wire import records
from trainmedic.client.wire.protocol import ACK_STATUSES
from trainmedic.client.wire.records import ActionReason, ActionStatus, Mode, Outcome, Reason, RecordStatus

LUA = Path(__file__).resolve().parents[1] / "client" / "wire" / "lua"


def lua_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(LUA.glob("*.lua")))


def test_a_status_equals_its_string_in_json_and_in_comparisons() -> None:
    assert RecordStatus.DISPATCHED == "dispatched" and "pending_approval" == RecordStatus.PENDING_APPROVAL
    assert json.dumps({"status": RecordStatus.DRY_RUN, "outcome": Outcome.EFFECTIVE}) == (
        '{"status": "dry_run", "outcome": "effective"}')
    assert f"{Reason.NO_LIVE_TARGET}" == "no_live_target" and str(Mode.STAGE) == "stage"


def test_final_and_open_statuses() -> None:
    assert [s for s in RecordStatus if not s.final] == ["pending_approval", "dispatched"]
    assert [s for s in ActionStatus if s.open] == ["pending", "delivered"]


def test_an_action_takes_every_status_an_ack_may_carry() -> None:
    assert set(ACK_STATUSES) <= set(ActionStatus)
    assert set(ActionStatus) - set(ACK_STATUSES) == {"pending", "delivered", "lost"}


def test_the_schema_enums_come_from_the_enums() -> None:
    props = records.SCHEMA["Record"]["properties"]
    assert props["status"]["enum"] == [s.value for s in RecordStatus]
    assert props["outcome"]["properties"]["status"]["enum"] == ["pending", "effective", "ineffective", "unknown"]
    assert records.SCHEMA["RecordAction"]["properties"]["status"]["enum"] == [s.value for s in ActionStatus]
    assert all(type(v) is str for v in props["status"]["enum"])  # plain strings in the published document
    for reason in Reason:
        assert reason in props["reason"]["description"]
    for name in ("webhook", "operator", "reconciler", "detector", "resync"):
        assert re.fullmatch(props["requested_by"]["pattern"], name)


def test_every_status_reason_and_outcome_the_scripts_write_is_a_member() -> None:
    text = lua_text()
    record_statuses = (set(re.findall(r"'HSET', \w+, 'status', '(\w+)'", text))
                       | set(re.findall(r"\bstatus = '(\w+)'", text)))
    record_statuses |= set(re.findall(r"status, reason = '(\w+)'", text))
    reasons = (set(re.findall(r"(?<!\.\. )'reason', '(\w+)'", text))
               | set(re.findall(r"^\s*(?:local )?reason = '(\w+)'", text, re.M)))
    reasons |= set(re.findall(r"status, reason = '\w+', '(\w+)'", text))
    action = re.findall(r"end_open\(\w+, '(\w+)', '(\w+)'", text)
    action_statuses = ({s for s, _ in action} | set(re.findall(r"astatus = '(\w+)'", text))
                       | set(re.findall(r"p \.\. 'status', '(\w+)'", text)))
    action_reasons = {r for _, r in action} | set(re.findall(r"p \.\. 'reason', '(\w+)'", text))
    outcomes = set(re.findall(r"\bo = '(\w+)'", text))
    # Each pattern found what it looks for (so the checks below cannot pass by finding nothing).
    assert {"dispatched", "pending_approval", "skipped", "applied", "expired"} <= record_statuses
    assert {"cooldown", "budget_exhausted", "approval_expired", "tampered", "no_live_target"} <= reasons
    assert {"expired", "skipped", "pending", "delivered", "lost"} <= action_statuses
    assert {"lost", "rejected"} <= action_reasons
    assert outcomes == {"unknown", "pending"}
    assert record_statuses <= set(RecordStatus), record_statuses - set(RecordStatus)
    # A script's status of an action (p .. 'status') is an action status; a record's reason a Reason.
    assert reasons <= set(Reason), reasons - set(Reason)
    assert action_statuses <= set(ActionStatus) and action_reasons <= set(ActionReason)
    assert outcomes <= set(Outcome)
