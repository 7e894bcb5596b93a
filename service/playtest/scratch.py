"""A run's surroundings: a private Redis started and removed for it, and the service's log held while it runs."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

import redis

from ..embedded_redis import EmbeddedRedis
from .engine import EngineError


class ServiceLog(logging.Handler):
    """The service's log while the engine runs: errors are kept (a step the service gave up on), the rest is
    left out of the command's output."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.errors.append(record.getMessage())


@contextlib.contextmanager
def captured() -> Iterator[ServiceLog]:
    """Hold the service's log lines for the engine's run (errors are returned, nothing is printed)."""
    logger = logging.getLogger("trainmedic")
    handler = ServiceLog()
    was = logger.handlers[:], logger.propagate, logger.level
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.ERROR)
    try:
        yield handler
    finally:
        logger.handlers, logger.propagate = was[0], was[1]
        logger.setLevel(was[2])


@contextlib.contextmanager
def scratch() -> Iterator[redis.Redis]:
    """A private Redis (the embedded one, no persistence) for one run, removed afterwards; never the user's."""
    folder = tempfile.mkdtemp(prefix="trainmedic-test-")
    sock = os.path.join(folder, "redis.sock")
    # A Unix socket: a third less time a round trip than TCP on loopback, and the engine's run is round trips.
    server = EmbeddedRedis(folder, appendonly=False, extra_args=("--unixsocket", sock, "--unixsocketperm", "700"))
    try:
        try:
            server.start()
        except (RuntimeError, FileNotFoundError, OSError) as exc:
            raise EngineError(f"cannot start a scratch Redis: {exc}") from None
        client = redis.Redis(unix_socket_path=sock, decode_responses=True, socket_timeout=30)
        try:
            yield client
        finally:
            client.close()
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
