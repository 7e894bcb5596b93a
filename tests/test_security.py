"""Security, proved end to end: forged, altered and replayed commands against the real node agent (as
root, on the NVML stand-in, with a real allow-root) and a real training client; the two tokens; cross-site
writes in a real Chromium; Host; page headers; NaN at every door. Real processes, a real redis-server."""
from __future__ import annotations

import copy
import dataclasses
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import pytest
import redis
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from trainmedic.client import RemediationClient
from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.client.wire.protocol import command_message
from trainmedic.service.store.decision import NewRecord, Step
from trainmedic.client.wire.signing import Signer
from trainmedic.service.decide import plan
from trainmedic.service.embedded_redis import free_port
from trainmedic.service.decide.dispatch import Dispatcher, DispatchSettings, new_record_id
from trainmedic.service.rules.playbooks import Playbook
from trainmedic.service.rules.targets import Resolution

from tests.conftest import AUTH, OP_AUTH, OPERATOR, ROOT, SIGNING_KEY, VERIFY_KEY, load_fixture
from tests.support import jobs
from tests.support.browser import StaticPage
from tests.support.nvml import wait_record

DAY = 86400.0
NODE = "gpu-node-sec"
JOB = "llama-sec"
GPU0 = {"gpu_id": "0"}
# The forged command: everything below the allow-root, however new, keeping nothing.
WIPE = {"patterns": ["*"], "keep_last": 0, "older_than": 0}
ATTACKER_KEY = "an-attackers-own-ed25519-secret-" + "f" * 16
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


# -- the attacker: someone who can write to Redis and runs trainmedic's own code, but lacks the signing key

class _Sign:
    """A stand-in for the service's Signer: whatever signature `fn` gives for the bytes (records get a seal of
    no key: the appliers never read seals)."""

    def __init__(self, fn: Callable[[bytes], str]):
        self.sign = fn

    def sign_many(self, items: list[bytes]) -> list[str]:
        return [self.sign(x) for x in items]

    def seal(self, data: bytes) -> str:
        return ""


class Issuer:
    """Writes complete records and mailbox entries with the service's own DECIDE script, as Redis access allows,
    signing with whatever `sign` gives (the service's key, another key, nothing).

    Each command is backed by a real pending record, so the claim would say 'ok': when an applier refuses it,
    the signature check is what refused it.
    """

    def __init__(self, r: redis.Redis, sign: Callable[[bytes], str]):
        self.r = r
        self.sign = sign
        self.dispatcher = Dispatcher(r, _Sign(sign), DispatchSettings())  # type: ignore[arg-type]

    def draft(self, target: keys.Target, steps: list[tuple[str, dict]], context: dict | None = None) -> NewRecord:
        """A record as the service would make it, its command signed with `sign`."""
        pb = Playbook(name="manual", matchers=(), target=target.kind, actions=tuple(Step(a, p) for a, p in steps),
                      expire_after=3600.0)
        d = plan.manual(pb, {"job_name" if target.kind == "job" else "node": target.name}, None, "operator")
        d = plan.Decision(d.playbook, d.mode, d.alert, Resolution(target, context or {}), d.requested_by)
        return self.dispatcher.new_record(d, time.time())

    def send(self, target: keys.Target, steps: list[tuple[str, dict]], context: dict | None = None, *,
             edit: Callable[[str], str] | None = None, tamper: Callable[[dict], None] | None = None) -> str:
        """A record and its mailbox entry; `edit` changes what was decided before signing, `tamper` after. Its
        record id."""
        new = self.draft(target, steps, context)
        if edit is not None:
            text = edit(new.decided)
            new = dataclasses.replace(new, decided=text, delivery=dataclasses.replace(
                new.delivery, signature=self.sign(message_of(new, text))))
        if tamper is not None:
            d = json.loads(new.decided)
            tamper(d)
            new = dataclasses.replace(new, decided=json.dumps(d, separators=(",", ":")))
        [answer] = self.dispatcher.submit([new])
        assert answer.status == "dispatched", answer
        return new.rid


def message_of(new: NewRecord, decided: str) -> bytes:
    """The bytes an applier checks the record's signature over, were its `d` these."""
    return command_message(new.rid, int(new.expires_at * 1000), new.delivery.send, decided)


def forge(r: redis.Redis, new: NewRecord, signature: str, *, entry: bool = True) -> str:
    """A record written straight into Redis, as anyone who may write the target's keys can (its applier's user
    may), and, with `entry`, a mailbox entry naming it. Its record id."""
    r.hset(keys.record(new.rid), mapping={"d": new.decided, "exp": int(new.expires_at * 1000),
                                          "send": new.delivery.send, "sig": signature, "status": "dispatched",
                                          "as": "P" * new.n})
    if entry:
        xadd(r, new.target, new.rid)
    return new.rid


