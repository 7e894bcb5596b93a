"""The record's types: its statuses and reasons as StrEnums that the scripts, the API and the schema share."""
from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import ACK_STATUSES, Ack
from trainmedic.client.wire.redis import run_scripts
from trainmedic.client.wire.scripts import ack_calls
from trainmedic.client.wire.signing import Signer
from trainmedic.client.wire.status import (CODE_STATUS, ActionReason, ActionStatus, Mode, Outcome, Reason,
                                           RecordStatus)
from trainmedic.service.store import record as records, views
from trainmedic.service.store.scripts import Keyspace, verdict_call
from trainmedic.service.decide.dispatch import DispatchSettings, Dispatcher
from trainmedic.service.decide.plan import plan
from trainmedic.service.rules.alerts import parse_group
from trainmedic.service.rules.playbooks import load

from tests.conftest import ROOT, SIGNING_KEY, load_fixture

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
    props = views.SCHEMA["Record"]["properties"]
    assert props["status"]["enum"] == [s.value for s in RecordStatus]
    assert props["outcome"]["properties"]["status"]["enum"] == ["pending", "effective", "ineffective", "unknown"]
    assert views.SCHEMA["RecordAction"]["properties"]["status"]["enum"] == [s.value for s in ActionStatus]
    assert all(type(v) is str for v in props["status"]["enum"])  # plain strings in the published document
    for reason in Reason:
        assert reason in props["reason"]["description"]
    for name in ("webhook", "operator", "reconciler", "detector", "resync"):
        assert re.fullmatch(props["requested_by"]["pattern"], name)


def test_every_status_reason_and_outcome_the_scripts_write_is_a_member() -> None:
    text = lua_text()
    record_statuses = (set(re.findall(r"'HSET', \w+, 'status', '(\w+)'", text))
                       | set(re.findall(r"\bstatus = '(\w+)'", text)) | set(re.findall(r"finish\('(\w+)'", text)))
    record_statuses |= set(re.findall(r"status, reason = '(\w+)'", text))
    written = "\n".join(line for line in text.splitlines() if "'HMGET'" not in line)  # not what is read
    reasons = (set(re.findall(r"(?<!\.\. )'reason', '(\w+)'", written))
               | set(re.findall(r"^\s*(?:local )?reason = '(\w+)'", text, re.M))
               | set(re.findall(r"finish\('\w+', '(\w+)'", text)))
    reasons |= set(re.findall(r"status, reason(?:, \w+)? = '\w+', '(\w+)'", text))
    # An action's status is a code (lua/common.lua CODE): end_open, set_code and finish write them.
    ended = re.findall(r"end_open\(\w+, '(\w)', '(\w+)'", text)
    codes = ({c for c, _ in ended} | set(re.findall(r"set_code\(\w+, \w+, '(\w)'\)", text))
             | set(re.findall(r"finish\('\w+', '\w+', '(\w)'", text)))
    action_reasons = ({r for _, r in ended} | set(re.findall(r"reason = '(\w+)', result", text))
                      | set(re.findall(r"finish\('\w+', '(\w+)'", text)))
    outcomes = set(re.findall(r"\boutcome = '(\w+)'", text))
    lua_codes = dict(re.findall(r"(\w+) = '([A-Z])'", text.split("local CODE = {", 1)[1].split("}", 1)[0]))
    # Each pattern found what it looks for (so the checks below cannot pass by finding nothing).
    assert {"dispatched", "pending_approval", "skipped", "applied", "expired"} <= record_statuses
    assert {"cooldown", "budget_exhausted", "approval_expired", "tampered", "no_live_target",
            "mailbox_full"} <= reasons
    assert {"E", "S", "L"} <= codes and {"lost", "rejected", "expired"} <= action_reasons
    assert outcomes == {"unknown", "pending"}
    assert record_statuses <= set(RecordStatus), record_statuses - set(RecordStatus)
    assert reasons <= set(Reason), reasons - set(Reason)
    # The scripts' codes are the client's, one for each action status.
    assert {name: code for name, code in lua_codes.items()} == {s.value: c for c, s in CODE_STATUS.items()}
    assert codes <= set(CODE_STATUS) and action_reasons <= set(ActionReason)
    assert outcomes <= set(Outcome)


# -- StoredRecord: the hash parsed once ------------------------------------------------------------------

def decide(r, body: dict, **settings):
    dispatcher = Dispatcher(r, Signer.from_secret(SIGNING_KEY), DispatchSettings(**settings))
    return dispatcher.execute(plan(parse_group(body), load([ROOT / "playbooks"])))


def test_a_stored_record_reads_its_fields_once_and_shows_the_contracts_record(r) -> None:
    [o] = decide(r, load_fixture("firing_single.json"))
    rec = records.load(r, o.record_id)
    assert rec is not None and rec.id == o.record_id
    # Nothing heartbeats for the job in this test: the record says so while its command waits.
    assert (rec.status, rec.reason) == ("dispatched", Reason.NO_LIVE_TARGET)
    assert (rec.mode, rec.requested_by) == ("firing", "webhook")
    assert rec.playbook == o.playbook and rec.target == keys.target_of_record(o.record_id)
    assert [s.action for s in rec.steps] == [a["action"] for a in rec.as_dict()["actions"]]
    assert rec.n == len(rec.steps) >= 1 and (rec.stage, rec.parent, rec.next) == (0, None, None)
    assert rec.alert.fingerprint == load_fixture("firing_single.json")["alerts"][0]["fingerprint"]
    assert rec.actions[0].status == ActionStatus.PENDING and rec.actions[0].acked_at is None
    # as_dict is the API's record, field for field.
    assert rec.as_dict() == records.get(r, o.record_id)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.status = "applied"  # type: ignore[misc]


