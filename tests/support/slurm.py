"""A real one-node Slurm cluster (munged, slurmctld, slurmd) in a temp dir, for tests: no systemd, stopped by PID.

Needs root and Debian's packages slurmctld, slurmd, slurm-client and munge. Every daemon gets its own files
under the temp dir (key, socket, state, spool, logs, pid files) and free ports, so it never touches the
machine's /etc/slurm, /etc/munge or a Slurm that may already run there.

    cluster = SlurmCluster(tmp_path).start()      # ~seconds; the node is idle when it returns
    subprocess.run(["sinfo"], env=cluster.env)
    cluster.stop()
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

TOOLS = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo", "sbatch", "squeue")
PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(tool: str) -> str:
    # munged, slurmctld and slurmd live in /usr/sbin, which is not on every PATH.
    found = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin")
    if not found:
        raise FileNotFoundError(f"{tool} is not installed (Debian packages: {' '.join(PACKAGES)})")
    return found


class SlurmCluster:
    """One node (`node_name`, 127.0.0.1) in one partition (`debug`), run by root."""

    def __init__(self, base_dir: str | os.PathLike, node_name: str = "tmnode1", cpus: int | None = None):
        self.dir = Path(base_dir)
        self.node = node_name
        self.cpus = cpus or os.cpu_count() or 1
        self.partition = "debug"
        self.conf = self.dir / "slurm.conf"
        # munged wants every folder above its socket searchable by all, and a socket path is at most 107 bytes:
        # pytest's temp dirs are mode 700 and long, so the socket gets a short folder of its own in /tmp.
        self.munge_dir: Path | None = None
        self.munge_socket = Path("/nonexistent")
        self.ctld_port = free_port()
        self.slurmd_port = free_port()
        while self.slurmd_port == self.ctld_port:
            self.slurmd_port = free_port()
        self.pids: dict[str, int] = {}
        self.bringup_s: float | None = None
        self.teardown_s: float | None = None
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SQUEUE_", "SINFO_"))]:
            if var != "SLURM_CONF":  # a test run inside a Slurm job must not leak its job's settings
                del self.env[var]

    # -- life cycle
    def start(self, timeout: float = 30.0) -> Self:
        if os.geteuid() != 0:
            raise PermissionError("the Slurm test cluster runs its daemons as root")
        t0 = time.monotonic()
        try:
            self._write_files()
            self._start_munged()
            self._daemon("slurmctld", [_which("slurmctld"), "-f", str(self.conf)], self.dir / "slurmctld.pid")
            self._daemon("slurmd", [_which("slurmd"), "-f", str(self.conf), "-N", self.node],
                         self.dir / "slurmd.pid")
            self._wait_idle(t0 + timeout)
        except BaseException:
            self.stop()  # never leave half a cluster running
            raise
        self.bringup_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        t0 = time.monotonic()
        if "slurmctld" in self.pids and "slurmd" in self.pids:
            self._cancel_jobs()  # their slurmstepd processes are no PID of ours: let slurmd end them
        # slurmd first (it reports to slurmctld), munged last (both need it to the end).
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is not None:
                _terminate(pid)
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None
        self.teardown_s = time.monotonic() - t0

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- files
    def _write_files(self) -> None:
        for sub in ("munge", "state", "spool", "log", "jobs"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket folder that others may write to; its key must be the owner's alone.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="tm-munge-", dir="/tmp"))
        os.chmod(self.munge_dir, 0o755)
        self.munge_socket = self.munge_dir / "munge.socket"
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        host = socket.gethostname().split(".")[0]
        d = self.dir
        self.conf.write_text(f"""\
