"""The history index (service/history.py): full pages for sparse filters, combinations, deep paging, target=,
status and outcome changes (ack, expiry, verdict), retention, and two writers at once."""
from __future__ import annotations

import threading
import time
from typing import Any

from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.client.wire.protocol import Ack
from trainmedic.client.wire.redis import run_scripts
from trainmedic.client.wire.scripts import ack_calls
from trainmedic.client.wire.status import Outcome
from trainmedic.service.store.scripts import Keyspace, verdict_call

from tests.conftest import load_fixture, post_json
from tests.support.jobs import wait_until
from tests.support.keyspaces import BOTH, oldest_first


def fire(http: Any, n: int, alertname: str = "TrainingLossSpike", job: str = "job") -> list[str]:
    """n alerts in one notification, one job each; the ids made, oldest first."""
    body = load_fixture("firing_single.json")
    proto = body["alerts"][0]
    alerts = []
    for i in range(n):
        a = {**proto, "labels": {**proto["labels"], "alertname": alertname, "job_name": f"{job}-{i}"},
             "fingerprint": f"{alertname[:4].lower()}{job[:4]}{i:08x}"}
        alerts.append(a)
    body["alerts"] = alerts
    resp = post_json(http, "/webhook", body)
    assert resp.status_code == 200, resp.get_json()
    return [x["id"] for x in resp.get_json()["remediations"]]


def walk(http: Any, query: str, limit: int) -> list[list[str]]:
    """Every page of a query, following `next`."""
    pages, cursor = [], None
    while True:
        page = http.get(f"/history?limit={limit}&{query}" + (f"&before={cursor}" if cursor else "")).get_json()
        pages.append([i["id"] for i in page["items"]])
        cursor = page["next"]
        if cursor is None:
            return pages


def full(pages: list[list[str]], limit: int) -> bool:
    """Every page but the last holds `limit` items, the last one at least one (unless it is the only one)."""
    return all(len(p) == limit for p in pages[:-1]) and (len(pages[-1]) > 0 or len(pages) == 1)


@BOTH
def test_a_sparse_filter_gives_full_pages_and_pages_through_all_matches(http: Any, r: Any) -> None:
    rare = fire(http, 3, "GPUMemoryUsageHigh", job="mem")
    fire(http, 200)
    rare += fire(http, 4, "GPUMemoryUsageHigh", job="mem2")
    fire(http, 100, job="late")
    pages = walk(http, "alertname=GPUMemoryUsageHigh", 2)
    assert full(pages, 2) and [i for p in pages for i in p] == oldest_first(r, rare)[::-1]
    assert http.get("/history?alertname=NoSuchAlert").get_json() == {"items": [], "next": None}


@BOTH
def test_combinations_and_deep_paging_with_the_cursor(http: Any, r: Any) -> None:
    ids = fire(http, 120) + fire(http, 30, "GPUMemoryUsageHigh", job="mem") + fire(http, 50, job="more")
    pages = walk(http, "", 7)
    ids = oldest_first(r, ids)
    assert full(pages, 7) and [i for p in pages for i in p] == list(reversed(ids))
    combo = walk(http, "alertname=TrainingLossSpike&playbook=loss-spike&status=dispatched", 9)
    spikes = [i for i in ids if records.get(r, i)["alert"]["alertname"] == "TrainingLossSpike"]
    assert full(combo, 9) and [i for p in combo for i in p] == list(reversed(spikes))
    assert http.get("/history?alertname=GPUMemoryUsageHigh&playbook=loss-spike").get_json()["items"] == []


@BOTH
def test_target_filter_uses_the_targets_own_index(http: Any, r: Any) -> None:
    fire(http, 40)
    mine = []
    for _ in range(3):  # new episodes of one job's alert: different fingerprints each time
        body = load_fixture("firing_single.json")
        a = body["alerts"][0]
        a["labels"].update(job_name="job-7")
        a["fingerprint"] = f"{len(mine):016x}"
        mine += [x["id"] for x in post_json(http, "/webhook", body).get_json()["remediations"]]
        fire(http, 10, job=f"noise{len(mine)}")
    got = [i["id"] for i in http.get("/history?target=job:job-7&limit=500").get_json()["items"]]
    assert set(mine) <= set(got) and all(i.endswith("~job~job-7") for i in got)
    assert r.zcard(keys.target_history(keys.Target("job", "job-7"))) == len(got)
    pages = walk(http, "target=job-7", 1)
    assert full(pages, 1) and [i for p in pages for i in p] == got


