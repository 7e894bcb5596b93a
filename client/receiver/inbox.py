"""Background threads that receive a target's commands and write its acks, never touching the caller's thread."""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, cast
from collections.abc import Callable, Sequence

import redis

from ..wire import keys
from ..wire.protocol import Ack
from ..wire.redis import DEFAULT_TIMEOUT, connect
from ..wire.signing import Verifier
from .mailbox import Entry, Mailbox

log = logging.getLogger("trainmedic.client")

# How often the receiver re-reads the mailbox without a wake-up: pub/sub loses messages
# published while we were reconnecting, the stream does not.
RESCAN_INTERVAL = 2.0
MAX_BACKOFF = 5.0
FIRST_BACKOFF = 0.1


@dataclass(frozen=True)
class Ledger:
    """The job's ledger of sticky LR changes, read in the background after a resume."""

    entries: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Release:
    """Hand a claimed, unapplied command back to the target's next process."""

    record_id: str


@dataclass(frozen=True)
class Reapplied:
    """Note on an action that this process applied it again after a resume."""

    record_id: str
    index: int
    at: str
    step: int | None
    by: str


@dataclass(frozen=True)
class Detection:
    """A detection of the job's in-loop detectors that began (firing) or cleared (resolved), for the service."""

    alertname: str
    status: str
    starts_at: str
    ends_at: str
    step: int | None
    value: float | None


Outgoing = Ack | Release | Reapplied | Detection
Ready = Entry | Ledger


