"""The same code on a real 3-master Redis Cluster (detected from a plain URL), over TLS and a unix socket."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from collections.abc import Iterator

import pytest
import redis
import torch

from trainmedic.client import RemediationClient
from trainmedic.client.wire import keys
from trainmedic.client.wire.redis import connect
from trainmedic.service.app import create_app
from trainmedic.service.embedded_redis import EmbeddedRedis
from trainmedic.service.embedded_redis import free_port
from tests.support.redis_cluster import EmbeddedCluster

from tests.conftest import AUTH, ROOT, SIGNING_KEY, TOKEN, load_fixture


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    c = EmbeddedCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


def closed_loop(url: str) -> dict:
    """Webhook -> record + mailbox -> a RemediationClient applies scale_lr -> ack in the record."""
    app = create_app({"TESTING": True, "redis_url": url, "webhook_token": TOKEN, "signing_key": SIGNING_KEY,
                      "playbooks": str(ROOT / "playbooks")})
    http = app.test_client()
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with RemediationClient(job="llama-ft-01", redis_url=url, optimizer=opt, scheduler=sched) as rc:
        body = json.dumps(load_fixture("firing_single.json"))
        for _ in range(3):  # resends stay one remediation here too
            resp = http.post("/webhook", data=body, content_type="application/json", headers=AUTH)
            assert resp.status_code == 200
        [rid] = [i["id"] for i in http.get("/history").json["items"]]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            rc.poll()
            rec = http.get(f"/remediations/{rid}").json
            if rec["status"] != "dispatched":
                break
            time.sleep(0.01)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05), rec
    assert http.get("/readyz").status_code == 200
    # The reconciler's global index and per-target scripts work on this Redis too (a cluster: other slots).
    report = app.extensions["trainmedic"].reconciler.tick(time.time() + 7200)
    assert report.targets == 1 and report.changed == []
    return rec


def test_a_plain_url_of_any_cluster_node_is_detected_as_a_cluster(cluster: EmbeddedCluster) -> None:
    for node in cluster.nodes:
        assert isinstance(connect(node.url), redis.RedisCluster)


def test_the_core_flow_runs_on_a_redis_cluster(cluster: EmbeddedCluster) -> None:
    rec = closed_loop(cluster.nodes[1].url)
    # The optional rollback has no handler here: skipped; the LR halving is applied.
    assert rec["actions"][1]["status"] == "applied" and rec["actions"][0]["status"] == "skipped"
    # The record, the mailbox and the cursor of one target live in one hash slot.
    t = keys.Target("job", "llama-ft-01")
    slots = {redis.RedisCluster.from_url(cluster.url).keyslot(k)
             for k in (keys.record(rec["id"]), keys.mailbox(t), keys.cursor(t), keys.target_state(t),
                       keys.journal(t), keys.target_metrics(t))}
    assert len(slots) == 1


def test_the_webhook_is_served_by_gunicorn_on_a_cluster(cluster: EmbeddedCluster, gunicorn) -> None:
    import requests

    server = gunicorn(workers=2, TRAINMEDIC_REDIS_URL=cluster.url)
    body = load_fixture("firing_group.json")
    body["alerts"][0]["fingerprint"] = "c1c1c1c1c1c1c1c1"
    resp = requests.post(server.url + "/webhook", json=body, headers=AUTH, timeout=10)
    assert resp.status_code == 200 and len(resp.json()["remediations"]) == 2
    assert requests.get(server.url + "/history?limit=5", timeout=10).status_code == 200
    assert requests.get(server.url + "/metrics", timeout=10).status_code == 200


def test_the_core_flow_runs_over_a_unix_socket(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    with EmbeddedRedis(tmp_path / "data", appendonly=False,
                       extra_args=("--unixsocket", str(sock), "--unixsocketperm", "700")):
        rec = closed_loop(f"unix://{sock}?db=0")
    assert rec["actions"][1]["status"] == "applied"


def _certs(d: Path) -> tuple[Path, Path, Path]:
    d.mkdir()
    ca_key, ca, key, csr, crt = (d / n for n in ("ca.key", "ca.crt", "redis.key", "redis.csr", "redis.crt"))
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
        "-subj", "/CN=trainmedic-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1",
        "-addext", "subjectAltName=IP:127.0.0.1")
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(crt),
        "-days", "2", "-extfile", str(ext))
    return ca, crt, key


def test_the_core_flow_runs_over_tls(tmp_path: Path) -> None:
    ca, crt, key = _certs(tmp_path / "tls")
    tls_port = free_port()
    with EmbeddedRedis(tmp_path / "data", appendonly=False,
                       extra_args=("--tls-port", str(tls_port), "--tls-cert-file", str(crt), "--tls-key-file",
                                   str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no")):
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}"
        assert connect(url).ping()
        rec = closed_loop(url)
    assert rec["actions"][1]["status"] == "applied"


def test_on_a_cluster_an_ack_on_a_target_the_reconciler_never_visits_is_listed_by_its_new_status(
        cluster: EmbeddedCluster) -> None:
    # The scripts journal history changes in their target's own slot (a script may only touch its slot, and an
    # applier only its own keys); the ack tells the service on the target's channel, and the service moves that
    # journal into the index. No reconciler pass runs here: only the service's listener.
    from trainmedic.service.store import record as records
    from trainmedic.client.wire import scripts
    from trainmedic.client.wire.protocol import Ack
    from trainmedic.client.wire.redis import run_scripts
    from tests.support.jobs import wait_until

    app = create_app({"TESTING": True, "redis_url": cluster.url, "webhook_token": TOKEN, "signing_key": SIGNING_KEY,
                      "playbooks": str(ROOT / "playbooks")})
    listener = app.extensions["trainmedic"].reconciler.listener
    listener.start()
    try:
        http = app.test_client()
        job = f"hist-never-visited-{time.time_ns()}"
        body = load_fixture("firing_single.json")
        body["alerts"][0]["labels"]["job_name"] = job
        body["alerts"][0]["fingerprint"] = f"{time.time_ns() & (1 << 64) - 1:016x}"
        resp = http.post("/webhook", data=json.dumps(body), content_type="application/json", headers=AUTH)
        [rid] = [m["id"] for m in resp.json["remediations"]]
        # Listed and filterable as soon as the webhook answered.
        assert [i["id"] for i in http.get(f"/history?target=job:{job}&status=dispatched").json["items"]] == [rid]
        assert rid in [i["id"] for i in http.get("/history?status=dispatched&limit=500").json["items"]]

        applier = connect(cluster.nodes[2].url)  # a trainer's own client, another node's URL
        assert isinstance(applier, redis.RedisCluster)
        rec = records.get(applier, rid)
        acks = [Ack(rid, i, a["action"], "applied", {}, "trainer:1") for i, a in enumerate(rec["actions"])]
        run_scripts(applier, scripts.ack_calls(acks, time.time()))
        status = applier.hget(keys.record(rid), "status")
        assert status not in (None, "dispatched")
        assert applier.llen(keys.journal(keys.Target("job", job))) > 0  # in the target's own slot

        wait_until(lambda: rid in [i["id"] for i in http.get(f"/history?status={status}&limit=500").json["items"]],
                   what="the record listed by its new status")
        assert rid not in [i["id"] for i in http.get("/history?status=dispatched&limit=500").json["items"]]
        assert [i["id"] for i in http.get(f"/history?target=job:{job}&status={status}").json["items"]] == [rid]
        assert http.get(f"/history?target=job:{job}&status=dispatched").json["items"] == []
        # The target's journal was taken and folded.
        assert applier.llen(keys.journal(keys.Target("job", job))) == 0
    finally:
        listener.stop()