ClusterName=trainmedic-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=300
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def _start_munged(self) -> None:
        m = self.dir / "munge"
        self._daemon("munged", [_which("munged"), f"--key-file={m / 'munge.key'}", f"--socket={self.munge_socket}",
                                f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                                f"--seed-file={m / 'munged.seed'}"], m / "munged.pid")

    def _daemon(self, name: str, argv: list[str], pid_file: Path, timeout: float = 10.0) -> None:
        """Start a daemon that forks into the background and writes its pid file; remember its PID."""
        proc = subprocess.run(argv, check=False, env=self.env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} did not start (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[:500]}{self._log_tail(name)}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                time.sleep(0.02)
                continue
            self.pids[name] = pid
            return
        raise RuntimeError(f"{name} wrote no pid file {pid_file} within {timeout:.0f}s{self._log_tail(name)}")

    def _log_tail(self, name: str) -> str:
        log = {"munged": self.dir / "munge" / "munged.log"}.get(name, self.dir / "log" / f"{name}.log")
        try:
            return "\n--- " + str(log) + "\n" + "\n".join(log.read_text().splitlines()[-15:])
        except OSError:
            return ""

    def _wait_idle(self, deadline: float) -> None:
        state = "unknown"
        while time.monotonic() < deadline:
            try:
                state = self.node_state()
            except (RuntimeError, subprocess.TimeoutExpired):
                state = "unreachable"
            if state == "IDLE":
                return
            time.sleep(0.1)
        raise RuntimeError(f"node {self.node} is {state}, not IDLE, {self._log_tail('slurmctld')}"
                           f"{self._log_tail('slurmd')}")

    # -- tools
    def run(self, *argv: str, check: bool = True, timeout: float = 15.0) -> subprocess.CompletedProcess:
        """A Slurm client command (scontrol, sinfo, sbatch, ...) against this cluster."""
        proc = subprocess.run([_which(argv[0]), *argv[1:]], check=False, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def node_state(self) -> str:
        """Base state and flags as scontrol prints them, e.g. IDLE, IDLE+DRAIN, MIXED+DRAIN, DOWN+NOT_RESPONDING."""
        line = self.run("scontrol", "show", "node", "-o", self.node).stdout
        for field in line.split():
            if field.startswith("State="):
                return field[len("State="):]
        raise RuntimeError(f"no State= in {line!r}")

    def reason(self) -> str:
        """The node's reason text as `sinfo -o %E` prints it ('' when it has none)."""
        out = self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%E").stdout.rstrip("\n")
        return "" if out == "none" else out

    def drain_by_hand(self, reason: str) -> None:
        self.run("scontrol", "update", f"NodeName={self.node}", "State=DRAIN", f"Reason={reason}")

    def resume_by_hand(self) -> None:
        """Back to IDLE, whatever drained it (for clean-up between tests)."""
        if "DRAIN" in self.node_state() or "DOWN" in self.node_state():
            self.run("scontrol", "update", f"NodeName={self.node}", "State=RESUME")

    def submit(self, script: str, name: str, *extra: str) -> int:
        """sbatch a script (its text; '#!/bin/sh' added when it has no shebang); returns the job id."""
        if not script.startswith("#!"):
            script = "#!/bin/sh\n" + script
        jobs = self.dir / "jobs"
        path = jobs / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        out = self.run("sbatch", "--parsable", "-J", name, "-D", str(jobs), "-o", str(jobs / "slurm-%j.out"),
                       *extra, str(path)).stdout.strip()
        return int(out.split(";")[0])

    def job_state(self, job_id: int) -> str:
        """PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ... ('' once Slurm has forgotten the job)."""
        out = self.run("squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T", check=False).stdout.strip()
        return out

    def job_output(self, job_id: int) -> str:
        return (self.dir / "jobs" / f"slurm-{job_id}.out").read_text()

    def wait_job(self, job_id: int, states: tuple[str, ...], timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} is {state or 'gone'}, not {'/'.join(states)}, after {timeout:.0f}s")

    def cancel_all(self) -> None:
        self.run("scancel", "-p", self.partition, check=False)

    def _cancel_jobs(self, timeout: float = 10.0) -> None:
        try:
            self.cancel_all()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                live = self.run("squeue", "-h", "-t", "RUNNING,COMPLETING,SUSPENDED", "-o", "%i", check=False).stdout
                if not live.strip():
                    return
                time.sleep(0.1)
        except (OSError, subprocess.TimeoutExpired):
            pass  # stopping goes on regardless


def _terminate(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM, wait for the PID to go, SIGKILL after `timeout`."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.02)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _alive(pid: int) -> bool:
    try:
        # The daemons are not our children (they daemonise), so there is nothing to reap: ask /proc.
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
