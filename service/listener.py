"""What appliers tell the service on their own channels (keys.up_channel), heard as it is said.

Every gunicorn worker listens (PSUBSCRIBE keys.UP_PATTERN): a detection is decided at once (one process claims
each, service/decide/detections.py); acks that settled a record make the target due now for the reconciler,
which folds in what the applier's scripts left (service/fold.py) and follows the record up; a heartbeat's
announcement makes the target known and live (service/beats.py). Pub/sub loses what is said while nobody
listens, so nothing depends on it alone: each time the listener (re)subscribes, every target with something
due is looked at at once, every known target whose applier left acks or counts behind is folded in at the
next read of the history or /metrics, and a target's records and detections are looked at when they fall due
anyway.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any
from collections.abc import Callable

import redis

from ..client.wire import keys
from ..client.wire.protocol import ACKS, BEAT, DETECTED

from . import beats

log = logging.getLogger("trainmedic.listener")

# What the listener heard of acks and announcements is written at most this often, in one round trip.
FLUSH_EVERY = 0.01
# Known targets looked at per round trip for what their appliers left while nobody listened.
SCAN_BATCH = 1000


class Listener:
    """A daemon thread that hears every target's channel to the service; see the module's docstring."""

    def __init__(self, r: Any, detected: Callable[[keys.Target], Any]):
        self.r = r
        self.detected = detected
        self._stop = threading.Event()
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self, wait: float = 2.0) -> Listener:
        """Listen in a daemon thread until stop(); returns once it listens (or after `wait` seconds)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._listen, name="trainmedic-listener", daemon=True)
            self._thread.start()
            self._listening.wait(wait)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _listen(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = self.r.pubsub(ignore_subscribe_messages=True)
                pubsub.psubscribe(keys.UP_PATTERN)
                pubsub.get_message(timeout=1.0)  # the subscription's confirmation: listening from here on
                # Whatever was said while nobody listened: every target with something due is looked at now, and
                # what appliers left in their own keys is folded in.
                due_all_now(self.r)
                left_behind(self.r)
                self._listening.set()
                if self._failing:
                    self._failing = False
                    log.info("listening to trainers and agents again")
                backoff = 0.1
                self._serve(pubsub)
            except redis.RedisError as exc:
                if not self._failing:
                    self._failing = True
                    log.warning("cannot listen to trainers and agents (%s); the reconciler's passes find what "
                                "they said meanwhile", exc)
            except Exception:  # a bug must not stop listening for good
                log.exception("the listener failed")
            finally:
                try:
                    if pubsub is not None:
                        pubsub.close()
                except Exception:
                    pass
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 5.0)

    def _serve(self, pubsub: Any) -> None:
        acked: set[keys.Target] = set()
        beat: set[keys.Target] = set()
        flush_at = 0.0
        while not self._stop.is_set():
            msg = pubsub.get_message(timeout=FLUSH_EVERY if (acked or beat) else 1.0)
            if msg is not None:
                target = keys.up_target(str(msg.get("channel")))
                what = msg.get("data")
                if target is None:
                    continue
                if what == DETECTED and target.kind == "job":
                    self._safely(target)
                elif what == ACKS:
                    acked.add(target)
                elif what == BEAT:
                    beat.add(target)
                if not flush_at:
                    flush_at = time.monotonic() + FLUSH_EVERY
            if (acked or beat) and time.monotonic() >= flush_at:
                if acked:
                    due_now(self.r, acked)
                if beat:
                    beats.announce(self.r, beat)
                acked, beat, flush_at = set(), set(), 0.0

    def _safely(self, target: keys.Target) -> None:
        try:
            self.detected(target)
        except redis.RedisError:
            raise
        except Exception:  # one job's bad entry must not stop the others
            log.exception("deciding %s's detections failed", target.label)


def due_now(r: Any, targets: set[keys.Target], now: float | None = None) -> None:
    """The reconciler looks at these targets at its next pass, and the history folds their journals first."""
    labels = sorted(t.label for t in targets)
    now_ms = int((time.time() if now is None else now) * 1000)
    pipe = r.pipeline(transaction=False)
    pipe.zadd(keys.DUE, dict.fromkeys(labels, now_ms), lt=True)
    pipe.sadd(keys.HIST_DIRTY, *labels)
    pipe.execute()


def due_all_now(r: Any) -> None:
    """Every target with something due is looked at now (what its applier said may not have been heard)."""
    now_ms = int(time.time() * 1000)
    labels = [str(x) for x in r.zrange(keys.DUE, 0, -1)]
    for start in range(0, len(labels), 10_000):
        r.zadd(keys.DUE, dict.fromkeys(labels[start:start + 10_000], now_ms), lt=True)


def left_behind(r: Any) -> None:
    """Every known target whose applier left a journal or counts in its own keys is named for the next fold
    (what it said about them was said while nobody listened)."""
    labels = [str(x) for x in r.zrange(keys.TARGETS, 0, -1)]
    for start in range(0, len(labels), SCAN_BATCH):
        batch = [(x, t) for x, t in ((x, keys.parse_label(x)) for x in labels[start:start + SCAN_BATCH])
                 if t is not None]
        pipe = r.pipeline(transaction=False)
        for _, t in batch:
            pipe.exists(keys.journal(t), keys.target_metrics(t))
        found = [x for (x, _), n in zip(batch, pipe.execute()) if n]
        if found:
            r.sadd(keys.HIST_DIRTY, *found)
