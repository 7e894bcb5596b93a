"""Ranks in lockstep: rank 0 hands its received commands to every rank in one small collective."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

from ..wire.protocol import ACK_STATUSES, Command, ProtocolError

# A rank's training signal it does not know, in the collective's MAX (every known value is above it).
NONE = float("-inf")
# What a rank adds to the collective besides rank 0's payload size: its detections (NaN, spike: 0 or 1), its
# latest loss, its grad norm, minus the samples it processed (MAX of those: the fewest samples), and whether it
# asks every rank for a straggler probe now (0 or 1).
SIGNALS = 6


@dataclass(frozen=True)
class Delivery:
    """What every rank handles at the same step: a command (rank 0 decided its expiry, so all ranks agree),
    or the job's ledger of sticky LR changes after a resume."""

    entry_id: str
    command: Command | None
    error: str | None
    expired: bool
    ledger: tuple[dict[str, Any], ...] | None = None


def env_rank() -> int:
    """The rank torchrun / SLURM / MPI launchers announce before torch.distributed is initialised."""
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        v = os.environ.get(var, "")
        if v.isdigit():
            return int(v)
    return 0


class Ranks:
    """This process's place in torch.distributed (world 1 when not initialised) and the lockstep collectives."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank = rank
        self.world = world
        self.calls = 0
        self._device: Any = None
        self._announced: list[Delivery] = []  # rank 0: taken from the inbox, not yet handed to the ranks
        self._payload = b""
        self.node_of: list[str | None] = []  # every rank's node, by rank, once the ranks met

    @classmethod
    def detect(cls) -> Ranks:
        """The initialised process group, if any; never imports torch itself (no torch, no group)."""
        dist = sys.modules.get("torch.distributed")
        try:
            if dist is not None and dist.is_available() and dist.is_initialized():
                return cls(dist.get_rank(), dist.get_world_size())
        except Exception:
            pass
        return cls()

    def due(self, step: int | None, sync_every: int) -> bool:
        """Whether this poll joins the collective: by step when given (ranks agree on it), else by call count."""
        self.calls += 1
        return (self.calls if step is None else step) % sync_every == 0

    def device(self) -> Any:
        """The device the ranks' collective uses: this rank's GPU with NCCL, else the CPU."""
        self._tensors()
        return self._device

    def _tensors(self) -> Any:
        import torch
        import torch.distributed as dist

        if self._device is None:
            # NCCL moves only CUDA tensors; gloo (and mpi) move CPU ones. Same code path otherwise.
            nccl = dist.get_backend() == "nccl"
            self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        return torch, dist

    def exchange(self, take: Callable[[], list[Delivery]], signals: Sequence[float] | None = None,
                 probe: float | None = None) -> tuple[list[Delivery], list[float]]:
        """All ranks receive rank 0's pending deliveries now (take() runs on rank 0 only), and what the ranks
        report together: the MAX over ranks of each of this rank's `signals` (SIGNALS values, NONE unknown),
        then, when `probe` is given (every rank gives one at the same call), every rank's probe time by rank.

        The payload size and the signals travel in one small all-reduce (the collective the ranks meet at
        anyway), so a detection on any rank is known to every rank at the same step, with no extra wait. A
        probe's times ride in it too: each rank fills its own slot, NONE elsewhere, and MAX gathers them.

        Synchronous on purpose: an asynchronous announcement left in flight between steps was measured
        3-8x cheaper, but with torch 2.13's gloo a process group destroyed right after a barrier that
        caught it in flight deadlocks (the gloo thread frees our Python tensor and waits for the GIL
        while the main thread holds it in ProcessGroupGloo's destructor). The end of training must not hang.
        """
        torch, dist = self._tensors()
        if self.rank == 0:
            self._announced = take()
            self._payload = json.dumps([[d.entry_id, d.command.to_json() if d.command else None, d.error, d.expired,
                                         list(d.ledger) if d.ledger is not None else None]
                                        for d in self._announced]).encode() if self._announced else b""
        size = float(len(self._payload)) if self.rank == 0 else 0.0
        mine = list(signals) if signals is not None else [NONE] * SIGNALS
        if probe is not None:
            slots = [NONE] * self.world
            slots[self.rank] = probe
            mine += slots
        vec = torch.tensor([size, *mine], dtype=torch.float64).to(self._device)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)  # the whole cost of an idle sync: one 56-byte all-reduce
        n, *job = vec.tolist()
        return (self._receive(int(n)) if n else []), job

    def _receive(self, n: int) -> list[Delivery]:
        torch, dist = self._tensors()
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(self._payload), dtype=torch.uint8).to(self._device)
            self._announced, self._payload = [], b""
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=self._device)
        dist.broadcast(buf, 0)  # synchronous, and only when there is a command
        out = []
        for eid, text, err, expired, ledger in json.loads(bytes(buf.cpu().tolist()).decode()):
            try:
                cmd = Command.from_json(text) if text else None
            except ProtocolError as exc:
                cmd, err = None, str(exc)
            out.append(Delivery(eid, cmd, err, bool(expired), tuple(ledger) if ledger is not None else None))
        return out

    def nodes(self, node: str | None) -> list[str]:
        """Every rank's node, once, at the first collective (so a job spread over nodes is found on each)."""
        import torch.distributed as dist

        names: list[Any] = [None] * self.world
        dist.all_gather_object(names, node)
        self.node_of = [n if isinstance(n, str) else None for n in names]
        return sorted({n for n in names if isinstance(n, str)})

    def finish(self) -> list[Delivery]:
        """What rank 0 took from the inbox but no rank applied (a failed exchange); to hand back."""
        announced, self._announced = self._announced, []
        return announced

    def tally(self, statuses: Sequence[str]) -> list[dict[str, int]]:
        """How many ranks reported each status, per action (every rank calls this with as many statuses)."""
        torch, dist = self._tensors()
        counts = torch.zeros((len(statuses), len(ACK_STATUSES)), dtype=torch.int64, device=self._device)
        for i, st in enumerate(statuses):
            counts[i, ACK_STATUSES.index(st)] = 1
        dist.all_reduce(counts)
        rows = counts.cpu().tolist()
        return [{s: int(c) for s, c in zip(ACK_STATUSES, row) if c} for row in rows]
