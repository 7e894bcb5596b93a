"""RemediationClient: the in-loop applier of a training job's commands."""
from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import Any
from collections.abc import Callable

from ..receiver.applier import ActionSkipped, ActionUnsupported, Applier, Interrupted, Invocation
from ..receiver.inbox import Closed, Detection, Inbox, Ledger, Reapplied, Release
from ..receiver.mailbox import Entry
from ..settings import Settings
from ..wire import keys
from ..wire.actions import CATALOGUE
from ..wire.protocol import Ack, Command, parse_rfc3339, rfc3339
from ..wire.redis import redis_url
from ..wire.signing import SigningError, verifier_from
from . import lr as lrmod
from .detect import ALERTS, NAN, SPIKE, DetectSettings, Detector
from .distributed import NONE, SIGNALS, Delivery, Ranks, env_rank
from .goodput import Accountant, stall_after
from .identity import job_name, node_name
from .state import STATE_VERSION, AppliedState
from .straggler import NEVER, STRAGGLER, UNMEASURED, Probe, ProbeClock, Stragglers, slowest

log = logging.getLogger("trainmedic.client")

Handler = Callable[[dict[str, Any]], Any]

# A tensor passed to poll() is read (a device synchronisation) on one call in this many, never on the others.
TENSOR_EVERY = 10


