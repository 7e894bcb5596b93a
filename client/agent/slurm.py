"""Drain and resume this node in Slurm with scontrol, requeue the jobs running on it; read its state from
`sinfo --json` (Slurm 22.05's JSON).

Only a drain trainmedic made is ever undone: `memory` (the agent's state file) remembers which record drained
the node, and the node's Slurm reason must still be the one trainmedic wrote. Every scontrol/sinfo call is an
argv list with a timeout, never a shell; every failure becomes ActionFailed with one sentence.
"""
from __future__ import annotations

import json
import re
import subprocess
import time
import unicodedata
from collections.abc import Mapping
from typing import Any, Protocol

from ..receiver.applier import ActionFailed, ActionSkipped
from ..wire.keys import RECORD_ID_RE, TARGET_NAME_RE

REASON_MAX = 200  # characters of the playbook's reason kept (README: Node agent, drain_node)
TIMEOUT_S = 15.0  # per scontrol/sinfo call; slurmctld answers in milliseconds when it is up
# A node in one of these is drained, draining, failing or down already: trainmedic leaves it as it is.
HELD_FLAGS = frozenset({"DRAIN", "FAIL"})
HELD_STATES = frozenset({"DOWN"})
BASE_STATES = frozenset({"IDLE", "ALLOCATED", "MIXED", "DOWN", "ERROR", "FUTURE", "UNKNOWN"})
# A job id as squeue prints it: a plain job, an array task (123_4) or a heterogeneous job's part (123+0).
JOB_ID_RE = re.compile(r"^[0-9]{1,12}(?:_[0-9]{1,12}|\+[0-9]{1,6})?\Z")
# How long a requeue's result waits for its jobs to leave RUNNING/COMPLETING (Slurm ends them in about a second).
SETTLE_S = 5.0


class DrainMemory(Protocol):
    """Which drains are trainmedic's: the record id that drained each node (the agent backs it with its state file)."""

    def ours(self, node: str) -> str | None:
        """The record id whose drain_node drained `node`, or None."""
        ...

    def remember(self, node: str, record_id: str) -> None:
        """Note that `record_id` drained `node` (called before scontrol runs)."""
        ...

    def forget(self, node: str) -> None:
        """`node` is no longer drained by trainmedic."""
        ...


class DictMemory:
    """A DrainMemory in a dict, for tests and for an agent without a state file."""

    def __init__(self, data: dict[str, str] | None = None):
        self.data: dict[str, str] = {} if data is None else data

    def ours(self, node: str) -> str | None:
        return self.data.get(node)

    def remember(self, node: str, record_id: str) -> None:
        self.data[node] = record_id

    def forget(self, node: str) -> None:
        self.data.pop(node, None)


def clean_text(text: object, limit: int) -> str:
    """One line of printable text: every run of control/format/separator characters becomes one space, capped."""
    out: list[str] = []
    for ch in "" if text is None else str(text):
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp") or ch.isspace():
            if out and out[-1] != " ":
                out.append(" ")
        else:
            out.append(ch)
    return "".join(out).strip()[:limit].rstrip()


def first_line(text: str | bytes | None, limit: int = 300) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    for line in (text or "").splitlines():
        if line.strip():
            return clean_text(line, limit)
    return ""


def slurm_reason(record_id: str, reason: object) -> str:
    """What trainmedic writes as the node's Slurm reason: `trainmedic <record id>: <reason>`."""
    text = clean_text(reason, REASON_MAX)
    return f"trainmedic {record_id}: {text}" if text else f"trainmedic {record_id}"


def is_held(state: Mapping[str, Any]) -> bool:
    """Drained, draining, failing or down."""
    return state["state"] in HELD_STATES or bool(HELD_FLAGS & set(state["flags"]))