def service_signer() -> Signer:
    return Signer.from_secret(SIGNING_KEY)


def xadd(r: redis.Redis, target: keys.Target, rid: str) -> str:
    """One entry straight into a mailbox stream naming a record, as anyone with Redis write access can."""
    entry = r.xadd(keys.mailbox(target), {"r": rid.split("~")[0]})
    r.publish(keys.up_channel(target), "x")
    return str(entry)


def rejected(http: Any) -> dict[str, float]:
    """trainmedic_commands_rejected_total by reason, as GET /metrics says."""
    resp = http.get("/metrics")
    assert resp.status_code == 200
    text = resp.get_data(as_text=True) if hasattr(resp, "get_data") else resp.text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "trainmedic_commands_rejected":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["reason"]] = s.value
    return out


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    return jobs.wait_until(cond, timeout, what=what)


def aged(path: Path, data: bytes, age: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    now = time.time()
    os.utime(path, (now - age, now - age))
    return path


def allow_root(tmp_path: Path) -> tuple[Path, dict[Path, bytes]]:
    """An allow-root: a README, a data set and old checkpoints; every file with its bytes."""
    root = tmp_path / "checkpoints"
    files = {aged(root / "README.md", b"# runs\n", 90 * DAY): b"# runs\n",
             aged(root / "data" / "train.jsonl", b'{"text": "x"}\n' * 50, 90 * DAY): b'{"text": "x"}\n' * 50}
    for s in range(1, 5):
        body = bytes([s]) * 4096
        files[aged(root / "llama" / f"checkpoint-{s}.pt", body, (60 - s) * DAY)] = body
    for folder in (root / "data", root / "llama"):  # old folders too: nothing here is "being written"
        os.utime(folder, (time.time() - 50 * DAY,) * 2)
    return root, files


def intact(files: dict[Path, bytes]) -> bool:
    return all(p.is_file() and p.read_bytes() == b for p, b in files.items())


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN, Infinity and -Infinity (and numbers that overflow to them)."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} in JSON")

    def finite(text: str) -> float:
        value = float(text)
        if value in (float("inf"), float("-inf")):
            raise ValueError(f"{text} overflows")
        return value
    return json.loads(text, parse_constant=refuse, parse_float=finite)


# -- forged commands against the real agent

@pytest.fixture
def node_agent(agents: Any, nvml_lib: Path, nvml_state: Any, r: redis.Redis, tmp_path: Path) -> Any:
    root, files = allow_root(tmp_path)
    agent = agents(NODE, lib_dir=nvml_lib, state=nvml_state, allow_roots=[root])
    info = agent.wait_ready(r)
    assert info["signed"] is True and info["gpus"] and os.geteuid() == 0
    return agent, root, files