class RemediationClient:
    """Receives a job's commands in the background and applies them when the loop calls poll()."""

    def __init__(self, job: str | None = None, redis_url: str | None = None, optimizer: Any = None,
                 scheduler: Any = None, *, sync_every: int = 1, heartbeat_interval: float = 5.0,
                 max_backoff: float = 5.0, redis_timeout: float = 2.0, start: bool = True,
                 verify_key: str | None = None, detect: Any = True):
        settings = Settings.from_env()
        try:
            self.job = job_name(job, os.environ)
        except ValueError as exc:
            raise ValueError(f"RemediationClient: {exc}") from None
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError("RemediationClient: sync_every must be an integer >= 1")
        self.url = _url(redis_url or settings.redis_url)
        try:
            # Commands are verified when a key is given (or TRAINMEDIC_VERIFY_KEY is set); else taken unsigned.
            verifier = verifier_from([verify_key] if verify_key else settings.verify_keys)
        except SigningError as exc:
            raise ValueError(f"RemediationClient: {exc}") from None
        try:
            detect_settings = DetectSettings.of(detect)
            stall = stall_after(os.environ)
        except ValueError as exc:
            raise ValueError(f"RemediationClient: {exc}") from None
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sync_every = sync_every
        # Training signals (README: the training client): the latest this process was given.
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.samples = 0.0  # samples processed, as poll(samples=) counted them
        self._sampled = False
        self._tensor_calls = 0
        self._detector = Detector(detect_settings) if detect_settings is not None else None
        self._detect_settings = detect_settings
        self._observe = self._detector.observe if self._detector is not None else None  # bound once: the hot path
        # Rank 0: the job's detections it raised and has not resolved (alertname -> startsAt), and what the ranks
        # reported at the last collective (highest loss, highest grad norm, fewest samples).
        self._alerts: dict[str, str] = {}
        self._job: tuple[float | None, float | None, float | None] | None = None
        # Stragglers (README: the training client): rank 0's judge and its schedule of probes (made at the
        # first collective, with straggler detection on), every rank's probe (made at its first probe), and
        # this rank's probe time to hand over at the next collective (None: no probe is being compared).
        self._stragglers: Stragglers | None = None
        self._clock: ProbeClock | None = None
        self._probe_left = NEVER  # rank 0: collectives until the next probe (0: due now)
        self._probe: Probe | None = None
        self._carry: float | None = None
        self._straggler_labels: tuple[tuple[str, str], ...] = ()
        # The heartbeat thread's view of progress: the step it last saw, since when, and the samples rate.
        self._beat_step: int | None = None
        self._step_since = 0.0
        self._beat_samples: tuple[float, float] | None = None
        self._sps: float | None = None
        self.target = keys.Target("job", self.job)
        # The node this process runs on (checkpoint_jobs finds jobs by it), and every rank's once they met.
        self.node = node_name(os.environ)
        self._nodes: list[str] | None = None
        self.step: int | None = None
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        self._ranks = Ranks.detect()
        self._checked_ranks = self._ranks.world > 1
        # One process, and its ranks looked at (at the first poll): poll() may answer an idle step at once.
        self._solo = False
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        if self._ranks.world > 1:
            self.identity += f":{self._ranks.rank}"
        self.state = AppliedState()
        self.applier = Applier("job", self.identity, self.state,
                               hint=" in this training process (register one with @RemediationClient.handler)")
        for action, fn in _BUILTINS.items():
            self.applier.register(action, self._builtin(fn))
        # Only rank 0 talks to Redis; the others get rank 0's commands through the collective.
        # Before init_process_group the launcher's RANK says which process that will be.
        self._inbox: Inbox | None = None
        self._ready: Any = None  # the inbox's deque: the only thing an idle poll() looks at
        # Goodput (README): rank 0 accounts for the job's time, from the steps it is given; the others add nothing.
        self._goodput: Accountant | None = None
        if (self._ranks.rank if self._ranks.world > 1 else env_rank()) == 0:
            self._goodput = Accountant(stall, lambda: self.step)
            self._inbox = Inbox(self.url, self.target, self._heartbeat_info, self.identity, verifier,
                                heartbeat_interval=heartbeat_interval, name=f"trainmedic-{self.job}",
                                max_backoff=max_backoff, timeout=redis_timeout,
                                client_name=f"trainmedic-client:{self.identity}")
            self._ready = self._inbox.ready
            if start:
                self._goodput.start()
                self._inbox.start()

    @property
    def rank(self) -> int:
        return self._ranks.rank

    @property
    def world_size(self) -> int:
        return self._ranks.world

    # -- registration
    def handler(self, action: str) -> Callable[[Handler], Handler]:
        """Decorator: register fn(params) -> result dict for an action (replaces a built-in)."""
        def register(fn: Handler) -> Handler:
            self.register(action, fn)
            return fn
        return register

    def register(self, action: str, fn: Handler) -> None:
        """Register fn(params) -> result dict for an action; ValueError for an action that is not a job's."""
        self.applier.register(action, lambda inv: fn(inv.params))
        # The heartbeat lists what this process can apply, and the service decides by it: say so soon.
        inbox = getattr(self, "_inbox", None)
        if inbox is not None:
            inbox.beat_soon()

    def _builtin(self, fn: Callable[[RemediationClient, Invocation], Any]) -> Callable[[Invocation], Any]:
        return lambda inv: fn(self, inv)

    # -- state (README: Guarantees, 4 to 6)
    def state_dict(self) -> dict[str, Any]:
        """What this run applied; save it with your checkpoint (the framework callbacks do)."""
        return self.state.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """Restore what a checkpoint's run had applied; the job's ledger is then read in the background and
        sticky LR changes the restored state lacks are applied again at the next poll (never blocking it)."""
        self.state.load_state_dict(state)
        if self._inbox is not None:
            self._inbox.want_ledger()

    def rolled_back_to(self, state: Any) -> None:
        """After restoring a checkpoint mid-run (rollback_checkpoint), merge what that checkpoint had applied.

        Unlike load_state_dict nothing newer is forgotten, so no command is applied twice; the sticky LR
        changes the checkpoint lacks are applied again at a coming poll, once the ledger is read (README:
        Guarantees, 5).
        """
        undone = self.state.rolled_back_to(state if state else {"version": STATE_VERSION, "commands": []})
        if undone and self._inbox is not None:
            self._inbox.want_ledger()

    @property
    def alert_start(self) -> float | None:
        """Inside a handler: when the alert behind its command began (startsAt, seconds since the epoch), or
        when the command was issued if it came without an alert (`trainmedic send`); None elsewhere."""
        inv = self.applier.current
        if inv is None:
            return None
        started = parse_rfc3339(inv.command.starts_at)
        return started if started is not None else inv.command.issued_at

    # -- the hot path
    def poll(self, step: int | None = None, loss: Any = None, grad_norm: Any = None,
             samples: Any = None) -> list[Ack]:
        """Apply pending commands (never raises, never waits on the network); returns their acks.

        loss (a float or a 0-dim tensor), grad_norm and samples (processed since the last call) are the
        step's training signals: the heartbeat reports them and the detectors judge the loss. A tensor is
        read on one call in TENSOR_EVERY only, so the other steps add no device synchronisation.
        """
        if step is not None:
            self.step = step
        if loss is not None:
            if type(loss) is float and grad_norm is None and samples is None:
                # A float loss, the common case, judged here: a method call less per step.
                self.loss = loss
                observe = self._observe
                if observe is not None and observe(loss) and self._ranks.world == 1:
                    self._signal(None, None, None)
            else:
                self._signal(loss, grad_norm, samples)
        elif grad_norm is not None or samples is not None:
            self._signal(None, grad_norm, samples)
        # The idle step of a single process: two attribute reads, nothing else (the loop is sacred).
        if self._solo and not self._ready:
            return []
        try:
            if not self._checked_ranks:
                self._late_ranks()
            if self._ranks.world > 1:
                if not self._ranks.due(step, self.sync_every):
                    return []
                if self._nodes is None:
                    self._nodes = self._ranks.nodes(self.node)
                    self._start_straggler_detection()
                with self._lock:
                    deliveries, job = self._ranks.exchange(self._take, self._local_signals(), self._carry)
                    self._job_signals(job)
                    return self._apply_all(deliveries, ranked=True) if deliveries else []
            if not self._ready:
                return []
            with self._lock:
                return self._apply_all(self._take(), ranked=False)
        except Interrupted as stop:
            raise stop.original from None  # the user's own SystemExit / KeyboardInterrupt, acked failed first
        except Exception as exc:  # the training loop is sacred
            self._warn_once("poll", "trainmedic: poll failed (%s: %s); training continues", type(exc).__name__, exc)
            return []

    # -- training signals and detections
    def _signal(self, loss: Any, grad_norm: Any, samples: Any) -> None:
        """Take the step's signals (all None: a single process's detections changed, raise them)."""
        try:
            if loss is None and grad_norm is None and samples is None:
                d = self._detector
                if d is not None:
                    self._raise(d.nan, d.spike, self.loss)
                return
            self._signals(loss, grad_norm, samples)
        except Exception as exc:  # the training loop is sacred
            self._warn_once("signal", "trainmedic: could not read a training signal (%s: %s); training continues",
                            type(exc).__name__, exc)

    def _signals(self, loss: Any, grad_norm: Any, samples: Any) -> None:
        """Signals other than a lone float loss: numbers at once, tensors on one call in TENSOR_EVERY."""
        tensors = [x for x in (loss, grad_norm, samples) if x is not None and not isinstance(x, (int, float))]
        due = False
        if tensors:
            self._tensor_calls += 1
            due = self._tensor_calls >= TENSOR_EVERY
            if due:
                self._tensor_calls = 0

        def value(x: Any) -> float | None:
            if isinstance(x, (int, float)):
                return float(x)
            return float(x.item()) if due else None

        if samples is not None:
            n = value(samples)
            if n is not None:
                # A tensor count read once stands for the calls since the last read.
                self.samples += n if isinstance(samples, (int, float)) else n * TENSOR_EVERY
                self._sampled = True
        if grad_norm is not None:
            g = value(grad_norm)
            if g is not None:
                self.grad_norm = g
        if loss is not None:
            v = value(loss)
            if v is not None:
                self.loss = v
                d = self._detector
                if d is not None and d.observe(v) and self._ranks.world == 1:
                    self._raise(d.nan, d.spike, v)

    def _local_signals(self) -> list[float]:
        """This rank's part of the collective: detections, loss, grad norm and samples (NONE when unknown), and
        whether a straggler probe is due (rank 0's clock; between probes, a countdown and one compare)."""
        d = self._detector
        loss = self.loss if self.loss is not None and math.isfinite(self.loss) else NONE
        self._probe_left -= 1
        return [float(d.nan) if d else 0.0, float(d.spike) if d else 0.0, loss,
                self.grad_norm if self.grad_norm is not None and math.isfinite(self.grad_norm) else NONE,
                -self.samples if self._sampled else NONE, 1.0 if self._probe_left <= 0 else 0.0]

    def _job_signals(self, job: list[float] | None) -> None:
        """What the ranks agreed at the collective: rank 0 raises or resolves the job's detections; every rank
        probes when one is due, and rank 0 compares the probe times that came back."""
        if job is None:
            return
        nan, spike, loss, grad, neg_samples, want = job[:SIGNALS]
        self._job = (loss if loss != NONE else None, grad if grad != NONE else None,
                     -neg_samples if neg_samples != NONE else None)
        self._raise(nan > 0, spike > 0, self.loss)
        if self._carry is not None:
            self._carry = None
            self._compare(job[SIGNALS:])
        if want > 0:
            self._probe_now()

    # -- stragglers
    def _start_straggler_detection(self) -> None:
        """At the first collective: rank 0 with straggler detection on makes its judge and its probe clock."""
        s = self._detect_settings
        if self._ranks.rank != 0 or s is None or not s.straggler or self._inbox is None:
            return
        self._stragglers = Stragglers(s.straggler_ratio, s.straggler_after)
        self._clock = clock = ProbeClock(s, self.sync_every, self._probe_due)
        self._probe_left = clock.every

    def _probe_due(self) -> None:
        """The probe clock's thread: the time is up, so the next collective asks for a probe."""
        self._probe_left = 0

    def _probe_now(self) -> None:
        """Every rank times its workload now, and hands the time over at the next collective (whatever
        happens here: the ranks agreed that the next collective carries the times)."""
        self._carry = UNMEASURED
        if self._clock is not None:
            self._probe_left = self._clock.started(self._probe_left)
        try:
            if self._probe is None:
                self._probe = Probe(self._ranks.device())
            self._carry = self._probe.run()
        except Exception as exc:  # the training loop is sacred: an unmeasured rank is left out of comparisons
            self._warn_once("probe", "trainmedic: could not time the straggler probe (%s: %s); training "
                            "continues", type(exc).__name__, exc)

    def _compare(self, times: list[float]) -> None:
        """Rank 0: compare the ranks' probe times; raise or resolve the job's straggler."""
        judge, clock = self._stragglers, self._clock
        if judge is None or clock is None:
            return
        self._probe_left = clock.compared(slowest(times))
        if not judge.compare(times):
            return
        found = judge.found
        if found is not None and STRAGGLER not in self._alerts:
            nodes = self._ranks.node_of
            node = nodes[found.rank] if found.rank < len(nodes) else None
            self._straggler_labels = (("node", node or ""), ("rank", str(found.rank)))
            self._alerts[STRAGGLER] = start = rfc3339()
            self._send_detection(Detection(STRAGGLER, "firing", start, "", self.step, found.ratio,
                                           self._straggler_labels))
            log.warning("trainmedic: %s detected in %s at step %s: rank %s on %s is %.2f times slower than the "
                        "median rank", STRAGGLER, self.job, self.step, found.rank, node, found.ratio,
                        extra={"target": self.target.label, "alertname": STRAGGLER})
        elif found is None and STRAGGLER in self._alerts:
            self._send_detection(Detection(STRAGGLER, "resolved", self._alerts.pop(STRAGGLER), rfc3339(),
                                           self.step, None, self._straggler_labels))
            log.info("trainmedic: %s of %s cleared at step %s", STRAGGLER, self.job, self.step,
                     extra={"target": self.target.label, "alertname": STRAGGLER})

    def _send_detection(self, detection: Detection) -> None:
        if self._inbox is not None:
            self._inbox.send([detection])

    def _raise(self, nan: bool, spike: bool, value: float | None) -> None:
        """Send the job's detections that began or cleared (rank 0 only: one alert per job)."""
        if self._inbox is None:
            return
        for name, on in ((NAN, nan), (SPIKE, spike)):
            if on and name not in self._alerts:
                self._alerts[name] = start = rfc3339()
                self._inbox.send([Detection(name, "firing", start, "", self.step, value)])
                log.warning("trainmedic: %s detected in %s at step %s (loss %s)", name, self.job, self.step, value,
                            extra={"target": self.target.label, "alertname": name})
            elif not on and name in self._alerts:
                self._inbox.send([Detection(name, "resolved", self._alerts.pop(name), rfc3339(), self.step, value)])
                log.info("trainmedic: %s of %s cleared at step %s", name, self.job, self.step,
                         extra={"target": self.target.label, "alertname": name})

    @property
    def detected(self) -> tuple[str, ...]:
        """The detections this process sees now (of the job, on rank 0 under torch.distributed)."""
        if self._inbox is not None:
            return tuple(a for a in (*ALERTS, STRAGGLER) if a in self._alerts)
        d = self._detector
        return tuple(a for a, on in ((NAN, d is not None and d.nan), (SPIKE, d is not None and d.spike)) if on)

    def _late_ranks(self) -> None:
        # The process group may have been initialised after this client was made: look once.
        self._checked_ranks = True
        ranks = Ranks.detect()
        self._solo = ranks.world == 1
        if ranks.world > 1:
            self._ranks = ranks
            self.identity += f":{ranks.rank}"
            self.applier.identity = self.identity
            if ranks.rank != 0 and self._inbox is not None:
                self._warn_once("late", "trainmedic: create RemediationClient after init_process_group; "
                                "rank %s stops reading Redis", ranks.rank)
                self._inbox.stop_receiving()
                self._release(self._take())
                self._inbox.close()
                self._inbox, self._ready = None, None
                if self._goodput is not None:
                    self._goodput.stop()
                    self._goodput = None

    def _take(self) -> list[Delivery]:
        """Everything the inbox has received, with expiry decided now (once, on the reading rank)."""
        out: list[Delivery] = []
        ready = self._ready
        while ready:
            item = ready.popleft()
            if isinstance(item, Ledger):
                out.append(Delivery("ledger", None, None, False, item.entries))
            else:
                out.append(_delivery(item))
        return out

    def _apply_all(self, deliveries: list[Delivery], ranked: bool) -> list[Ack]:
        acks: list[Ack] = []
        for i, d in enumerate(deliveries):
            if d.ledger is not None:
                self._reapply(d.ledger)
                continue
            if d.command is None:
                continue
            try:
                acks.extend(self.applier.apply(d.command, d.expired, self.step))
            except Interrupted as stop:
                # Ack what was done, hand the commands behind it back to the mailbox, then let the user stop.
                self._send(acks + stop.acks)
                self._release(deliveries[i + 1:])
                raise
        if ranked:
            acks = self._agree(acks)
        self._send(acks)
        return acks

    def _send(self, acks: list[Ack]) -> None:
        if self._inbox is not None and acks:
            self._inbox.send(acks)

    def _agree(self, acks: list[Ack]) -> list[Ack]:
        # Every rank applied the same actions: count, across ranks, how each one went.
        if not acks:  # the same on every rank, so no rank waits in a collective the others skip
            return acks
        tallies = self._ranks.tally([a.status for a in acks])
        out = []
        for a, tally in zip(acks, tallies):
            result = dict(a.result)
            result["ranks"] = self._ranks.world
            result["ranks_applied"] = tally.get("applied", 0)
            status = a.status
            if len(tally) > 1:  # the ranks disagree: that is a failure whatever rank 0 saw
                status = "failed"
                result["rank_statuses"] = tally
                result.setdefault("error", f"applied on {result['ranks_applied']} of {self._ranks.world} ranks")
            out.append(Ack(a.record_id, a.index, a.action, status, result, a.acked_by, a.acked_at, a.reason,
                           a.replayed))
        return out

    def _reapply(self, ledger: tuple[dict[str, Any], ...]) -> None:
        """Apply again, in order, the sticky LR changes of the job's ledger that the restored state lacks."""
        notes: list[Reapplied] = []
        for entry in ledger:
            rid, index, action = str(entry.get("rid")), int(entry.get("index", -1)), str(entry.get("action"))
            spec = CATALOGUE.get(action)
            if spec is None or not spec.sticky or self.state.applied(rid, index):
                continue  # the restored state already holds it: never apply again what the state has
            try:
                result = _STICKY[action](self, spec.parse(entry.get("params") or {}))
            except Exception as exc:
                self._warn_once(f"reapply:{rid}", "trainmedic: could not apply %s of %s again after the resume "
                                "(%s: %s)", action, rid, type(exc).__name__, exc)
                continue
            self.state.mark_applied(rid, index, action, result, self.identity)
            log.info("trainmedic: %s of %s applied again after a resume: %s", action, rid, result,
                     extra={"remediation_id": rid, "target": self.target.label, "action": action})
            notes.append(Reapplied(rid, index, rfc3339(), self.step, self.identity))
        if self._inbox is not None and notes:
            self._inbox.send(notes)

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _heartbeat_info(self) -> dict[str, Any]:
        """What GET /targets shows for this job (called from the receiver thread)."""
        info: dict[str, Any] = {"kind": "job", "name": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                      "ranks": self._ranks.world, "step": self.step, "sync_every": self.sync_every,
                      "actions": self.applier.actions(), "node": self.node,
                      "nodes": self._nodes or ([self.node] if self.node else [])}
        if self.optimizer is not None:
            try:
                info["lr"] = lrmod.current_lrs(self.optimizer)
            except Exception:  # the optimizer is the loop's; a torn read is not worth a log line
                pass
        signals = self._beat_signals(info.get("lr"))
        if signals is not None:
            info["signals"] = signals
        goodput = self._goodput
        if goodput is not None:
            info["goodput"] = goodput.report()
        return info

    def _beat_signals(self, lrs: Any) -> dict[str, Any] | None:
        """The job's latest signals for the heartbeat: rank 0's step and LR, the ranks' highest loss and grad
        norm and lowest throughput; and since when the step has not moved (the service judges hangs by it)."""
        now = time.time()
        step = self.step
        if step != self._beat_step:
            self._beat_step, self._step_since = step, now
        loss, grad, samples = self._job if self._job is not None else (
            self.loss, self.grad_norm, self.samples if self._sampled else None)
        if samples is not None:
            prev = self._beat_samples
            if prev is not None and now > prev[1] and samples >= prev[0]:
                self._sps = (samples - prev[0]) / (now - prev[1])
            self._beat_samples = (samples, now)
        if step is None and loss is None:
            return None
        lr = lrs[0] if isinstance(lrs, list) and lrs and isinstance(lrs[0], (int, float)) else None
        # A NaN loss is the detectors' to report: the heartbeat (strict JSON) carries only finite numbers.
        return {"step": step, "step_since": round(self._step_since, 3), "loss": _finite(loss),
                "learning_rate": _finite(lr), "samples_per_second": _finite(self._sps), "grad_norm": _finite(grad)}

    # -- lifecycle
    def close(self) -> None:
        """Stop the background threads; commands received but not applied go back to the mailbox."""
        unapplied = self._ranks.finish() if self._ranks.world > 1 else []
        if self._clock is not None:
            self._clock.close()
        if self._inbox is None:
            return
        self._inbox.stop_receiving()  # first: nothing may be claimed after we look at what is left
        with self._lock:
            self._release(unapplied + self._take())
        if self._goodput is not None:
            self._goodput.close()  # its last figures go in the last heartbeat
        # The last heartbeat, after the acks, says this process closed: the pages stop showing it live at once,
        # and no down time follows it.
        self._inbox.send([Closed(self._heartbeat_info())])
        self._inbox.close()

    def _release(self, deliveries: list[Delivery]) -> None:
        items = [Release(d.command.record_id) for d in deliveries if d.command is not None]
        if items and self._inbox is not None:
            self._inbox.send(items)

    def __enter__(self) -> RemediationClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _delivery(e: Entry) -> Delivery:
    cmd: Command | None = e.command
    return Delivery(e.entry_id, cmd, e.error, cmd.expired() if cmd is not None else False)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _url(url: str | None) -> str:
    try:
        return redis_url(url)
    except ValueError as exc:
        raise ValueError(f"RemediationClient: {exc}") from None


