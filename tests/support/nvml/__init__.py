"""The stand-in NVML library (compiled from nvml_stub.c) and a node agent run as a real subprocess."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Sequence

import pytest
import redis

from trainmedic.client.wire import keys

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SOURCE = HERE / "nvml_stub.c"


def build(out_dir: Path) -> Path:
    """Compile the stub with the system C compiler into out_dir/libnvidia-ml.so.1."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH: the NVML stand-in cannot be built")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libnvidia-ml.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-Wl,-soname,libnvidia-ml.so.1",
                    "-o", str(lib), str(SOURCE)], check=True, capture_output=True)
    return lib


@pytest.fixture(scope="session")
def nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding the compiled libnvidia-ml.so.1 (for LD_LIBRARY_PATH)."""
    return build(tmp_path_factory.mktemp("nvml")).parent


@dataclass(frozen=True)
class FakeGpu:
    """One GPU of the stand-in, limits in milliwatts."""

    index: int
    uuid: str
    name: str = "NVIDIA_H100_80GB_HBM3"
    min_mw: int = 200_000
    max_mw: int = 700_000
    default_mw: int = 700_000
    current_mw: int = 700_000


class NvmlState:
    """The stand-in's state file: GPUs and the errors it is told to answer."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, gpus: Sequence[FakeGpu], fails: dict[str, int] | None = None) -> None:
        lines = [f"gpu {g.index} {g.uuid} {g.name} {g.min_mw} {g.max_mw} {g.default_mw} {g.current_mw}" for g in gpus]
        lines += [f"fail {op} {code}" for op, code in (fails or {}).items()]
        tmp = self.path.with_suffix(".writing")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.path)

    def gpus(self) -> dict[int, FakeGpu]:
        out = {}
        for line in self.path.read_text().splitlines():
            f = line.split()
            if f and f[0] == "gpu":
                g = FakeGpu(int(f[1]), f[2], f[3], *map(int, f[4:8]))
                out[g.index] = g
        return out

    def limit_w(self, index: int) -> float:
        return self.gpus()[index].current_mw / 1000

    def fail(self, **codes: int) -> None:
        self.write(list(self.gpus().values()), codes)


# nvmlReturn_t codes the tests tell the stand-in to answer.
NO_PERMISSION = 4
NOT_SUPPORTED = 3


@pytest.fixture
def nvml_state(tmp_path: Path) -> NvmlState:
    """Two H100-like GPUs: GPU 0 at its default 700 W, GPU 1 set by someone to 650 W."""
    state = NvmlState(tmp_path / "nvml-state.txt")
    state.write([FakeGpu(0, "GPU-0a1b2c3d-0000-1111-2222-333344445555"),
                 FakeGpu(1, "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff", current_mw=650_000)])
    return state


class AgentProcess:
    """`trainmedic agent` as a real subprocess, with the stand-in NVML on its LD_LIBRARY_PATH."""

    def __init__(self, node: str, redis_url: str, log_path: Path, lib_dir: Path | None = None,
                 state: NvmlState | None = None, allow_roots: Sequence[Path] = (), dry_run: bool = False,
                 env: dict[str, str] | None = None, state_dir: Path | None = None, verify_key: str | None = None,
                 insecure: bool = False, args: Sequence[str] = ()):
        from tests.conftest import VERIFY_KEY

        self.node = node
        self.log_path = log_path
        # The agent's own state file: the same folder across restarts of one node in a test.
        self.state_dir = state_dir or log_path.parent / f"agent-state-{node}"
        cmd = [sys.executable, "-m", "trainmedic.service.cli", "agent", "--node", node, "--redis-url", redis_url,
               "--state-dir", str(self.state_dir)]
        if insecure:
            cmd.append("--insecure-unsigned")
        cmd += list(args)
        for root in allow_roots:
            cmd += ["--allow-root", str(root)]
        if dry_run:
            cmd.append("--dry-run")
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINMEDIC_", "NVML_STUB_"))}
        full_env["LD_LIBRARY_PATH"] = str(lib_dir) if lib_dir else str(log_path.parent / "no-nvml-here")
        if state is not None:
            full_env["NVML_STUB_STATE"] = str(state.path)
        if not insecure:
            full_env["TRAINMEDIC_VERIFY_KEY"] = verify_key or VERIFY_KEY
        full_env.update(env or {})
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self, r: redis.Redis, timeout: float = 20.0) -> dict:
        """Wait for this process's first heartbeat; its info."""
        deadline = time.monotonic() + timeout
        key = keys.heartbeat(keys.Target("node", self.node))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited with {self.proc.returncode}: {self.log()[-2000:]}")
            raw = r.get(key)
            if raw and json.loads(raw).get("pid") == self.proc.pid:
                return json.loads(raw)
            time.sleep(0.05)
        raise RuntimeError(f"agent sent no heartbeat within {timeout}s: {self.log()[-2000:]}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the agent and wait for it; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


@pytest.fixture
def agents(redis_url: str, tmp_path: Path) -> Iterator[Any]:
    """Factory: start node agents (each stopped after the test)."""
    started: list[AgentProcess] = []

    def start(node: str = "gpu-node-1", **kw: Any) -> AgentProcess:
        a = AgentProcess(node, redis_url, tmp_path / f"agent-{node}-{len(started)}.log", **kw)
        started.append(a)
        return a
    yield start
    for a in started:
        a.stop()


def wait_record(r: redis.Redis, record_id: str, done: Sequence[str] = ("applied", "partially_applied", "failed",
                                                                          "expired", "skipped", "lost"),
                timeout: float = 15.0) -> dict:
    """Poll a record until its status is one of `done`; the record (AssertionError on timeout)."""
    from tests.support.jobs import wait_record as wait

    return wait(r, record_id, lambda rec: rec is not None and rec["status"] in done, timeout)