def test_forged_commands_are_refused_and_nothing_is_deleted_or_throttled(node_agent, nvml_state, r, http) -> None:
    agent, root, files = node_agent
    target = keys.Target("node", NODE)
    before = rejected(http)
    forged = [("disk_cleanup", WIPE), ("power_limit", {"watts": 200})]

    # 1. A record written straight into Redis, unsigned, and a mailbox entry naming it.
    straight = forge(r, Issuer(r, service_signer().sign).draft(target, forged, GPU0), "")
    # 2. A whole record made by the service's own script, but unsigned: the script sends nothing unsigned.
    unsigned = Issuer(r, lambda data: "").send(target, forged, GPU0)
    assert r.hget(keys.record(unsigned), "sig") is None
    # 3. The same, signed with a different Ed25519 key.
    other_key = Issuer(r, Signer.from_secret(ATTACKER_KEY).sign).send(target, forged, GPU0)
    # 4. Signed by the service's key over harmless steps, then the params were changed.
    def widen(d: dict) -> None:
        d["s"][0][1] = WIPE
        d["s"][1][1] = {"watts": 200}
    harmless = [("disk_cleanup", {"patterns": ["*.tmp"], "keep_last": 100, "older_than": "3650d"}),
                ("power_limit", {"watts": 700})]
    altered = Issuer(r, service_signer().sign).send(target, harmless, GPU0, tamper=widen)
    # 5. A signature taken from a genuine command and pasted onto a forged record.
    genuine = Issuer(r, service_signer().sign).draft(target, harmless, GPU0)
    pasted = forge(r, Issuer(r, service_signer().sign).draft(target, forged, GPU0), genuine.delivery.signature)
    # 6. An entry naming a record that does not exist.
    invented = new_record_id(target)
    xadd(r, target, invented)
    # 7. The entry of a genuinely signed command for another node, copied into this node's mailbox.
    elsewhere = jobs.inject(r, keys.Target("node", "another-node"), forged, GPU0)
    xadd(r, target, elsewhere)

    # A genuine command after them all: once it is applied, every entry before it was read (one cursor).
    after = jobs.inject(r, target, [("restore_power_limit", {})], GPU0)
    assert wait_record(r, after)["actions"][0]["reason"] == "nothing_to_restore"

    assert intact(files), "a forged command deleted files below the allow-root"
    assert nvml_state.limit_w(0) == 700 and nvml_state.limit_w(1) == 650
    for rid in (unsigned, other_key, altered):
        rec = records.get(r, rid)
        assert rec is not None and rec["status"] == "dispatched"
        assert [a["status"] for a in rec["actions"]] == ["pending", "pending"]  # never claimed as ours
    assert records.get(r, invented) is None
    assert [r.hget(keys.record(rid), "c") for rid in (straight, pasted)] == [None, None]  # never claimed
    assert [a["status"] for a in records.get(r, elsewhere)["actions"]] == ["pending", "pending"]
    now = wait_for(lambda: (lambda m: m if m.get("unsigned", 0) - before.get("unsigned", 0) == 1
                            and m.get("bad_signature", 0) - before.get("bad_signature", 0) == 3 else None)(
        rejected(http)), "the refusals to show on /metrics")
    assert now.get("replayed", 0) == before.get("replayed", 0)
    log = agent.log()
    assert log.count("is not signed") == 1 and log.count("does not match a verify key") == 3, log

    # The control: the very same forged record, signed by the service's key, is applied. So the records above
    # were complete, and the signature alone held them back. (Protected files survive even this.)
    wiped = Issuer(r, service_signer().sign).send(target, forged, GPU0)
    rec = wait_record(r, wiped)
    assert rec["status"] == "applied", rec
    assert rec["actions"][0]["result"]["deleted_count"] == 2  # the folders data/ and llama/, whole
    assert not (root / "llama").exists() and not (root / "data").exists()
    assert (root / "README.md").read_bytes() == b"# runs\n"
    assert nvml_state.limit_w(0) == 200


def test_a_replayed_command_is_not_applied_again_and_is_counted_replayed(node_agent, nvml_state, r, http) -> None:
    target = keys.Target("node", NODE)
    rid = jobs.inject(r, target, [("power_limit", {"watts": 500})], GPU0)
    assert wait_record(r, rid)["status"] == "applied"
    assert nvml_state.limit_w(0) == 500
    before = rejected(http)
    nvml_state.write([dataclasses.replace(g, current_mw=700_000) if g.index == 0 else g
                      for g in nvml_state.gpus().values()])  # someone put it back by hand
    xadd(r, target, rid)  # the same entry again: it names the record, which holds no command now
    # A genuine command after it (for the other GPU): once it is acknowledged, the replay was read too.
    after = jobs.inject(r, target, [("restore_power_limit", {})], {"gpu_id": "1"})
    assert wait_record(r, after)["actions"][0]["reason"] == "nothing_to_restore"
    assert nvml_state.limit_w(0) == 700, "the replayed command was applied again"
    assert records.get(r, rid)["actions"][0]["status"] == "applied"
    now = wait_for(lambda: (lambda m: m if m.get("replayed", 0) > before.get("replayed", 0) else None)(
        rejected(http)), "the replay to show on /metrics")
    assert now["replayed"] - before.get("replayed", 0) == 1
    assert now.get("bad_signature", 0) == before.get("bad_signature", 0)


def test_an_agent_given_two_verify_keys_accepts_commands_signed_by_either(agents, nvml_lib, nvml_state, r,
                                                                          http) -> None:
    old = Signer.from_secret("the-signing-secret-before-rotation-" + "0" * 8)
    agent = agents(NODE, lib_dir=nvml_lib, state=nvml_state, verify_key=f"{old.public}, {VERIFY_KEY}")
    agent.wait_ready(r)
    target = keys.Target("node", NODE)
    by_old = Issuer(r, old.sign).send(target, [("power_limit", {"watts": 600})], GPU0)
    assert wait_record(r, by_old)["status"] == "applied"
    assert nvml_state.limit_w(0) == 600
    by_new = Issuer(r, service_signer().sign).send(target, [("power_limit", {"watts": 550})], GPU0)
    assert wait_record(r, by_new)["status"] == "applied"
    assert nvml_state.limit_w(0) == 550
    before = rejected(http)
    by_neither = Issuer(r, Signer.from_secret(ATTACKER_KEY).sign).send(target, [("power_limit", {"watts": 200})],
                                                                       GPU0)
    wait_for(lambda: rejected(http).get("bad_signature", 0) > before.get("bad_signature", 0), "the refusal")
    assert records.get(r, by_neither)["actions"][0]["status"] == "pending"
    assert nvml_state.limit_w(0) == 550