class Inbox:
    """Receives claimed commands into `ready` (a deque) and writes acks, both in daemon threads."""

    def __init__(self, url: str, target: keys.Target, info: Callable[[], dict[str, Any]], identity: str,
                 verifier: Verifier | None = None, heartbeat_interval: float = 5.0, name: str = "trainmedic", *,
                 max_backoff: float = MAX_BACKOFF, timeout: float = DEFAULT_TIMEOUT, client_name: str | None = None,
                 on_ready: Callable[[], None] | None = None):
        self.url = url
        self.target = target
        self.info = info
        self.identity = identity
        self.verifier = verifier
        self.heartbeat_interval = heartbeat_interval
        self.max_backoff = max(max_backoff, FIRST_BACKOFF)
        self.timeout = timeout
        self.on_ready = on_ready
        self._conn_kw: dict[str, Any] = {"client_name": client_name} if client_name else {}
        # deque append/popleft are atomic: the receiver appends, poll() pops, no lock on the hot path.
        self.ready: collections.deque[Ready] = collections.deque()
        self._out: queue.Queue[Outgoing | None] = queue.Queue()
        self._stop = threading.Event()
        self._ledger_wanted = threading.Event()
        self._beat_now = threading.Event()
        self._lock = threading.Lock()
        self._failing: set[str] = set()  # which threads currently cannot reach Redis
        self._beaten = False  # whether this process has sent its first heartbeat
        self.outages = 0
        self._threads = [
            threading.Thread(target=self._receive_loop, name=f"{name}-receive", daemon=True),
            threading.Thread(target=self._send_loop, name=f"{name}-ack", daemon=True),
        ]

    def start(self) -> Inbox:
        for t in self._threads:
            t.start()
        return self

    def send(self, items: Sequence[Outgoing]) -> None:
        """Queue acks, releases and reapply notes for the writer thread (never blocks)."""
        for item in items:
            self._out.put(item)

    def want_ledger(self) -> None:
        """Read the job's ledger in the background; it arrives in `ready` as a Ledger."""
        self._ledger_wanted.set()

    def stop_receiving(self, timeout: float = 3.0) -> None:
        """Stop claiming new commands (the writer goes on until close())."""
        self._stop.set()
        if self._threads[0].is_alive():
            self._threads[0].join(timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Stop both threads, giving queued writes up to `timeout` seconds to go out."""
        self._out.put(None)
        deadline = time.monotonic() + timeout
        if self._threads[1].is_alive():
            self._threads[1].join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        if self._threads[0].is_alive():
            self._threads[0].join(max(0.0, deadline - time.monotonic()))

    @property
    def pending_acks(self) -> int:
        return self._out.qsize()

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

    def _connect(self) -> Any:
        return connect(self.url, timeout=self.timeout, **self._conn_kw)

    # -- receiving
    def _receive_loop(self) -> None:
        backoff = FIRST_BACKOFF
        while not self._stop.is_set():
            r = None
            pubsub = None
            try:
                r = self._connect()
                mb = Mailbox(r, self.target, self.verifier)
                pubsub = cast(Any, r).pubsub(ignore_subscribe_messages=True)  # redis-py leaves it untyped
                pubsub.subscribe(keys.wake_channel(self.target))
                last_beat = float("-inf")
                last_scan = float("-inf")
                woken = True
                while not self._stop.is_set():
                    now = time.monotonic()
                    if now - last_beat >= self.heartbeat_interval or self._beat_now.is_set():
                        self._beat_now.clear()
                        mb.heartbeat(self._info(), first=not self._beaten)
                        self._beaten = True
                        last_beat = now
                    if self._ledger_wanted.is_set():
                        self.ready.append(Ledger(tuple(mb.ledger())))
                        self._ledger_wanted.clear()
                        self._notify()
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

    def beat_soon(self) -> None:
        """Send the next heartbeat at the loop's next turn (what it says changed: a handler was registered)."""
        self._beat_now.set()

    def _info(self) -> dict[str, Any]:
        try:
            return self.info()
        except Exception:
            return {}

    def _notify(self) -> None:
        if self.on_ready is not None:
            self.on_ready()

    def _drain(self, mb: Mailbox) -> None:
        while not self._stop.is_set():
            entries = mb.fetch()
            took = False
            for e in entries:
                # The claim moves the cursor in Redis first: a command is applied at most once, also when the
                # process dies between here and the apply (the reconciler then offers it to the next one).
                answer = mb.claim(e, self.identity)
                if e.refused is not None:
                    mb.count_refused(e.refused)
                    log.warning("trainmedic: refused a command in %s's mailbox (entry %s): %s", self.target.label,
                                e.entry_id, e.error)
                elif e.command is None and e.error is not None:
                    log.warning("trainmedic: ignored a malformed command in %s's mailbox (entry %s): %s",
                                self.target.label, e.entry_id, e.error)
                elif answer == "ok" and e.command is not None:
                    self.ready.append(e)
                    took = True
                elif answer == "ok" and e.record_id:
                    # Its command was stored anew since it was read: hand it back for the next look.
                    mb.release(e.record_id)
                elif answer == "replayed":
                    # Its record was acknowledged already: the same signed bytes were delivered again.
                    mb.count_refused("replayed")
                    log.warning("trainmedic: ignored a replay of command %s, which was acknowledged already",
                                e.record_id)
                elif answer == "missing":
                    # No record holds it: not a command the service made (or one long gone). Never applied.
                    log.warning("trainmedic: ignored a command for unknown remediation %s", e.record_id)
            if took:
                self._notify()
            if len(entries) < 100:
                return

    # -- writing acks, releases and reapply notes
    def _send_loop(self) -> None:
        r = None
        backoff = FIRST_BACKOFF
        batch: list[Outgoing] = []
        closing = False
        refusals = 0
        while True:
            if not batch:
                item = self._out.get()
                if item is None:
                    return
                batch.append(item)
            while True:  # take whatever else is queued, so one round trip carries it all
                try:
                    item = self._out.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                batch.append(item)
            try:
                if r is None:
                    r = self._connect()
                self._write(Mailbox(r, self.target, self.verifier), batch)  # idempotent: safe to retry
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

    @staticmethod
    def _write(mb: Mailbox, batch: list[Outgoing]) -> None:
        acks = [x for x in batch if isinstance(x, Ack)]
        if acks:
            mb.ack(acks)
        for x in batch:
            if isinstance(x, Release):
                mb.release(x.record_id)
            elif isinstance(x, Reapplied):
                mb.reapply(x.record_id, x.index, x.at, x.step, x.by)
            elif isinstance(x, Detection):
                mb.detect(x.alertname, x.status, x.starts_at, x.ends_at, x.step, x.value)
