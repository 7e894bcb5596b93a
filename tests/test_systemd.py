"""The systemd units (deploy/systemd) for the service and the agent on Slurm clusters without containers.

Each unit is checked by systemd itself where `systemd-analyze` is installed (here it is): `verify` must
load it without a single warning, and `security --offline` must rate its exposure low. Otherwise (a
machine without systemd) the units are parsed and checked for known sections and directives. Either way
the hardening the units promise is asserted directive by directive.

`systemd-analyze verify` insists that ExecStart's program exists. Rather than edit the unit under test,
the test builds a scratch root directory: the units as they are in etc/systemd/system, the host's own
system units (sysinit.target and the like) in usr/lib/systemd/system, and an executable stand-in at the
very path ExecStart names (/opt/trainmedic/bin/trainmedic); `--root` makes systemd resolve every path
in there, so the files verified are byte for byte the ones shipped.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cli_contract import check_command

ROOT = Path(__file__).resolve().parent.parent
UNITS_DIR = ROOT / "deploy" / "systemd"
SERVICE = UNITS_DIR / "trainmedic.service"
AGENT = UNITS_DIR / "trainmedic-agent.service"
ENV_EXAMPLE = UNITS_DIR / "trainmedic.env.example"
UNITS = [SERVICE, AGENT]
# Highest `systemd-analyze security` exposure allowed (0 = locked down, 10 = unprotected). The agent runs
# as root with CAP_SYS_ADMIN (NVML), so it cannot score as low as the service.
EXPOSURE = {"trainmedic.service": 2.0, "trainmedic-agent.service": 3.5}
HOST_UNIT_DIRS = [Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")]
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
KNOWN = {  # the fallback's directive list, for machines without systemd: every key these units may use
    "Unit": {"Description", "Documentation", "Wants", "Requires", "After", "Before"},
    "Service": {"Type", "EnvironmentFile", "Environment", "LoadCredential", "SetCredential", "StateDirectory",
                "StateDirectoryMode", "WorkingDirectory", "ExecStart", "Restart", "RestartSec", "TimeoutStopSec",
                "User", "Group", "DynamicUser", "NoNewPrivileges", "ProtectSystem", "ReadWritePaths",
                "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateUsers", "PrivateMounts",
                "ProtectHostname", "ProtectClock", "ProtectKernelTunables", "ProtectKernelModules",
                "ProtectKernelLogs", "ProtectControlGroups", "ProtectProc", "ProcSubset",
                "CapabilityBoundingSet", "AmbientCapabilities", "RestrictAddressFamilies", "RestrictNamespaces",
                "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality", "RemoveIPC",
                "SystemCallArchitectures", "SystemCallFilter", "SystemCallErrorNumber", "UMask"},
    "Install": {"WantedBy"},
}
SECRET_WORDS = re.compile(r"token|secret|signing|verify|password|key", re.I)


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file as {section: [(key, value), ...]}, repeated keys kept in order (systemd's syntax:
    comments start with # or ;, a trailing backslash continues the line)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    pending = ""
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            assert line.endswith("]"), f"{path.name}:{number}: bad section header"
            current = line[1:-1]
            assert current not in sections, f"{path.name}:{number}: section [{current}] twice"
            sections[current] = []
            continue
        assert current is not None, f"{path.name}:{number}: a setting before any section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}:{number}: not KEY=VALUE: {line!r}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict, section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"expected one {key}= in [{section}], found {found}"
    return found[0]


def exec_start(unit: dict) -> list[str]:
    return shlex.split(one(unit, "Service", "ExecStart"))


def words(unit: dict, key: str) -> list[str]:
    """Space-separated list directives; an empty assignment resets the list, as in systemd."""
    result: list[str] = []
    for value in values(unit, "Service", key):
        result = [] if not value else result + value.split()
    return result


def option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def scratch_root(tmp_path: Path, units: list[Path]) -> Path:
    """An alternate root for `systemd-analyze --root`: the units, the host's system units, and an
    executable stand-in at each ExecStart path (see the module docstring)."""
    root = tmp_path / "root"
    (root / "etc" / "systemd" / "system").mkdir(parents=True)
    host_units = next((d for d in HOST_UNIT_DIRS if (d / "sysinit.target").exists()), None)
    assert host_units is not None, "systemd-analyze is installed but the host's system units are not"
    shutil.copytree(host_units, root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    for unit in units:
        shutil.copy(unit, root / "etc" / "systemd" / "system" / unit.name)
        program = root / exec_start(parse_unit(unit))[0].lstrip("/")
        program.parent.mkdir(parents=True, exist_ok=True)
        program.write_text("#!/bin/sh\nexit 0\n")
        program.chmod(0o755)
    return root


def analyze(root: Path, *args: str) -> subprocess.CompletedProcess:
    assert SYSTEMD_ANALYZE
    return subprocess.run([SYSTEMD_ANALYZE, *args, f"--root={root}"], capture_output=True, text=True,
                          timeout=120)


# --- systemd accepts them -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_accepts_the_unit_without_a_warning(path: Path, tmp_path: Path) -> None:
    unit = parse_unit(path)
    if SYSTEMD_ANALYZE is None:
        # No systemd here: the parse above, plus known sections and directives only.
        assert set(unit) == set(KNOWN), set(unit)
        for section, settings in unit.items():
            unknown = {k for k, _ in settings} - KNOWN[section]
            assert not unknown, f"[{section}] {unknown}"
        return
    root = scratch_root(tmp_path, [path])
    result = analyze(root, "verify", "--man=no", path.name)
    # verify exits 0 on unknown keys and unparsable values (it only warns): its output must be empty.
    assert result.returncode == 0 and (result.stdout + result.stderr).strip() == "", result.stdout + result.stderr
    # --threshold counts in tenths of the printed level.
    threshold = round(EXPOSURE[path.name] * 10)
    security = analyze(root, "security", "--offline=yes", f"--threshold={threshold}", path.name)
    level = re.search(r"Overall exposure level for \S+: ([\d.]+)", security.stdout)
    assert level, security.stdout + security.stderr
    assert security.returncode == 0 and float(level.group(1)) <= EXPOSURE[path.name], security.stdout


def test_systemd_analyze_verify_does_report_a_bad_unit(tmp_path: Path) -> None:
    """The assertions above can fail: a misspelt directive, a bad value or a missing program are reported."""
    assert SYSTEMD_ANALYZE, "systemd-analyze is not installed (Debian: apt-get install systemd)"
    bad = tmp_path / "bad" / "trainmedic-bad.service"
    bad.parent.mkdir()
    text = SERVICE.read_text().replace("ProtectSystem=strict", "ProtectSystem=strictly\nProtectSistem=yes")
    bad.write_text(text)
    root = scratch_root(tmp_path, [bad])
    result = analyze(root, "verify", "--man=no", bad.name)
    output = result.stdout + result.stderr
    assert "strictly" in output and "ProtectSistem" in output, output
    (root / "opt" / "trainmedic" / "bin" / "trainmedic").unlink()
    result = analyze(root, "verify", "--man=no", bad.name)
    assert result.returncode != 0 and "/opt/trainmedic/bin/trainmedic" in result.stdout + result.stderr


# --- what they run ------------------------------------------------------------------------------------

def test_the_service_unit_runs_serve_without_a_local_agent() -> None:
    unit = parse_unit(SERVICE)
    argv = exec_start(unit)
    assert argv[0] == "/opt/trainmedic/bin/trainmedic" and argv[1] == "serve"
    assert "--no-agent" in argv and option(argv, "--port") == ["9095"] and option(argv, "--host") == ["0.0.0.0"]
    # serve's data dir is the unit's StateDirectory (the only place it can write).
    assert option(argv, "--data-dir") == [f"/var/lib/{one(unit, 'Service', 'StateDirectory')}"]
    assert one(unit, "Service", "StateDirectory") != "trainmedic", "apart from the agent's /var/lib/trainmedic"
    check_command(argv)


def test_the_agent_unit_runs_the_agent_with_its_state_dir_and_allow_roots() -> None:
    unit = parse_unit(AGENT)
    argv = exec_start(unit)
    assert argv[0] == "/opt/trainmedic/bin/trainmedic" and argv[1] == "agent"
    assert option(argv, "--node") == ["%H"]  # systemd puts the host name in
    assert option(argv, "--state-dir") == ["/var/lib/trainmedic"] == \
        [f"/var/lib/{one(unit, 'Service', 'StateDirectory')}"]
    assert option(argv, "--scheduler") == ["slurm"]
    assert option(argv, "--allow-root"), "the example names an allow-root"
    check_command(argv)


# --- hardening -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_the_unit_is_hardened(path: Path) -> None:
    unit = parse_unit(path)
    assert one(unit, "Service", "ProtectSystem") == "strict"
    assert one(unit, "Service", "NoNewPrivileges") == "yes"
    assert one(unit, "Service", "PrivateTmp") == "yes"
    assert one(unit, "Service", "ProtectKernelModules") == "yes"
    assert one(unit, "Service", "SystemCallArchitectures") == "native"
    assert "@system-service" in values(unit, "Service", "SystemCallFilter")
    assert one(unit, "Service", "AmbientCapabilities") == ""
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_the_service_runs_as_a_dynamic_user_with_no_capability_and_no_write_path() -> None:
    unit = parse_unit(SERVICE)
    assert one(unit, "Service", "DynamicUser") == "yes"
    assert not values(unit, "Service", "User")
    assert one(unit, "Service", "CapabilityBoundingSet") == ""
    assert one(unit, "Service", "PrivateDevices") == "yes"
    # Writable: its StateDirectory only (systemd makes it so); no ReadWritePaths at all.
    assert words(unit, "ReadWritePaths") == []


def test_the_agent_may_write_only_its_state_dir_and_its_allow_roots() -> None:
    unit = parse_unit(AGENT)
    argv = exec_start(unit)
    assert set(words(unit, "ReadWritePaths")) == {*option(argv, "--state-dir"), *option(argv, "--allow-root")}
    assert len(words(unit, "ReadWritePaths")) == len(set(words(unit, "ReadWritePaths")))
    # Root, bounded to what NVML's power limits (SYS_ADMIN) and deleting users' checkpoints need.
    assert set(words(unit, "CapabilityBoundingSet")) == {"CAP_SYS_ADMIN", "CAP_DAC_OVERRIDE", "CAP_FOWNER"}
    assert one(unit, "Service", "ProtectHome") in ("read-only", "yes", "tmpfs")


# --- secrets ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_secrets_come_from_credentials_never_the_command_line(path: Path) -> None:
    unit = parse_unit(path)
    argv = exec_start(unit)
    assert not [a for a in argv[2:] if SECRET_WORDS.search(a)], argv
    assert one(unit, "Service", "EnvironmentFile") == "/etc/trainmedic/trainmedic.env"
    credentials = dict(c.split(":", 1) for c in values(unit, "Service", "LoadCredential"))
    for name, source in credentials.items():
        assert source == f"/etc/trainmedic/credentials/{name}"
    environment = dict(e.split("=", 1) for e in values(unit, "Service", "Environment"))
    for var, value in environment.items():
        # Only *_FILE pointers into the credentials directory; never a secret's value.
        assert var.startswith("TRAINMEDIC_") and var.endswith("_FILE"), var
        assert value.startswith("%d/") and value[3:] in credentials, value
    assert set(credentials) == {value[3:] for value in environment.values()}


def test_the_service_gets_its_three_secrets_and_the_agent_only_the_verify_key() -> None:
    service = dict(e.split("=", 1) for e in values(parse_unit(SERVICE), "Service", "Environment"))
    assert service == {"TRAINMEDIC_WEBHOOK_TOKEN_FILE": "%d/webhook-token",
                       "TRAINMEDIC_OPERATOR_TOKEN_FILE": "%d/operator-token",
                       "TRAINMEDIC_SIGNING_KEY_FILE": "%d/signing-key"}
    agent_unit = parse_unit(AGENT)
    agent = dict(e.split("=", 1) for e in values(agent_unit, "Service", "Environment"))
    assert agent == {"TRAINMEDIC_VERIFY_KEY_FILE": "%d/verify-key"}
    assert values(agent_unit, "Service", "LoadCredential") == ["verify-key:/etc/trainmedic/credentials/verify-key"]
    settings = [f"{k}={v}" for section in agent_unit.values() for k, v in section]
    assert not [s for s in settings if "signing" in s.lower()], settings


def test_the_example_environment_file_holds_placeholders_only() -> None:
    settings = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"TRAINMEDIC_[A-Z_]+", key), line
            settings[key] = value
    assert {"TRAINMEDIC_REDIS_URL", "TRAINMEDIC_ALLOWED_HOSTS", "TRAINMEDIC_PUBLIC_URL"} <= set(settings)
    for key, value in settings.items():
        assert "<" in value and ">" in value, f"{key} must be a <placeholder>, not {value!r}"
        assert not SECRET_WORDS.search(key), f"{key}: secrets are credentials, not environment"
    # Commented-out optional URLs are placeholders too.
    for line in ENV_EXAMPLE.read_text().splitlines():
        if re.match(r"#\s*TRAINMEDIC_[A-Z_]+=", line) and "://" in line:
            assert "<" in line, line