# -- training clients

def trainer(redis_url: str, verify_key: str | None) -> tuple[RemediationClient, torch.optim.Optimizer]:
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    rc = RemediationClient(job=JOB, redis_url=redis_url, optimizer=opt, heartbeat_interval=0.2,
                           verify_key=verify_key)
    return rc, opt


def lr_of(opt: torch.optim.Optimizer) -> float:
    return float(opt.param_groups[0]["lr"])


def test_a_training_client_given_a_verify_key_refuses_unsigned_commands(r, redis_url, http) -> None:
    rc, opt = trainer(redis_url, VERIFY_KEY)
    target = keys.Target("job", JOB)
    try:
        jobs.wait_until(lambda: r.exists(keys.heartbeat(target)), what="the client's heartbeat")
        before = rejected(http)
        unsigned = forge(r, Issuer(r, service_signer().sign).draft(target, [("set_lr", {"lr": 5.0})]), "")
        steps = iter(range(10**6))
        jobs.wait_until(lambda: rejected(http).get("unsigned", 0) - before.get("unsigned", 0) == 1,
                        tick=lambda: (rc.poll(step=next(steps)), time.sleep(0.01)), what="the refusal")
        for _ in range(20):
            assert rc.poll(step=next(steps)) == []
        assert lr_of(opt) == 0.1
        assert r.hget(keys.record(unsigned), "c") is None  # never claimed
        # The control: the service's own command gets through to the same client.
        rid = jobs.send(r, JOB, "set_lr", {"lr": 0.05})
        assert jobs.wait_record(r, rid, tick=lambda: rc.poll(step=next(steps)))["status"] == "applied"
        assert lr_of(opt) == 0.05
    finally:
        rc.close()


def test_a_training_client_without_a_key_accepts_signed_commands_and_as_documented_unsigned_ones(
        r, redis_url) -> None:
    rc, opt = trainer(redis_url, None)
    steps = iter(range(10**6))
    try:
        rid = jobs.send(r, JOB, "set_lr", {"lr": 0.05})
        assert jobs.wait_record(r, rid, tick=lambda: rc.poll(step=next(steps)))["status"] == "applied"
        assert lr_of(opt) == 0.05
        unsigned = forge(r, Issuer(r, service_signer().sign).draft(keys.Target("job", JOB),
                                                                   [("set_lr", {"lr": 0.02})]), "")
        assert jobs.wait_record(r, unsigned, tick=lambda: rc.poll(step=next(steps)))["status"] == "applied"
        assert lr_of(opt) == 0.02  # TRAINMEDIC_VERIFY_KEY is optional for trainers: set it (threat model)
    finally:
        rc.close()



def test_a_forged_ledger_entry_is_not_applied_when_a_verifying_client_resumes(r, redis_url, http) -> None:
    # The job's ledger is how a resumed run learns which sticky LR changes to apply again (Guarantees 5). Anyone
    # who may write the job's keys (a trainer's Redis user may) can append to it: entries must be signed too.
    from tests.support.loop import Loop

    first = Loop(redis_url, JOB, verify_key=VERIFY_KEY)
    try:
        first.run_for(0.3)
        before = copy.deepcopy(first.rc.state_dict())  # a checkpoint from before any change
        rid = jobs.send(r, JOB, "scale_lr", {"factor": 0.5})
        jobs.wait_record(r, rid, tick=first.tick)
        assert first.lr == pytest.approx(0.05)
    finally:
        first.rc.close()
    job = keys.Target("job", JOB)
    ledger = keys.ledger(job)
    [genuine] = [json.loads(x) for x in r.lrange(ledger, 0, -1)]
    issuer = Issuer(r, service_signer().sign)
    raised, changed, other_key = (issuer.draft(job, [("set_lr", {"lr": lr})]) for lr in (9.0, 8.0, 7.0))
    elsewhere = jobs.inject(r, keys.Target("job", "another-job"), [("set_lr", {"lr": 3.0})])
    forged = [
        # an entry for a record that does not exist
        {**genuine, "rid": new_record_id(job)},
        # a record written straight into Redis, unsigned
        {**genuine, "rid": forge(r, raised, "", entry=False)},
        # a record whose steps were changed after the service's key signed them
        {**genuine, "rid": forge(r, dataclasses.replace(changed, decided=changed.decided.replace("8.0", "80.0")),
                                 changed.delivery.signature, entry=False)},
        # a record signed by another key
        {**genuine, "rid": forge(r, other_key, Signer.from_secret(ATTACKER_KEY).sign(
            message_of(other_key, other_key.decided)), entry=False)},
        # another job's genuine, signed command (it would set this job's LR to 3.0)
        {**genuine, "rid": elsewhere},
    ]
    r.rpush(ledger, *[json.dumps(e) for e in forged])
    seen = rejected(http)
    resumed = Loop(redis_url, JOB, verify_key=VERIFY_KEY)
    try:
        resumed.rc.load_state_dict(before)
        jobs.wait_until(lambda: resumed.lr != pytest.approx(0.1), tick=resumed.tick, what="the genuine change")
        resumed.run_for(1.0)  # long enough for every entry to have been looked at
        assert resumed.lr == pytest.approx(0.05)  # the genuine scale_lr only, applied again once
    finally:
        resumed.rc.close()
    now = rejected(http)
    assert now.get("unsigned", 0) - seen.get("unsigned", 0) == 1
    assert now.get("bad_signature", 0) - seen.get("bad_signature", 0) == 2