def test_a_stored_record_says_when_an_action_was_acknowledged(r) -> None:
    [o] = decide(r, load_fixture("firing_single.json"))
    before = records.load(r, o.record_id)
    assert before is not None
    at = "2026-01-02T03:04:05Z"
    acks = [Ack(o.record_id, i, st.action, "applied", {}, "host:1", acked_at=at) for i, st in enumerate(before.steps)]
    run_scripts(r, ack_calls(acks, time.time()))
    after = records.load(r, o.record_id)
    assert after is not None and after.status == RecordStatus.APPLIED
    assert [a.acked_at for a in after.actions] == [at] * after.n
    assert all(a.status == ActionStatus.APPLIED for a in after.actions)
    # The record read before is a snapshot: it does not change under the reader.
    assert before.status == RecordStatus.DISPATCHED and before.actions[0].acked_at is None


def test_a_gone_record_loads_as_none(r) -> None:
    assert records.load(r, "01HZZZZZZZZZZZZZZZZZZZZZZZ~job~nothing-here") is None


# -- the record as the API shows it, and its schema ----------------------------------------------------------

def test_the_record_schema_has_exactly_the_view_types_fields() -> None:
    # A field added to a view type is in the schema, and the schema has nothing the type does not show.
    for cls, name in views.COMPONENTS.items():
        fields = dataclasses.fields(cls)
        schema = views.SCHEMA[name]
        assert list(schema["properties"]) == [f.name for f in fields], name
        assert schema["required"] == [f.name for f in fields if f.default is dataclasses.MISSING], name
    props = views.SCHEMA["Record"]["properties"]
    for key, cls in (("outcome", views.OutcomeView), ("escalation", views.Escalation)):
        assert list(props[key]["properties"]) == [f.name for f in dataclasses.fields(cls)]
    # The keys a record shows only sometimes are neither required nor null.
    sometimes = {"detail", "on_resolved", "approval_expires_at", "expires_at"}
    assert sometimes == set(props) - set(views.SCHEMA["Record"]["required"])
    assert not any(props[k].get("nullable") for k in sometimes)
    assert set(views.SCHEMA["RecordAction"]["properties"]) - set(views.SCHEMA["RecordAction"]["required"]) == {
        "optional", "when"}


def conforms(value: object, schema: dict, where: str = "record") -> None:
    """Asserts that a JSON value is what an OpenAPI 3.0 schema of the record's components says."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        schema = views.SCHEMA.get(name) or {"type": "object", "required": ["kind", "name"]}  # Target
    if value is None:
        assert schema.get("nullable"), where
        return
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), where
        assert set(schema.get("required", ())) <= set(value), (where, set(schema.get("required", ())) - set(value))
        if "properties" in schema:
            assert set(value) <= set(schema["properties"]), (where, set(value) - set(schema["properties"]))
            for k, v in value.items():
                conforms(v, schema["properties"][k], f"{where}.{k}")
    elif kind == "array":
        assert isinstance(value, list), where
        for i, v in enumerate(value):
            conforms(v, schema["items"], f"{where}[{i}]")
    else:
        types = {"string": str, "integer": int, "number": (int, float), "boolean": bool}
        assert isinstance(value, types[kind]), (where, value)
        assert value in schema.get("enum", [value]), (where, value)
        assert re.search(schema.get("pattern", ""), str(value)), (where, value)


def alerts_of(name: str, **changes: Any) -> dict:
    """A fixture's notification with each alert's status and labels changed."""
    body = load_fixture(name)
    status = changes.pop("status", body["status"])
    body["status"] = status
    for a in body["alerts"]:
        a["status"], a["labels"] = status, {**a["labels"], **changes}
        if status == "resolved":
            a["endsAt"] = "2026-11-22T01:40:00Z"
    return body


def test_records_as_the_api_shows_them_are_what_the_schema_says(r) -> None:
    [o] = decide(r, load_fixture("firing_single.json"))
    made = [o, *decide(r, alerts_of("firing_single.json", job_name="../x"))]  # skipped: bad_label
    made += decide(r, alerts_of("firing_group.json"))
    made += decide(r, alerts_of("firing_group.json", status="resolved"))  # on_resolved
    made += decide(r, alerts_of("firing_group.json", alertname="GPUXidError", xid_class="drain"))  # held
    rec = records.load(r, o.record_id)
    assert rec is not None
    acks = [Ack(o.record_id, i, st.action, "applied", {"step": 1}, "host:1:0", acked_at="2026-01-02T03:04:05Z")
            for i, st in enumerate(rec.steps)]
    run_scripts(r, ack_calls(acks, time.time()))
    ks = Keyspace(r)
    assert ks.run([verdict_call(ks, o.record_id, Outcome.EFFECTIVE, "2026-01-02T03:09:05Z", 300.0)])[0] == 1
    shown = [records.get(r, m.record_id) for m in made]
    for one in shown:
        assert one is not None
        conforms(one, views.SCHEMA["Record"])
    # Every kind of record was shown, with each key the record shows only sometimes.
    assert {RecordStatus.APPLIED, RecordStatus.SKIPPED, RecordStatus.DISPATCHED, RecordStatus.PENDING_APPROVAL} <= {
        one["status"] for one in shown if one}
    assert {"on_resolved", "approval_expires_at", "expires_at"} <= {k for one in shown if one for k in one}
    applied = shown[0]
    assert applied is not None and applied["outcome"] == {
        "status": "effective", "resolved_at": "2026-01-02T03:09:05Z", "time_to_resolve_s": 300}
    assert applied["actions"][0]["result"] == {"step": 1} and applied["actions"][0]["acked_by"] == "host:1:0"
