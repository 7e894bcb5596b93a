"""GET /history: newest first, filters, a cursor that pages without gaps or repeats."""
from __future__ import annotations

import os
import random

import pytest

from tests.conftest import load_fixture, post_json
from tests.support.keyspaces import BOTH, oldest_first


def fire(http, n: int, alertname: str = "TrainingLossSpike", job: str = "job") -> list[str]:
    ids = []
    for i in range(n):
        body = load_fixture("firing_single.json")
        a = body["alerts"][0]
        a["labels"].update(alertname=alertname, job_name=f"{job}-{i}")
        a["fingerprint"] = f"{alertname[:4].lower()}{i:012x}"
        ids += [x["id"] for x in post_json(http, "/webhook", body).json["remediations"]]
    return ids


def test_history_is_newest_first(http, r) -> None:
    ids = fire(http, 5)
    items = http.get("/history").json["items"]
    assert [i["id"] for i in items] == list(reversed(ids))


@BOTH
def test_the_cursor_pages_through_everything_once(http, r) -> None:
    ids = fire(http, 23)
    seen, cursor = [], None
    while True:
        q = "/history?limit=5" + (f"&before={cursor}" if cursor else "")
        page = http.get(q).json
        seen += [i["id"] for i in page["items"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == oldest_first(r, ids)[::-1]


@BOTH
def test_filters_select_records(http, r) -> None:
    fire(http, 3, "TrainingLossSpike")
    fire(http, 2, "GPUMemoryUsageHigh", job="mem")
    assert len(http.get("/history?alertname=GPUMemoryUsageHigh").json["items"]) == 2
    assert len(http.get("/history?playbook=loss-spike").json["items"]) == 3
    assert [i["target"]["name"] for i in http.get("/history?target=mem-1").json["items"]] == ["mem-1"]
    assert len(http.get("/history?target=job:mem-0").json["items"]) == 1
    assert len(http.get("/history?status=dispatched").json["items"]) == 5
    assert http.get("/history?status=applied").json == {"items": [], "next": None}


@BOTH
def test_a_filtered_page_has_a_cursor_to_the_rest(http, r) -> None:
    fire(http, 4, "GPUMemoryUsageHigh", job="mem")
    fire(http, 4)
    page = http.get("/history?alertname=GPUMemoryUsageHigh&limit=3").json
    assert len(page["items"]) == 3 and page["next"]
    rest = http.get(f"/history?alertname=GPUMemoryUsageHigh&limit=3&before={page['next']}").json
    assert len(rest["items"]) == 1 and rest["next"] is None


@pytest.mark.parametrize("query", ["limit=0", "limit=501", "limit=x", "limit=-1", "status=bogus",
                                   "before=nonsense", "colour=red", "target=" + "x" * 300])
def test_bad_queries_are_400(http, r, query: str) -> None:
    resp = http.get(f"/history?{query}")
    assert resp.status_code == 400 and resp.json["error"]


def test_an_unknown_record_is_404(http, r) -> None:
    assert http.get("/remediations/nope").status_code == 404
    assert http.get("/remediations/01M80ESM7D0FSDEQNX5WRJ7D3V~job~x").status_code == 404


@BOTH
def test_expired_records_drop_out_of_the_index(http, r) -> None:
    ids = oldest_first(r, fire(http, 3))
    from trainmedic.client.wire import keys
    r.delete(keys.record(ids[1]))
    assert [i["id"] for i in http.get("/history").json["items"]] == [ids[2], ids[0]]
    assert r.zcard(keys.HISTORY) == 2


def test_a_record_is_found_by_a_unique_prefix_of_its_id(http, r) -> None:
    ids = fire(http, 3)
    for rid in ids:
        # Ids made within microseconds of each other share their first characters: the shortest unique
        # prefix of each one here is usually past 8; any unique prefix of 8 or more finds it.
        n = next(n for n in range(8, 27) if sum(x.startswith(rid[:n]) for x in ids) == 1)
        for prefix in (rid[:n], rid[:n].lower(), rid[:26], rid[:-1], rid):
            got = http.get(f"/remediations/{prefix}")
            assert got.status_code == 200 and got.json["id"] == rid, (prefix, got.json)


def test_an_ambiguous_prefix_is_400_and_names_the_records(http, r) -> None:
    body = load_fixture("firing_single.json")
    body["alerts"] = [{**body["alerts"][0], "labels": {**body["alerts"][0]["labels"], "job_name": f"twin-{i}"},
                       "fingerprint": f"twin{i}"} for i in range(2)]
    ids = [x["id"] for x in post_json(http, "/webhook", body).json["remediations"]]
    common = os.path.commonprefix(ids)
    assert len(ids) == 2 and len(common) >= 8  # one notification's records are made microseconds apart
    got = http.get(f"/remediations/{common}")
    assert got.status_code == 400
    assert got.json["error"] == f"{common!r} is the start of 2 remediation ids ({ids[0]}, {ids[1]}): give more of it"


@pytest.mark.parametrize("text, words", [
    ("1K17DFQ", "no remediation with id '1K17DFQ': give its full id or at least 8 characters of it"),
    ("00000000", "no remediation with id '00000000'"),
    ("ZZZZZZZZZZ", "no remediation with id 'ZZZZZZZZZZ'"),
    ("1K17DFQZ~job~x", "no remediation with id '1K17DFQZ~job~x'"),
    ("1K17DFQZ!", "no remediation with id '1K17DFQZ!'"),
])
def test_an_unknown_or_short_prefix_is_404(http, r, text: str, words: str) -> None:
    fire(http, 1)
    got = http.get(f"/remediations/{text}")
    assert got.status_code == 404 and got.json["error"] == words


def test_prefixes_resolve_among_many_records_listed_a_little_out_of_time_order(r) -> None:
    from trainmedic.client.wire import keys
    from trainmedic.service.decide.dispatch import new_record_id
    from trainmedic.service.errors import BadRequest, NotFound
    from trainmedic.service.history import PREFIX_SLACK_US, resolve_record_id

    rng = random.Random(7)
    # 20,000 records made 30 ms apart (10 minutes), listed in an order that strays from their ids' time by up
    # to a third of the slack either way, as records indexed from clocks a little apart would be.
    start = _us(new_record_id(keys.Target("job", "j")))
    shifted = [_at(new_record_id(keys.Target("job", f"j{i % 7}")), start + i * 30_000) for i in range(20_000)]
    order = sorted(range(len(shifted)), key=lambda i: i * 30_000 + rng.uniform(-1, 1) * PREFIX_SLACK_US / 3)
    pipe = r.pipeline(transaction=False)
    for seq, i in enumerate(order):
        pipe.zadd(keys.HISTORY, {shifted[i]: seq})
        pipe.hset(keys.record(shifted[i]), "status", "applied")
    pipe.execute()
    ordered = sorted(shifted)
    for i in rng.sample(range(len(ordered)), 300):
        rid = ordered[i]
        # Its shortest unique prefix: one past what it shares with its neighbours in sorted order.
        shared = max(len(os.path.commonprefix([rid, x])) for x in ordered[max(i - 1, 0):i + 2] if x != rid)
        n = max(8, shared + 1)
        assert resolve_record_id(r, rid[:n]) == rid
        if n > 8:
            with pytest.raises(BadRequest):
                resolve_record_id(r, rid[:n - 1])
    with pytest.raises(NotFound):
        resolve_record_id(r, "0" * 10)
    # A record that expired by age (still listed until the sweep meets it) is not found.
    r.delete(keys.record(shifted[5]))
    with pytest.raises(NotFound):
        resolve_record_id(r, shifted[5][:26])


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def _us(rid: str) -> int:
    n = 0
    for c in rid[:26]:
        n = n * 32 + _CROCKFORD.index(c)
    return n >> 75


def _at(rid: str, us: int) -> str:
    """The id made at microsecond `us` instead, with the same randomness and target."""
    n = 0
    for c in rid[:26]:
        n = n * 32 + _CROCKFORD.index(c)
    n = (us << 75) | (n & ((1 << 75) - 1))
    return "".join(_CROCKFORD[(n >> 5 * i) & 31] for i in range(25, -1, -1)) + rid[26:]