# -- the service: tokens, cross-site writes, Host, page headers

HELD = """\
playbooks:
  - name: held-lr
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    approval: true
    actions:
      - scale_lr: {factor: 0.5}
"""


def firing(fingerprint: str, **labels: str) -> dict:
    body = load_fixture("firing_single.json")
    a = body["alerts"][0]
    a["labels"] = {"alertname": "TrainingLossSpike", "severity": "critical", "job_name": JOB, **labels}
    a["fingerprint"] = fingerprint
    return body


@pytest.fixture
def held(gunicorn: Any, tmp_path: Path) -> Callable[..., tuple[Any, str]]:
    """Start the service under gunicorn with an approval playbook; one record held for approval, by webhook."""
    def start(**env: str) -> tuple[Any, str]:
        (tmp_path / "held.yaml").write_text(HELD)
        g = gunicorn(2, TRAINMEDIC_PLAYBOOKS=str(tmp_path / "held.yaml"), **env)
        resp = requests.post(g.url + "/webhook", json=firing("5ec0000000000001"), headers=AUTH, timeout=10)
        assert resp.status_code == 200, resp.text
        [rec] = resp.json()["remediations"]
        assert rec["status"] == "pending_approval"
        return g, rec["id"]
    return start


def status_of(g: Any, rid: str) -> str:
    return str(requests.get(f"{g.url}/remediations/{rid}", timeout=10).json()["status"])


def one_sentence(resp: requests.Response) -> str:
    """The {"error": sentence} body every refusal carries."""
    body = resp.json()
    assert list(body) == ["error"] and isinstance(body["error"], str), body
    assert body["error"] and "\n" not in body["error"], body
    return str(body["error"])


def people_writes(g: Any, rid: str) -> list[tuple[str, dict]]:
    return [(f"{g.url}/remediations/{rid}/approve", {}), (f"{g.url}/remediations/{rid}/reject", {}),
            (f"{g.url}/remediations", {"playbook": "held-lr", "labels": {"job_name": JOB}}),
            (f"{g.url}/commands", {"target": f"job:{JOB}", "action": "set_lr", "params": {"lr": 1.0}})]


def test_the_webhook_token_cannot_approve_reject_trigger_or_command_and_the_operator_token_cannot_post_a_webhook(
        held) -> None:
    g, rid = held()
    for url, body in people_writes(g, rid):
        resp = requests.post(url, json=body, headers=AUTH, timeout=10)
        assert resp.status_code == 403, (url, resp.text)
        assert "webhook token" in one_sentence(resp)
    resp = requests.post(g.url + "/webhook", json=firing("5ec0000000000002"), headers=OP_AUTH, timeout=10)
    assert resp.status_code == 401 and one_sentence(resp)
    assert status_of(g, rid) == "pending_approval"
    assert requests.get(g.url + "/history", timeout=10).json()["items"][0]["id"] == rid  # nothing else made
    # The control: the operator's token does approve it.
    resp = requests.post(f"{g.url}/remediations/{rid}/approve", json={}, headers=OP_AUTH, timeout=10)
    assert resp.status_code == 200 and status_of(g, rid) == "dispatched"


def test_without_an_operator_token_peoples_writes_answer_403_even_from_loopback(held) -> None:
    g, rid = held(TRAINMEDIC_OPERATOR_TOKEN="")
    for url, body in people_writes(g, rid):
        for headers in ({}, OP_AUTH, {"Authorization": "Bearer "}):
            resp = requests.post(url, json=body, headers=headers, timeout=10)  # from 127.0.0.1
            assert resp.status_code == 403, (url, headers, resp.text)
            assert "no operator token" in one_sentence(resp)
    assert status_of(g, rid) == "pending_approval"


