"""Background threads that receive a target's commands and send its acks, never touching the caller's thread."""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Callable

import redis

from trainmedic.client.wire import keys
from trainmedic.client.receiver.mailbox import Entry, Mailbox
from trainmedic.client.wire.protocol import Ack
from trainmedic.client.wire.redis import DEFAULT_TIMEOUT, connect

log = logging.getLogger("trainmedic.client")

# How often the receiver re-reads the mailbox without a wake-up: pub/sub loses messages
# published while we were reconnecting, the stream does not.
RESCAN_INTERVAL = 2.0
MAX_BACKOFF = 5.0
FIRST_BACKOFF = 0.1


class Inbox:
    """Receives claimed commands into `ready` (a deque) and sends queued acks, both in daemon threads."""

    def __init__(self, url: str, target: keys.Target, info: Callable[[], dict],
                 heartbeat_interval: float = 5.0, name: str = "trainmedic", *, max_backoff: float = MAX_BACKOFF,
                 timeout: float = DEFAULT_TIMEOUT, client_name: str | None = None):
        self.url = url
        self.target = target
        self.info = info
        self.heartbeat_interval = heartbeat_interval
        self.max_backoff = max(max_backoff, FIRST_BACKOFF)
        self.timeout = timeout
        self._conn_kw: dict[str, Any] = {"client_name": client_name} if client_name else {}
        # deque append/popleft are atomic: the receiver appends, poll() pops, no lock on the hot path.
        self.ready: collections.deque[Entry] = collections.deque()
        self._acks: queue.Queue[Ack | None] = queue.Queue()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._failing: set[str] = set()  # which threads currently cannot reach Redis
        self.outages = 0
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
        if self._threads[1].is_alive():
            self._threads[1].join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        if self._threads[0].is_alive():
            self._threads[0].join(max(0.0, deadline - time.monotonic()))

    @property
    def pending_acks(self) -> int:
        return self._acks.qsize()

    @property
    def connected(self) -> bool:
        """False from the first failed Redis call until the next successful one."""
        with self._lock:
            return not self._failing

    # -- health: one warning when an outage starts, one info line when it ends, nothing per retry
    def _down(self, who: str, exc: BaseException) -> None:
        with self._lock:
            first = not self._failing
            self._failing.add(who)
            if first:
                self.outages += 1
        if first:
            log.warning("trainmedic: Redis unreachable for %s (%s: %s); training continues, retrying in the "
                        "background", self.target.label, type(exc).__name__, exc)

    def _up(self, who: str) -> None:
        with self._lock:
            if who not in self._failing:
                return
            self._failing.discard(who)
            last = not self._failing
        if last:
            log.info("trainmedic: Redis reachable again for %s", self.target.label)

    def _connect(self) -> redis.Redis:
        return connect(self.url, timeout=self.timeout, **self._conn_kw)

    # -- receiving
    def _receive_loop(self) -> None:
        backoff = FIRST_BACKOFF
        while not self._stop.is_set():
            r = None
            pubsub = None
            try:
                r = self._connect()
                mb = Mailbox(r, self.target)
                pubsub = r.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(keys.wake_channel(self.target))
                last_beat = float("-inf")
                last_scan = float("-inf")
                woken = True
                while not self._stop.is_set():
                    now = time.monotonic()
                    if now - last_beat >= self.heartbeat_interval:
                        mb.heartbeat(self._info())
                        last_beat = now
                    if woken or now - last_scan >= RESCAN_INTERVAL:
                        self._drain(mb)
                        last_scan = now
                    self._up("receive")
                    backoff = FIRST_BACKOFF
                    msg = pubsub.get_message(timeout=min(RESCAN_INTERVAL, self.heartbeat_interval, 0.5))
                    woken = msg is not None
            except Exception as exc:  # Redis errors and bugs alike: never let the receiver die for good
                if not isinstance(exc, redis.RedisError):
                    log.debug("trainmedic: receiver error", exc_info=True)
                self._down("receive", exc)
            finally:
                for c in (pubsub, r):
                    try:
                        if c is not None:
                            c.close()
                    except Exception:
                        pass
            self._stop.wait(backoff)
            backoff = min(backoff * 2, self.max_backoff)

    def _info(self) -> dict:
        try:
            return self.info()
        except Exception:
            return {}

    def _drain(self, mb: Mailbox) -> None:
        while not self._stop.is_set():
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
        backoff = FIRST_BACKOFF
        batch: list[Ack] = []
        closing = False
        refusals = 0
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
                    r = self._connect()
                Mailbox(r, self.target).ack(batch)  # idempotent: a retried ack never overwrites a final one
                batch, refusals = [], 0
                backoff = FIRST_BACKOFF
                self._up("ack")
            except redis.ResponseError as exc:
                # Redis answered with an error. READONLY / TRYAGAIN pass with a failover; anything else
                # would fail the same way forever, so give up on this batch after a few tries.
                refusals += 1
                if refusals >= 5 or closing:
                    log.warning("trainmedic: Redis refused acks for %s (%s); dropped %d", self.target.label,
                                exc, len(batch))
                    batch, refusals = [], 0
                elif self._stop.wait(backoff):
                    return
            except redis.RedisError as exc:
                self._down("ack", exc)
                try:
                    if r is not None:
                        r.close()
                except Exception:
                    pass
                r = None
                if closing and self._stop.is_set():
                    return
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, self.max_backoff)
            except Exception:
                log.exception("trainmedic: could not send acks for %s", self.target.label)
                batch = []
            if closing and not batch:  # the close() sentinel was taken above: nothing more will come
                return
