"""A keyspace version 3 made (tests/fixtures/v3_keyspace.json, written by make_v3_keyspace.py), written into a
test's Redis as live as when it was saved: its absolute deadlines move forward by the time since."""
from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmedic.client.wire import keys

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "v3_keyspace.json"
# A record's deadlines (ms) that its seal does not cover; version 3's `verify_ms` is a duration.
_RECORD_DEADLINES = ("approve_by", "expires_ms")


@dataclass(frozen=True)
class V3Keyspace:
    """What the fixture holds besides its keys: when it was saved, what made it, and what version 3 showed."""

    saved_at_ms: int
    shift_ms: int  # how far its deadlines moved forward
    playbooks: str  # the playbooks' YAML
    alerts: dict[str, dict[str, Any]]  # the notifications sent, by name (webhook bodies)
    records: dict[str, str]  # record ids by name: applied, followed, dispatched, held
    history: list[dict[str, Any]]  # GET /history's items, as version 3 answered
    remediations: dict[str, dict[str, Any]]  # GET /remediations/<id>, as version 3 answered
    keys: dict[str, dict[str, Any]]  # every key as saved: type, value, pttl

    def target(self, name: str) -> keys.Target:
        return keys.target_of_record(self.records[name])


def _bytes(value: Any) -> Any:
    return base64.b64decode(value["base64"]) if isinstance(value, dict) else value


def _shifted(key: str, kind: str, value: Any, shift_ms: int) -> Any:
    """A saved value with its absolute times moved forward by shift_ms."""
    if key == keys.APPROVALS:  # seconds, in version 3
        return [[m, s + shift_ms / 1000] for m, s in value]
    if kind == "zset" and (key == keys.DUE or key.endswith("}:due")):
        return [[m, s + shift_ms] for m, s in value]
    if kind == "hash" and ":playbook:" in key:  # a playbook's state: its cooldown's end, its budget's runs
        value = dict(value)
        if value.get("cool"):
            value["cool"] = str(int(value["cool"]) + shift_ms)
        if value.get("runs"):
            value["runs"] = " ".join(str(int(t) + shift_ms) for t in value["runs"].split())
        return value
    if kind == "hash" and ":rec:" in key:
        return {f: str(int(v) + shift_ms) if f in _RECORD_DEADLINES and v else v for f, v in value.items()}
    return value


def load(r: Any, fixture: Path = FIXTURE) -> V3Keyspace:
    """Write the saved keyspace into r (which must be empty) and say what it holds."""
    saved = json.loads(fixture.read_text())
    shift_ms = int(time.time() * 1000) - int(saved["saved_at_ms"])
    if shift_ms < 0:  # its expired command would be valid again, its deadlines earlier than when saved
        raise ValueError(f"this machine's clock is behind the time {fixture.name} was saved at")
    pipe = r.pipeline(transaction=False)
    for key, item in saved["keys"].items():
        kind, value = item["type"], _shifted(key, item["type"], item["value"], shift_ms)
        if kind == "string":
            pipe.set(key, _bytes(value))
        elif kind == "hash":
            pipe.hset(key, mapping={f: _bytes(v) for f, v in value.items()})
        elif kind == "zset":
            pipe.zadd(key, {_bytes(m): s for m, s in value})
        elif kind == "set":
            pipe.sadd(key, *(_bytes(m) for m in value))
        elif kind == "list":
            pipe.rpush(key, *(_bytes(v) for v in value))
        elif kind == "stream":
            for eid, fields in value:
                pipe.xadd(key, {f: _bytes(v) for f, v in fields.items()}, id=eid)
        else:
            raise ValueError(f"{key}: a saved {kind} this loader cannot write")
        if item["pttl"] > 0:
            pipe.pexpire(key, item["pttl"])
    pipe.execute()
    return V3Keyspace(saved_at_ms=int(saved["saved_at_ms"]), shift_ms=shift_ms, playbooks=saved["playbooks"],
                      alerts=saved["alerts"], records=saved["records"], history=saved["api"]["history"],
                      remediations=saved["api"]["remediations"], keys=saved["keys"])
