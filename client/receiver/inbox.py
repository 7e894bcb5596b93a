"""Background threads that receive a target's commands and write its acks, never touching the caller's thread.

The receiver blocks on the target's mailbox (XREAD BLOCK) between heartbeats: an idle applier wakes once a
heartbeat interval, and a command wakes it at once. The writer sends acks, releases, reapply notes and
detections, and does what is asked of it meanwhile (the ledger, a heartbeat now), so nothing waits for the
receiver's block to end."""
from __future__ import annotations

import collections
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

import redis

from ..wire import keys
from ..wire.protocol import Ack
from ..wire.redis import DEFAULT_TIMEOUT, connect
from ..wire.signing import Verifier
from .mailbox import FETCH, Entry, Mailbox

log = logging.getLogger("trainmedic.client")

MAX_BACKOFF = 5.0
FIRST_BACKOFF = 0.1
# A live target tells the service it is there this often (and at its first heartbeat): a service that
# restarted knows every live target within this long.
ANNOUNCE_EVERY = 30.0


@dataclass(frozen=True)
class Ledger:
    """The job's ledger of sticky LR changes, read in the background after a resume."""

    entries: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class _Ask:
    """What the writer is asked to do besides writing: read the ledger, or send a heartbeat now."""

    what: str


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
    labels: tuple[tuple[str, str], ...] = ()  # what it names besides the job (a straggler: node, rank)


@dataclass(frozen=True)
class Closed:
    """The process closed: its last heartbeat, written in order after what was queued before it."""

    info: dict[str, Any]


Outgoing = Ack | Release | Reapplied | Detection | Closed | _Ask
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
        self._lock = threading.Lock()
        self._failing: set[str] = set()  # which threads currently cannot reach Redis
        self._beaten = False  # whether this process has sent its first heartbeat
        self._announced = float("-inf")  # when it last told the service it is there (monotonic)
        self._receiving: Any = None  # the receiver's connection while it blocks (stop_receiving interrupts it)
        self._claiming: Entry | None = None  # the entry being claimed (asked again if the answer was lost)
        # When each command read was issued (by record id): its acks' latency counts from then.
        self._issued: dict[str, float] = {}
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
        """Queue acks, releases, reapply notes, detections and heartbeats for the writer thread (never blocks)."""
        for item in items:
            self._out.put(item)

    def want_ledger(self) -> None:
        """Read the job's ledger in the background; it arrives in `ready` as a Ledger."""
        self._out.put(_Ask("ledger"))

    def stop_receiving(self, timeout: float = 3.0) -> None:
        """Stop claiming new commands (the writer goes on until close())."""
        self._stop.set()
        self._interrupt()
        if self._threads[0].is_alive():
            self._threads[0].join(timeout)

    def _interrupt(self) -> None:
        """End the receiver's block on the mailbox now (its connection is closed under it)."""
        r = self._receiving
        if r is None:
            return
        try:
            pool = getattr(r, "connection_pool", None)
            if pool is not None:
                pool.disconnect(inuse_connections=True)
            else:  # Redis Cluster
                r.close()
        except Exception:
            log.debug("trainmedic: could not interrupt the receiver", exc_info=True)

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

    def _connect(self, block: float = 0.0) -> Any:
        """A connection; `block`: the longest it will wait for a blocking read (its socket waits that much more)."""
        return connect(self.url, timeout=self.timeout + block, **self._conn_kw)

    def _beat(self, mb: Mailbox) -> None:
        """One heartbeat, which tells the service too at the first one and every ANNOUNCE_EVERY seconds."""
        now = time.monotonic()
        announce = not self._beaten or now - self._announced >= ANNOUNCE_EVERY
        mb.heartbeat(self._info(), announce=announce)
        self._beaten = True
        if announce:
            self._announced = now

    # -- receiving
    def _receive_loop(self) -> None:
        backoff = FIRST_BACKOFF
        while not self._stop.is_set():
            r = None
            try:
                r = self._connect(block=self.heartbeat_interval)
                self._receiving = r
                if self._stop.is_set():
                    break
                mb = Mailbox(r, self.target, self.verifier, self._issued)
                self._beat(mb)
                last_beat = time.monotonic()
                # A claim whose answer was lost with the connection: the script may have taken the entry (and
                # moved the cursor past it), so it is asked again; a second claim by this process answers 'ok'.
                if self._claiming is not None:
                    self._drain(mb, [self._claiming])
                # Whatever came while this process was away (or before it started), from the saved cursor.
                after = self._drain(mb, mb.fetch()) or mb.cursor()
                self._up("receive")
                backoff = FIRST_BACKOFF
                while not self._stop.is_set():
                    wait = last_beat + self.heartbeat_interval - time.monotonic()
                    if wait <= 0:
                        self._beat(mb)
                        last_beat = time.monotonic()
                        continue
                    raw = mb.wait(after, int(wait * 1000))
                    if raw and not self._stop.is_set():
                        after = self._drain(mb, mb.fetch(raw)) or raw[-1][0]
                    self._up("receive")
            except Exception as exc:  # Redis errors and bugs alike: never let the receiver die for good
                if self._stop.is_set():
                    break
                if not isinstance(exc, redis.RedisError):
                    log.debug("trainmedic: receiver error", exc_info=True)
                self._down("receive", exc)
            finally:
                self._receiving = None
                try:
                    if r is not None:
                        r.close()
                except Exception:
                    pass
            # Spread out: processes that lost Redis together do not all come back in the same instant.
            self._stop.wait(backoff * random.uniform(0.5, 1.5))
            backoff = min(backoff * 2, self.max_backoff)

    def beat_soon(self) -> None:
        """Send a heartbeat now (what it says changed: a handler was registered)."""
        self._out.put(_Ask("beat"))

    def _info(self) -> dict[str, Any]:
        try:
            return self.info()
        except Exception:
            return {}

    def _notify(self) -> None:
        if self.on_ready is not None:
            self.on_ready()

    def _drain(self, mb: Mailbox, entries: list[Entry]) -> str:
        """Claim what these entries (and any after them) hold; the last entry id seen ('' for none)."""
        last = ""
        while entries and not self._stop.is_set():
            took = False
            for e in entries:
                # The claim moves the cursor in Redis first: a command is applied at most once, also when the
                # process dies between here and the apply (the reconciler then offers it to the next one).
                self._claiming = e
                answer = mb.claim(e, self.identity)
                self._claiming = None
                last = e.entry_id
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
                    # Its command was made anew since it was read: hand it back for the next look.
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
            if len(entries) < FETCH:
                break
            entries = mb.fetch()
        return last

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
                self._write(Mailbox(r, self.target, self.verifier, self._issued), batch)  # idempotent: safe to retry
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

    def _write(self, mb: Mailbox, batch: list[Outgoing]) -> None:
        acks = [x for x in batch if isinstance(x, Ack)]
        if acks:
            mb.ack(acks)
        for x in batch:
            if isinstance(x, Release):
                mb.release(x.record_id)
            elif isinstance(x, Reapplied):
                mb.reapply(x.record_id, x.index, x.at, x.step, x.by)
            elif isinstance(x, Detection):
                mb.detect(x.alertname, x.status, x.starts_at, x.ends_at, x.step, x.value, x.labels)
            elif isinstance(x, _Ask) and x.what == "ledger":
                self.ready.append(Ledger(tuple(mb.ledger())))
                self._notify()
            elif isinstance(x, _Ask) and x.what == "beat":
                self._beat(mb)
            elif isinstance(x, Closed):
                mb.closed(x.info)