class SlurmNode:
    """One Slurm node, as the agent on it sees it through scontrol and sinfo."""

    def __init__(self, node_name: str, scontrol: str = "scontrol", sinfo: str = "sinfo", squeue: str = "squeue",
                 env: Mapping[str, str] | None = None, timeout: float = TIMEOUT_S):
        if not isinstance(node_name, str) or not TARGET_NAME_RE.match(node_name):
            raise ValueError(f"{node_name!r} is not a valid Slurm node name for trainmedic "
                             "(letters, digits and _.:@- only, at most 128).")
        self.node = node_name
        self.scontrol = scontrol
        self.sinfo = sinfo
        self.squeue = squeue
        self.env = dict(env) if env is not None else None
        self.timeout = timeout

    # -- reading
    def state(self) -> dict[str, Any]:
        """{"node", "state" (base state, e.g. IDLE), "flags" (e.g. ["DRAIN"]), "reason", "reason_set_by"}."""
        argv = [self.sinfo, "--json"]
        out = self._run(argv, "read the node's state").stdout
        try:
            data = json.loads(out)
            errors = data.get("errors") or []
            nodes = data["nodes"]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ActionFailed(f"Could not read the node's state: {_tool(argv)} printed something that is not "
                               "Slurm's node JSON.", returncode=0, stderr=first_line(out)) from None
        if errors:  # Slurm 22.05 says this, exit status 0, when slurmctld cannot be reached
            err = _error_text(errors[0])
            raise ActionFailed(f"Could not read the node's state: {_tool(argv)} got no answer from slurmctld ({err}; "
                               "is slurmctld up and reachable?).", returncode=0, stderr=err)
        for node in nodes:
            if isinstance(node, dict) and node.get("name") == self.node:
                return _node_state(node)
        raise ActionFailed(f"Slurm knows no node named {self.node} (set the agent's --slurm-node).",
                           returncode=0, stderr="")

    def ours(self, state: Mapping[str, Any], memory: DrainMemory) -> str | None:
        """The record id of trainmedic's drain of this node, when memory and Slurm's reason both say so."""
        record_id = memory.ours(self.node)
        if record_id and state.get("reason") and _reason_is(state["reason"], record_id) and is_held(state):
            return record_id
        return None

    # -- acting
    def drain(self, record_id: str, reason: object, memory: DrainMemory, dry_run: bool = False) -> dict[str, Any]:
        """`scontrol update NodeName=<node> State=DRAIN Reason="trainmedic <record id>: <reason>"`.

        Running jobs finish; no new job starts. A node already drained, failing or down is left as it is
        (ActionSkipped already_drained) unless this very record drained it (then it reports the drain again).
        """
        if not isinstance(record_id, str) or not RECORD_ID_RE.match(record_id):
            raise ActionFailed(f"The record id {clean_text(record_id, 64)!r} is not a trainmedic record id, "
                               "so the node was not drained.", returncode=None, stderr="")
        before = self.state()
        if is_held(before):
            mine = self.ours(before, memory)
            if mine == record_id:  # the same command again (the agent restarted before its ack)
                return {"node": self.node, "record_id": record_id, "before": before, "after": before,
                        "slurm_reason": before["reason"], "already": True}
            who = f"trainmedic record {mine}" if mine else f"{before.get('reason_set_by') or 'someone'}"
            raise ActionSkipped("already_drained", f"Node {self.node} is already {_label(before)} by {who} "
                                f"(reason {before.get('reason') or 'none'!r}), so trainmedic leaves it as it is.",
                                before=before)
        text = slurm_reason(record_id, reason)
        # scontrol strips one leading and one trailing double quote from a Reason value: quoting it ourselves keeps
        # a reason that ends in a quote intact. It is one argv item: no shell ever parses it.
        argv = [self.scontrol, "update", f"NodeName={self.node}", "State=DRAIN", f'Reason="{text}"']
        if dry_run:
            raise ActionSkipped("dry_run", f"Dry run: node {self.node} would be drained; nothing was changed.",
                                argv=argv, before=before,
                                would_be={**before, "flags": sorted({*before["flags"], "DRAIN"}), "reason": text})
        memory.remember(self.node, record_id)  # first: a crash after scontrol must not leave an unknown drain
        try:
            self._run(argv, "drain the node")
        except ActionFailed:
            memory.forget(self.node)
            raise
        return {"node": self.node, "record_id": record_id, "before": before, "after": self._after(),
                "slurm_reason": text}

    def resume(self, memory: DrainMemory, dry_run: bool = False) -> dict[str, Any]:
        """`scontrol update NodeName=<node> State=RESUME`, only for a drain trainmedic made."""
        before = self.state()
        remembered = memory.ours(self.node)
        if not is_held(before):
            if remembered and not dry_run:
                memory.forget(self.node)
            raise ActionSkipped("not_drained", f"Node {self.node} is not drained (it is {_label(before)}), so there "
                                "is nothing to resume.", before=before)
        record_id = self.ours(before, memory)
        if record_id is None:
            if remembered and not dry_run:
                memory.forget(self.node)  # someone drained it again with their own reason: the drain is theirs now
            whose = (f"someone else has since replaced trainmedic's reason (record {remembered})" if remembered
                     else "trainmedic did not drain it")
            raise ActionSkipped("not_ours", f"Node {self.node} is {_label(before)} with reason "
                                f"{before.get('reason') or 'none'!r} and {whose}, so it stays as it is.", before=before)
        argv = [self.scontrol, "update", f"NodeName={self.node}", "State=RESUME"]
        if dry_run:
            raise ActionSkipped("dry_run", f"Dry run: node {self.node} would be resumed; nothing was changed.",
                                argv=argv, before=before, record_id=record_id)
        self._run(argv, "resume the node")
        memory.forget(self.node)
        return {"node": self.node, "record_id": record_id, "before": before, "after": self._after()}

    def running_jobs(self) -> list[str]:
        """The ids of the jobs running on this node (`squeue -h -w <node> -t RUNNING -o %i`), in Slurm's order."""
        argv = [self.squeue, "-h", "-w", self.node, "-t", "RUNNING", "-o", "%i"]
        out = self._run(argv, "list the node's jobs").stdout
        ids = [line.strip() for line in out.splitlines() if line.strip()]
        bad = [i for i in ids if not JOB_ID_RE.match(i)]
        if bad:
            raise ActionFailed(f"Could not list the node's jobs: {_tool(argv)} printed {clean_text(bad[0], 40)!r}, "
                               "which is not a Slurm job id.", returncode=0, stderr="")
        return list(dict.fromkeys(ids))

    def requeue(self, dry_run: bool = False) -> dict[str, Any]:
        """`scontrol requeue <id>` for every job running on this node, so each starts again elsewhere.

        Each job's answer: whether it was requeued, Slurm's reason when it refused (a job submitted with
        --no-requeue), and its state after. Applied when one job or more was requeued; ActionSkipped no_jobs when
        none ran here; ActionFailed when none could be requeued.
        """
        ids = self.running_jobs()
        if not ids:
            raise ActionSkipped("no_jobs", f"No job runs on node {self.node}, so there is nothing to requeue.",
                                node=self.node, jobs=[])
        if dry_run:
            raise ActionSkipped("dry_run", f"Dry run: {len(ids)} job(s) on node {self.node} would be requeued; "
                                "nothing was changed.", node=self.node,
                                jobs=[{"job_id": i, "requeued": False} for i in ids])
        jobs: list[dict[str, Any]] = []
        for job_id in ids:
            try:
                self._run([self.scontrol, "requeue", job_id], f"requeue job {job_id}")
                jobs.append({"job_id": job_id, "requeued": True})
            except ActionFailed as exc:  # this job only (not requeueable, or it ended meanwhile): the others go on
                jobs.append({"job_id": job_id, "requeued": False,
                             "reason": exc.result.get("stderr") or exc.message})
        states = self._job_states(ids, settle=any(j["requeued"] for j in jobs))
        for job in jobs:
            job["state"] = states.get(job["job_id"])
        done = sum(1 for j in jobs if j["requeued"])
        result: dict[str, Any] = {"node": self.node, "jobs": jobs, "requeued": done}
        if not done:
            raise ActionFailed(f"Slurm requeued none of the {len(jobs)} job(s) on node {self.node} "
                               f"({jobs[0]['job_id']}: {jobs[0]['reason'].rstrip('.')}).", **result)
        return result

    def _job_states(self, ids: list[str], settle: bool) -> dict[str, str | None]:
        """Each job's state (PENDING, RUNNING, ...; None when Slurm no longer lists it), once requeued jobs have
        left RUNNING and COMPLETING (up to SETTLE_S); the jobs are requeued already, so a failed read is no
        failure."""
        argv = [self.squeue, "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i %T"]
        deadline = time.monotonic() + (SETTLE_S if settle else 0.0)
        states: dict[str, str | None] = {}
        while True:
            try:
                out = self._run(argv, "read the jobs' states").stdout
            except ActionFailed:
                return states
            states = {i: None for i in ids}
            for line in out.splitlines():
                job_id, _, state = line.strip().partition(" ")
                if job_id in states:
                    states[job_id] = clean_text(state, 40) or None
            if time.monotonic() >= deadline or not any(s in ("RUNNING", "COMPLETING") for s in states.values()):
                return states
            time.sleep(0.2)

    # -- plumbing
    def _after(self) -> dict[str, Any] | None:
        """The state after a change; the change is done, so a failed read does not fail the action."""
        try:
            return self.state()
        except ActionFailed:
            return None

    def _run(self, argv: list[str], doing: str) -> subprocess.CompletedProcess[str]:
        tool = _tool(argv)
        try:
            proc = subprocess.run(argv, check=False, env=self.env, capture_output=True, text=True, timeout=self.timeout,
                                  stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise ActionFailed(f"Could not {doing}: {argv[0]} is not installed or not on the agent's PATH.",
                               returncode=None, stderr="") from None
        except subprocess.TimeoutExpired as exc:
            raise ActionFailed(f"Could not {doing}: {tool} did not answer within {self.timeout:g} seconds "
                               "(is slurmctld up and reachable?).", returncode=None,
                               stderr=first_line(exc.stderr)) from None
        except OSError as exc:
            raise ActionFailed(f"Could not {doing}: {argv[0]} could not be run ({exc.strerror or exc}).",
                               returncode=None, stderr="") from None
        if proc.returncode != 0:
            err = first_line(proc.stderr) or first_line(proc.stdout)
            raise ActionFailed(f"Could not {doing}: {tool} exited with status {proc.returncode}"
                               f"{': ' + err.rstrip('.') if err else ''}.", returncode=proc.returncode, stderr=err)
        return proc


def _tool(argv: list[str]) -> str:
    name = argv[0].rsplit("/", 1)[-1]
    return f"{name} {argv[1]}" if len(argv) > 1 else name


def _reason_is(reason: str, record_id: str) -> bool:
    prefix = f"trainmedic {record_id}"
    return reason == prefix or reason.startswith(prefix + ":")


def _label(state: Mapping[str, Any]) -> str:
    return "+".join([state["state"], *state["flags"]])


def _error_text(error: object) -> str:
    if isinstance(error, dict):
        words = error.get("description") or error.get("error") or "error"
        errno = error.get("error_number", error.get("errno"))
        return clean_text(f"{words}, errno {errno}" if errno is not None else words, 300)
    return clean_text(error, 300)


def _node_state(node: dict[str, Any]) -> dict[str, Any]:
    raw = node.get("state")
    if isinstance(raw, list):  # Slurm 23.02+ puts the base state and its flags in one list
        words = [str(s).upper() for s in raw]
        base = next((w for w in words if w in BASE_STATES), "UNKNOWN")
        flags = [w for w in words if w != base]
    else:  # Slurm 22.05: "state": "idle", "state_flags": ["DRAIN"]
        base, flags = str(raw or "unknown").upper(), [str(f).upper() for f in node.get("state_flags") or []]
    return {"node": node.get("name"), "state": base, "flags": flags,
            "reason": node.get("reason") or None, "reason_set_by": node.get("reason_set_by_user") or None}
