"""GET /history: newest first, filters, a cursor that pages without gaps or repeats."""
from __future__ import annotations


import pytest

from tests.conftest import load_fixture, post_json


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
    assert seen == list(reversed(ids))


def test_filters_select_records(http, r) -> None:
    fire(http, 3, "TrainingLossSpike")
    fire(http, 2, "GPUMemoryUsageHigh", job="mem")
    assert len(http.get("/history?alertname=GPUMemoryUsageHigh").json["items"]) == 2
    assert len(http.get("/history?playbook=loss-spike").json["items"]) == 3
    assert [i["target"]["name"] for i in http.get("/history?target=mem-1").json["items"]] == ["mem-1"]
    assert len(http.get("/history?target=job:mem-0").json["items"]) == 1
    assert len(http.get("/history?status=dispatched").json["items"]) == 5
    assert http.get("/history?status=applied").json == {"items": [], "next": None}


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


def test_expired_records_drop_out_of_the_index(http, r) -> None:
    ids = fire(http, 3)
    from trainmedic.client.wire import keys
    r.delete(keys.record(ids[1]))
    assert [i["id"] for i in http.get("/history").json["items"]] == [ids[2], ids[0]]
    assert r.zcard(keys.HISTORY) == 2
