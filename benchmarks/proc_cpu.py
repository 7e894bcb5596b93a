"""CPU time of processes and threads read from /proc (Linux), and Redis's own, for the benchmarks' CPU figures."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> list[str]:
    """The fields of a /proc stat file after the command name (which may hold spaces)."""
    with open(path) as f:
        text = f.read()
    return text[text.rindex(")") + 2:].split()


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (those that ended too); 0 once it is gone."""
    try:
        fields = _stat_fields(f"/proc/{pid}/stat")
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_cpu(pid: int, tid: int) -> float:
    """CPU seconds one thread has run (the scheduler's nanosecond count); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return 0.0


def descendants(pid: int) -> list[int]:
    """Every living process below pid (children, their children...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(_stat_fields(f"/proc/{entry}/stat")[1])
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and every living process below it (gunicorn's master and its workers)."""
    return sum(process_cpu(p) for p in [pid, *descendants(pid)])


def redis_cpu(r: Any) -> float:
    """Redis's own CPU seconds (INFO cpu: user + system, main thread and its helpers)."""
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def load() -> str:
    """The load averages over 1, 5 and 15 minutes, as uptime prints them."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclass(frozen=True)
class RedisMark:
    """What Redis had done by a moment: CPU seconds, commands by name, bytes in and out."""

    cpu: float
    commands: dict[str, int]
    net_in: int
    net_out: int
    clients: int

    @classmethod
    def read(cls, r: Any) -> RedisMark:
        stats = r.info("commandstats")
        calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items() if isinstance(v, dict)}
        info = r.info("stats")
        return cls(redis_cpu(r), calls, int(info["total_net_input_bytes"]), int(info["total_net_output_bytes"]),
                   int(r.info("clients")["connected_clients"]))

    def since(self, before: RedisMark) -> dict[str, int]:
        """Calls per command between the two marks, most first."""
        diff = {k: v - before.commands.get(k, 0) for k, v in self.commands.items()}
        return dict(sorted(((k, v) for k, v in diff.items() if v > 0), key=lambda kv: -kv[1]))