def test_a_foreign_origin_a_form_content_type_or_no_body_cannot_approve(held) -> None:
    g, rid = held()
    url = f"{g.url}/remediations/{rid}/approve"
    cases = [
        (403, dict(json={}, headers={**OP_AUTH, "Origin": "http://evil.example"})),
        (403, dict(json={}, headers={**OP_AUTH, "Origin": "null"})),
        (403, dict(json={}, headers={**OP_AUTH, "Origin": g.url.replace("127.0.0.1", "localhost")})),
        (415, dict(data={"comment": "x"}, headers=OP_AUTH)),  # application/x-www-form-urlencoded
        (415, dict(files={"comment": ("c", b"x")}, headers=OP_AUTH)),  # multipart/form-data
        (415, dict(data='{"comment": "x"}', headers={**OP_AUTH, "Content-Type": "text/plain"})),
        (415, dict(headers=OP_AUTH)),  # no body, no Content-Type
    ]
    for status, kw in cases:
        resp = requests.post(url, timeout=10, **kw)
        assert resp.status_code == status, (kw, resp.text)
        one_sentence(resp)
    assert status_of(g, rid) == "pending_approval"
    same = requests.post(url, json={}, headers={**OP_AUTH, "Origin": g.url}, timeout=10)
    assert same.status_code == 200 and status_of(g, rid) == "dispatched"  # its own Origin is fine


@pytest.fixture
def other_site() -> Iterator[Callable[[str], str]]:
    """A second local server (another port: another origin) serving one page; returns its URL."""
    servers = []

    def serve(html: str) -> str:
        handler = type("Page", (StaticPage,), {"html": html.encode()})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_port}/"
    yield serve
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_a_page_on_another_origin_posting_a_form_in_a_real_browser_leaves_the_record_pending(
        held, other_site) -> None:
    from playwright.sync_api import sync_playwright

    g, rid = held()
    url = f"{g.url}/remediations/{rid}/approve"
    # The JSON-in-text/plain trick, a fetch that needs no preflight, and a plain urlencoded form.
    page = other_site(f"""<!doctype html><html><body>
<form id="plain" method="POST" action="{url}" enctype="text/plain" target="one">
  <input name='{{"comment": "' value='x"}}'></form>
<form id="urlenc" method="POST" action="{url}" target="two"><input name="comment" value="x"></form>
<iframe name="one"></iframe><iframe name="two"></iframe>
<script>
  fetch("{url}", {{method: "POST", mode: "no-cors", credentials: "include",
                   headers: {{"Content-Type": "text/plain"}}, body: "{{}}"}}).finally(() => {{
    document.getElementById("plain").submit();
    document.getElementById("urlenc").submit();
  }});
</script></body></html>""")
    answers: list[Any] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            ctx = browser.new_context()
            tab = ctx.new_page()
            tab.on("response", lambda resp: answers.append(resp) if resp.url == url else None)
            tab.goto(page)
            jobs.wait_until(lambda: len(answers) >= 3, 20, tick=lambda: tab.wait_for_timeout(50),  # events need a pump
                            what="the three cross-site posts to reach the service")
            tab.wait_for_timeout(300)  # and nothing more comes
            statuses = [a.status for a in answers]
            origins = {a.request.all_headers().get("origin") for a in answers} - {None}  # the fetch's is hidden
        finally:
            browser.close()
    # Each refused with 403, the foreign-Origin refusal (without an Origin it would be 401: no token).
    assert statuses == [403, 403, 403], statuses
    assert origins == {page.rstrip("/")}, origins
    assert status_of(g, rid) == "pending_approval"


def test_a_foreign_host_gets_400_but_probes_and_metrics_answer_any_host(gunicorn) -> None:
    g = gunicorn(2)
    for path in ("/history", "/", "/targets", "/openapi.json", "/remediations/x"):
        resp = requests.get(g.url + path, headers={"Host": "evil.example"}, timeout=10)
        assert resp.status_code == 400, path
        if path != "/":
            assert "Host" in one_sentence(resp)
    resp = requests.post(g.url + "/webhook", json=firing("5ec0000000000003"),
                         headers={**AUTH, "Host": f"evil.example:{g.port}"}, timeout=10)
    assert resp.status_code == 400 and requests.get(g.url + "/history", timeout=10).json()["items"] == []
    for path in ("/healthz", "/readyz", "/metrics"):
        assert requests.get(g.url + path, headers={"Host": "10.1.2.3:9095"}, timeout=10).status_code == 200
    for host in ("127.0.0.1", "localhost", f"localhost:{g.port}"):
        assert requests.get(g.url + "/history", headers={"Host": host}, timeout=10).status_code == 200


