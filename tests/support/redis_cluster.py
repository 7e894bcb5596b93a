"""A real Redis Cluster of redis-server processes on 127.0.0.1, for tests and benchmarks."""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from trainmedic.service.embedded_redis import EmbeddedRedis


def free_cluster_port() -> int:
    """A free port p with p + 10000 free too (the cluster bus), below 55536 as Redis requires."""
    for _ in range(200):
        port = random.randint(20000, 55000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class EmbeddedCluster:
    """A real Redis Cluster of `masters` redis-server processes on 127.0.0.1, made with redis-cli --cluster create."""

    def __init__(self, data_dir: str | os.PathLike, masters: int = 3):
        self.data_dir = Path(data_dir)
        self.nodes = [EmbeddedRedis(self.data_dir / f"node{i}", port=free_cluster_port(), appendonly=False,
                                    extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                                "--cluster-node-timeout", "2000"))
                      for i in range(masters)]

    @property
    def url(self) -> str:
        """A plain redis:// URL of one node: trainmedic detects the cluster from it."""
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> EmbeddedCluster:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()  # never leave half a cluster running
            raise

    def _start(self, timeout: float) -> EmbeddedCluster:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if not cli:
            raise FileNotFoundError("redis-cli is needed to create a cluster (Debian package redis-tools)")
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for n in self.nodes:
                info = redis.Redis(host="127.0.0.1", port=n.port, decode_responses=True).cluster("info")
                states.append(info.get("cluster_state") if isinstance(info, dict) else None)
            if all(s == "ok" for s in states):
                return self
            time.sleep(0.1)
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
