"""Background threads that receive a target's commands and send its acks, never touching the caller's thread."""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Callable

import redis

from . import keys
from .mailbox import Entry, Mailbox
from .protocol import Ack
from .redis_conn import connect

log = logging.getLogger("trainmedic.client")

# How often the receiver re-reads the mailbox without a wake-up: pub/sub loses messages
# published while we were reconnecting, the stream does not.
RESCAN_INTERVAL = 2.0
MAX_BACKOFF = 5.0


class Inbox:
    """Receives claimed commands into `ready` (a deque) and sends queued acks, both in daemon threads."""

    def __init__(self, url: str, target: keys.Target, info: Callable[[], dict],
                 heartbeat_interval: float = 5.0, name: str = "trainmedic"):
        self.url = url
        self.target = target
        self.info = info
        self.heartbeat_interval = heartbeat_interval
        self.ready: collections.deque[Entry] = collections.deque()
        self._acks: queue.Queue[Ack | None] = queue.Queue()
        self._stop = threading.Event()
        self._down_logged = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._receive_loop, name=f"{name}-receive", daemon=True),
            threading.Thread(target=self._ack_loop, name=f"{name}-ack", daemon=True),
        ]

    def start(self) -> "Inbox":
        for t in self._threads:
            t.start()
        return self

    def send(self, acks: list[Ack]) -> None:
        """Queue acks for the ack thread (never blocks)."""
        for a in acks:
            self._acks.put(a)

    def close(self, timeout: float = 2.0) -> None:
        """Stop both threads, giving queued acks up to `timeout` seconds to go out."""
        self._acks.put(None)
        deadline = time.monotonic() + timeout
        self._threads[1].join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self._threads[0].join(max(0.0, deadline - time.monotonic()))

    @property
    def pending_acks(self) -> int:
        return self._acks.qsize()

    # -- health, logged once per outage rather than once per attempt
    def _down(self, exc: Exception) -> None:
        with self._lock:
            if not self._down_logged:
                log.warning("trainmedic: Redis unavailable for %s (%s); training continues, will retry",
                            self.target.label, exc)
                self._down_logged = True

    def _up(self) -> None:
        with self._lock:
            if self._down_logged:
                log.warning("trainmedic: Redis reachable again for %s", self.target.label)
                self._down_logged = False

    # -- receiving
    def _receive_loop(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            r = None
            pubsub = None
            try:
                r = connect(self.url)
                mb = Mailbox(r, self.target)
                pubsub = r.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(keys.wake_channel(self.target))
                last_beat = 0.0
                last_scan = 0.0
                woken = True
                while not self._stop.is_set():
                    now = time.monotonic()
                    if now - last_beat >= self.heartbeat_interval:
                        mb.heartbeat(self.info())
                        last_beat = now
                    if woken or now - last_scan >= RESCAN_INTERVAL:
                        self._drain(mb)
                        last_scan = now
                    self._up()
                    backoff = 0.2
                    msg = pubsub.get_message(timeout=min(RESCAN_INTERVAL, self.heartbeat_interval, 1.0))
                    woken = msg is not None
            except redis.RedisError as exc:
                self._down(exc)
            except Exception:  # a bug here must not kill the receiver for good
                log.exception("trainmedic: receiver error for %s", self.target.label)
            finally:
                for c in (pubsub, r):
                    try:
                        if c is not None:
                            c.close()
                    except Exception:
                        pass
            self._stop.wait(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    def _drain(self, mb: Mailbox) -> None:
        while True:
            entries = mb.fetch()
            for e in entries:
                # The claim moves the cursor in Redis first: a command is applied at most once,
                # also when the process dies between here and the apply.
                if mb.claim(e):
                    self.ready.append(e)
            if len(entries) < 100:
                return

    # -- acking
    def _ack_loop(self) -> None:
        r = None
        backoff = 0.2
        batch: list[Ack] = []
        closing = False
        while True:
            if not batch:
                item = self._acks.get()
                if item is None:
                    return
                batch.append(item)
            while True:  # take whatever else is queued, so one round trip carries it all
                try:
                    item = self._acks.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                batch.append(item)
            try:
                if r is None:
                    r = connect(self.url)
                Mailbox(r, self.target).ack(batch)
                batch = []
                backoff = 0.2
                self._up()
                if closing:
                    return
            except redis.RedisError as exc:
                self._down(exc)
                r = None
                if closing or self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, MAX_BACKOFF)
            except Exception:
                log.exception("trainmedic: could not send acks for %s", self.target.label)
                batch = []