def test_trainmedic_allowed_hosts_is_honoured(gunicorn) -> None:
    g = gunicorn(2, TRAINMEDIC_ALLOWED_HOSTS="trainmedic.internal, Ops.Example")
    for host in (f"trainmedic.internal:{g.port}", "ops.example", "OPS.EXAMPLE:80"):
        assert requests.get(g.url + "/history", headers={"Host": host}, timeout=10).status_code == 200, host
    for host in ("127.0.0.1", f"localhost:{g.port}", "evil.example", "trainmedic.internal.evil.example"):
        assert requests.get(g.url + "/history", headers={"Host": host}, timeout=10).status_code == 400, host
    assert requests.get(g.url + "/metrics", headers={"Host": "evil.example"}, timeout=10).status_code == 200


class _Scripts(HTMLParser):
    """Collects what would run in a page: inline scripts, script sources, event-handler attributes, js: URLs."""

    def __init__(self) -> None:
        super().__init__()
        self.inline: list[str] = []
        self.sources: list[str] = []
        self.handlers: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script":
            self._in_script = True
            if a.get("src"):
                self.sources.append(str(a["src"]))
        for name, value in attrs:
            if name.startswith("on") or (value or "").strip().lower().startswith("javascript:"):
                self.handlers.append(f"<{tag} {name}={value!r}>")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline.append(data.strip()[:80])


def test_html_answers_carry_the_security_headers_and_the_history_page_has_no_inline_script(
        gunicorn, r, redis_url) -> None:
    g = gunicorn(2)
    rc, _ = trainer(redis_url, VERIFY_KEY)  # a live target, so its page renders too
    try:
        jobs.wait_until(lambda: r.exists(keys.heartbeat(keys.Target("job", JOB))), what="a heartbeat")
        requests.post(g.url + "/webhook", json=firing("5ec0000000000004"), headers=AUTH, timeout=10)
        pages = {"/": 200, "/?limit=%C2%B2": 400, f"/targets/job/{JOB}": 200, "/targets/node/never-seen": 200,
                 "/targets/job/bad%20name": 404}
        for path, status in pages.items():
            resp = requests.get(g.url + path, headers={"Accept": "text/html"}, timeout=10)
            assert resp.status_code == status and resp.headers["Content-Type"].startswith("text/html"), path
            csp = {d.split()[0]: d.split()[1:] for d in resp.headers["Content-Security-Policy"].split(";")
                   if d.strip()}
            assert csp["script-src"] == ["'self'"] and csp["default-src"] == ["'self'"], csp
            assert csp["frame-ancestors"] == ["'none'"]
            assert resp.headers["X-Frame-Options"] == "DENY"
            assert resp.headers["X-Content-Type-Options"] == "nosniff"
            assert resp.headers["Referrer-Policy"] == "same-origin"
            found = _Scripts()
            found.feed(resp.text)
            assert found.inline == [] and found.handlers == [], (path, found.inline, found.handlers)
            assert all(src.startswith("/static/") for src in found.sources), found.sources
        history_page = _Scripts()
        history_page.feed(requests.get(g.url + "/", timeout=10).text)
        assert history_page.sources, "the history page loads its script from the service"
    finally:
        rc.close()


# -- NaN at every door

NAN_PLAYBOOKS = """\
playbooks:
  - name: nan-factor
    matchers: ['alertname="A"']
    target: job
    actions:
      - scale_lr: {factor: .nan}
  - name: inf-lr
    matchers: ['alertname="B"']
    target: job
    actions:
      - set_lr:
          lr: .inf
  - name: nan-watts
    matchers: ['alertname="C"']
    target: node
    actions:
      - power_limit: {watts: .NaN}
"""


def cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    return subprocess.run([sys.executable, "-m", "trainmedic.service.cli", *args], capture_output=True, text=True,
                          env={**full, **(env or {})}, cwd=ROOT, timeout=timeout)


def test_check_and_the_service_refuse_playbooks_with_nan_or_infinity_naming_file_and_line(redis_url,
                                                                                          tmp_path: Path) -> None:
    path = tmp_path / "nan.yaml"
    path.write_text(NAN_PLAYBOOKS)
    lines = NAN_PLAYBOOKS.splitlines()
    where = [i + 1 for i, line in enumerate(lines) if re.search(r"\.(nan|inf|NaN)\b", line)]
    assert len(where) == 3
    out = cli("check", str(path))
    assert out.returncode == 1, out
    got = out.stdout.strip().splitlines()
    assert [line.split(": ", 1)[0] for line in got] == [f"{path}:{n}" for n in where], got
    assert all("finite number" in line for line in got)
    serve = cli("serve", "--redis-url", redis_url, "--playbooks", str(path), "--no-agent", "--port", str(free_port()),
                env={"TRAINMEDIC_SIGNING_KEY": SIGNING_KEY, "TRAINMEDIC_OPERATOR_TOKEN": OPERATOR})
    assert serve.returncode == 1, serve
    [line] = serve.stderr.strip().splitlines()
    assert line.startswith("trainmedic: invalid playbooks:") and f"{path}:{where[0]}:" in line and "finite" in line