def _needs_optimizer(rc: RemediationClient) -> Any:
    if not lrmod.optimizers_of(rc.optimizer):
        raise ActionUnsupported("No optimizer was given to RemediationClient.")
    return rc.optimizer


def _scale_lr(rc: RemediationClient, typed: Any) -> dict[str, Any]:
    return lrmod.scale_lr(_needs_optimizer(rc), rc.scheduler, float(typed.factor), float(typed.min_lr))


def _set_lr(rc: RemediationClient, typed: Any) -> dict[str, Any]:
    return lrmod.set_lr(_needs_optimizer(rc), rc.scheduler, float(typed.lr))


def _empty_cache(rc: RemediationClient, inv: Invocation) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise ActionSkipped("no_cuda", "No CUDA device in this process, so there is nothing to free.", cuda=False)
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return {"cuda": True, "reserved_before": before, "reserved_after": torch.cuda.memory_reserved()}


# The sticky actions, by their typed params (also applied again from the ledger after a resume).
_STICKY: dict[str, Callable[[RemediationClient, Any], dict[str, Any]]] = {"scale_lr": _scale_lr, "set_lr": _set_lr}
_BUILTINS: dict[str, Callable[[RemediationClient, Invocation], Any]] = {
    "scale_lr": lambda rc, inv: _scale_lr(rc, inv.typed),
    "set_lr": lambda rc, inv: _set_lr(rc, inv.typed),
    "empty_cache": _empty_cache,
}
