"""config/redis/users.acl rendered as docker-compose.yml renders it (render-acl.sh), for tests on redis-server."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ACL = ROOT / "config" / "redis" / "users.acl"
RENDER = ROOT / "config" / "redis" / "render-acl.sh"
PASSWORDS = {"SERVICE": "svc-" + "1" * 60, "AGENT": "agt-" + "2" * 60, "TRAINER": "trn-" + "3" * 60}


def users(node: str, job: str) -> dict[str, str]:
    """The rendered file's users by role: the service's, the node agent's and the training job's."""
    return {"SERVICE": "trainmedic", "AGENT": f"trainmedic-node-{node}", "TRAINER": f"trainmedic-job-{job}"}


def render(out: Path, node: str, job: str, template: Path = ACL) -> Path:
    """The template rendered into `out` (passwords as their SHA-256), plus an `inspector` user for the test."""
    env = {**os.environ, "TRAINMEDIC_ACL_TEMPLATE": str(template), "TRAINMEDIC_ACL_OUT": str(out),
           "TRAINMEDIC_NODE": node, "TRAINMEDIC_JOB": job,
           **{f"TRAINMEDIC_REDIS_{who}_PASSWORD": pw for who, pw in PASSWORDS.items()}}
    subprocess.run(["sh", str(RENDER), "true"], env=env, check=True, timeout=30)
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    text = out.read_text()
    assert "_SHA256@" not in "".join(line for line in text.splitlines() if not line.startswith("#"))  # filled in
    assert not any(pw in text for pw in PASSWORDS.values())  # hashes only
    # Only the test's own inspector may read ACL LOG and keys directly; it is not part of the shipped file.
    out.write_text(text + "\nuser inspector on >inspector-pw ~* &* +@all\n")
    return out


def url(port: int, who: str, node: str, job: str) -> str:
    """The Redis URL of one role's user."""
    return f"redis://{users(node, job)[who]}:{PASSWORDS[who]}@127.0.0.1:{port}/0"