def test_send_refuses_nan_before_anything_is_posted(gunicorn) -> None:
    g = gunicorn(2)
    for value in ("nan", "NaN", "inf", "-inf", "1e999", "-1e999"):
        out = cli("send", "--job", JOB, "--url", g.url, "set_lr", f"lr={value}",
                  env={"TRAINMEDIC_OPERATOR_TOKEN": OPERATOR})
        assert out.returncode == 2, out
        [line] = out.stderr.strip().splitlines()
        assert "finite number" in line
    assert requests.get(g.url + "/history", timeout=10).json()["items"] == []


NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1E400"]


def test_api_bodies_with_nan_infinity_or_overflowing_numbers_get_400(gunicorn, r) -> None:
    g = gunicorn(2)
    for literal in NON_FINITE:
        bodies = {
            "/commands": f'{{"target": "job:{JOB}", "action": "set_lr", "params": {{"lr": {literal}}}}}',
            "/remediations": f'{{"playbook": "loss-spike", "labels": {{"job_name": "{JOB}"}}, '
                             f'"annotations": {{"value": {literal}}}}}',
        }
        for path, body in bodies.items():
            resp = requests.post(g.url + path, data=body, timeout=10,
                                 headers={**OP_AUTH, "Content-Type": "application/json"})
            assert resp.status_code == 400, (path, literal, resp.text)
            assert "finite" in one_sentence(resp)
    assert requests.get(g.url + "/history", timeout=10).json()["items"] == []
    assert r.xrange(keys.mailbox(keys.Target("job", JOB))) == []


def test_an_applier_given_a_signed_command_with_non_finite_params_fails_the_action_and_changes_nothing(
        r, redis_url, gunicorn) -> None:
    g = gunicorn(2)
    rc, opt = trainer(redis_url, VERIFY_KEY)
    target = keys.Target("job", JOB)
    steps = iter(range(10**6))
    try:
        for literal in NON_FINITE:
            # Bytes no trainmedic code would write (dumps refuses NaN), signed with the service's own key.
            def put(text: str, literal: str = literal) -> str:
                return text.replace('"__X__"', literal)
            rid = Issuer(r, service_signer().sign).send(target, [("set_lr", {"lr": "__X__"})], edit=put)
            assert literal in r.hget(keys.record(rid), "d")
            rec = jobs.wait_record(r, rid, tick=lambda: rc.poll(step=next(steps)))
            [action] = rec["actions"]
            assert (rec["status"], action["status"]) == ("failed", "failed"), rec
            error = action["result"]["error"]
            assert error.count(". ") == 0 and error.endswith(".") and "finite" in error, error
            assert lr_of(opt) == 0.1
        # The records, as the API serves them and as Redis holds them, parse with a strict JSON parser.
        listed = requests.get(g.url + "/history?limit=500", timeout=10)
        items = strict_json(listed.text)["items"]
        assert len(items) == len(NON_FINITE)
        for item in items:
            strict_json(requests.get(f"{g.url}/remediations/{item['id']}", timeout=10).text)
        for key in r.scan_iter(match=keys.PREFIX + "*:rec:*"):
            for name, value in r.hgetall(key).items():
                if value[:1] in ("[", "{") and name != "d":  # `d` holds the bytes this test had signed
                    strict_json(value)
    finally:
        rc.close()


def test_odd_unicode_digits_and_an_overflowing_date_get_400_through_gunicorn(gunicorn) -> None:
    g = gunicorn(2)
    for path in ("/history?limit=²", "/?limit=²", "/history?limit=٣", "/?limit=１０"):
        resp = requests.get(g.url + path, timeout=10)
        assert resp.status_code == 400, path
        if path.startswith("/history"):
            assert "limit" in one_sentence(resp)
        else:
            assert "limit must be an integer" in resp.text
    body = firing("5ec0000000000005")
    body["alerts"][0]["startsAt"] = "9999-12-31T23:59:59-23:59"
    resp = requests.post(g.url + "/webhook", json=body, headers=AUTH, timeout=10)
    assert resp.status_code == 400 and "startsAt" in one_sentence(resp)
    assert requests.get(g.url + "/history", timeout=10).json()["items"] == []