@BOTH
def test_status_and_outcome_filters_follow_acks_expiry_and_verdicts(app: Any, http: Any, r: Any) -> None:
    ids = fire(http, 30)
    svc = app.extensions["trainmedic"]
    acked = ids[:10]
    answers = [Ack(rid, i, a["action"], "applied", {}, "test")
               for rid in acked for i, a in enumerate(records.get(r, rid)["actions"])]
    run_scripts(r, ack_calls(answers, time.time()))  # the real ACK script, as the jobs' own users run it

    def listed(query: str) -> list[str]:
        return [i["id"] for i in http.get(f"/history?{query}&limit=500").get_json()["items"]]

    # The service hears the jobs' acks (service/listener.py) and folds them in; then the filters follow.
    wait_until(lambda: listed("status=applied") == oldest_first(r, acked)[::-1], what="the acks in the history")
    assert len(http.get("/history?status=dispatched&limit=500").get_json()["items"]) == 20
    # Outcomes: the applied ones are pending until a verdict.
    pending = {i["id"] for i in http.get("/history?outcome=pending&limit=500").get_json()["items"]}
    assert pending == set(acked)
    ks = Keyspace(r)
    assert ks.run([verdict_call(ks, acked[0], "effective")], [keys.target_of_record(acked[0])])[0] == 1
    eff = http.get("/history?outcome=effective&status=applied").get_json()
    assert [i["id"] for i in eff["items"]] == [acked[0]] and eff["next"] is None
    assert acked[0] not in {i["id"] for i in http.get("/history?outcome=pending&limit=500").get_json()["items"]}
    # The reconciler expires the rest, past their expiry (and decides the other outcomes).
    svc.reconciler.tick(time.time() + 7200)
    expired = [i["id"] for i in http.get("/history?status=expired&limit=500").get_json()["items"]]
    assert sorted(expired) == sorted(ids[10:])
    assert http.get("/history?status=dispatched").get_json() == {"items": [], "next": None}
    truth = {rid: records.get(r, rid) for rid in ids}
    for o in Outcome:
        got = {i["id"] for i in http.get(f"/history?outcome={o}&limit=500").get_json()["items"]}
        assert got == {rid for rid, rec in truth.items() if (rec["outcome"] or {}).get("status") == o}, o


@BOTH
def test_retention_deletes_records_and_they_leave_every_index(make_app: Any, r: Any) -> None:
    app = make_app(history_max=50)
    http = app.test_client()
    spikes = fire(http, 60)
    ids = oldest_first(r, spikes + fire(http, 40, "GPUMemoryUsageHigh", job="mem"))
    assert app.extensions["trainmedic"].reconciler.tick().trimmed == 50
    kept = ids[50:]
    assert not any(r.exists(keys.record(i)) for i in ids[:50])
    assert [i for p in walk(http, "", 13) for i in p] == kept[::-1]
    assert [i for p in walk(http, "status=dispatched", 13) for i in p] == kept[::-1]
    kept_spikes = [i for i in kept if i in set(spikes)]
    assert [i for p in walk(http, "alertname=TrainingLossSpike", 3) for i in p] == kept_spikes[::-1]
    assert http.get(f"/history?target=job:{ids[0].rsplit('~', 1)[1]}").get_json()["items"] == []
    # A record someone deleted leaves the listings, and the indexes, when a query meets it.
    r.delete(keys.record(kept[-1]))
    assert kept[-1] not in [i["id"] for i in http.get("/history?status=dispatched&limit=500").get_json()["items"]]
    assert r.zscore(keys.HISTORY, kept[-1]) is None


@BOTH
def test_two_writers_at_once_every_record_indexed_once(make_app: Any, r: Any) -> None:
    apps = [make_app(), make_app()]
    made: list[list[str]] = [[], []]

    def writer(k: int) -> None:
        http = apps[k].test_client()
        for b in range(10):
            made[k] += fire(http, 20, job=f"w{k}b{b}")

    threads = [threading.Thread(target=writer, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = set(made[0]) | set(made[1])
    assert len(everything) == 400
    pages = walk(apps[0].test_client(), "", 37)
    listed = [i for p in pages for i in p]
    assert full(pages, 37) and len(listed) == 400 and set(listed) == everything
    seqs = [int(r.zscore(keys.HISTORY, i)) for i in listed]
    assert seqs == sorted(seqs, reverse=True) and len(set(seqs)) == 400
    dispatched = [i for p in walk(apps[1].test_client(), "status=dispatched&playbook=loss-spike", 50) for i in p]
    assert set(dispatched) == everything


def test_an_indexer_whose_lock_lapsed_writes_nothing(http: Any, r: Any) -> None:
    # Indexer A stalled until its lock lapsed and B took it: A's next batch (one script, lua/fold.lua) must
    # write nothing, so no record gets two sequence numbers or two sets of bits; B's does the work.
    from trainmedic.service import history

    [rid] = fire(http, 1, job="stall")
    history.catch_up(r)  # indexed once, as the next history query would
    seq = int(r.zscore(keys.HISTORY, rid))
    r.zrem(keys.HISTORY, rid)  # as if it was never indexed: new again, and journaled
    r.rpush(keys.HIST_JOURNAL, f"h|{rid}")
    r.set(keys.HIST_LOCK, "B", px=history.LOCK_MS)
    assert history._fold_script(r, "A") == -1
    assert r.zscore(keys.HISTORY, rid) is None
    assert int(r.get(keys.HIST_SEQ)) == seq and r.llen(keys.HIST_JOURNAL) == 1
    assert history._fold_script(r, "B") == 1
    b_seq = int(r.zscore(keys.HISTORY, rid))
    assert b_seq == seq + 1
    status = keys.hist_bitmap(b_seq >> history.SEG_BITS, "s", "dispatched")
    assert r.getbit(status, b_seq & (history.SEG - 1)) == 1
    assert r.llen(keys.HIST_JOURNAL) == 0
    r.delete(keys.HIST_LOCK)
    assert [i["id"] for i in http.get("/history?target=job:stall-0").get_json()["items"]] == [rid]
