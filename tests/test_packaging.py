"""One import package, extras by where code runs: built, checked and installed into fresh virtual environments."""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT

META = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def names(requirements: list[str]) -> set[str]:
    """The distribution names of requirement strings."""
    return {r.split("[")[0].split(">")[0].split("<")[0].split("=")[0].split(";")[0].strip().lower()
            for r in requirements}


def test_the_base_distribution_is_the_training_client_with_redis_only() -> None:
    assert names(META["dependencies"]) == {"redis"}
    extras = META["optional-dependencies"]
    assert names(extras["agent"]) == {"nvidia-ml-py", "cryptography", "requests"}
    assert not names(extras["agent"]) & {"flask", "gunicorn", "pyyaml"}
    assert {"flask", "gunicorn", "pyyaml", "trainmedic"} <= names(extras["service"])  # the agent's too
    # The frameworks are bounded to the major versions the tests run.
    for req in (*extras["transformers"], *extras["lightning"]):
        assert "<" in req, req
    assert "torch==2.13.0" in extras["test"]
    assert META["scripts"] == {"trainmedic": "trainmedic.service.cli:main"}


def test_code_that_runs_on_gpu_nodes_never_imports_service_code() -> None:
    offenders = []
    for path in (ROOT / "client").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}: {m}" for m in mods
                          if m.split(".")[0] in ("flask", "gunicorn", "yaml", "werkzeug")
                          or m.startswith("trainmedic.service")]
    assert offenders == []


def test_importing_the_client_pulls_in_no_web_stack() -> None:
    code = ("import sys, trainmedic.client; from trainmedic.client import RemediationClient; "
            "import trainmedic.service, trainmedic.service.cli; "
            "bad = [m for m in ('flask', 'gunicorn', 'werkzeug', 'yaml', 'transformers', 'lightning') "
            "if m in sys.modules]; print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An sdist and a wheel built by `python -m build`, as CI builds them."""
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], check=True,
                           capture_output=True, text=True, timeout=600)
    # What the build said, beside the folder (which holds the two archives only).
    (out.parent / f"{out.name}.log").write_text(built.stdout + built.stderr)
    yield out


def test_the_build_declares_its_package_data_without_a_warning(dist: Path) -> None:
    said = (dist.parent / f"{dist.name}.log").read_text()
    # Folders of data (lua/, static/, templates/) once each drew a 40-line "Package would be ignored" warning.
    assert "absent from the `packages` configuration" not in said and "Package would be ignored" not in said
    warned = [line for line in said.splitlines() if "warning" in line.lower() and "byte-compiling" not in line]
    assert warned == [], said


def test_build_makes_an_sdist_and_a_wheel_that_twine_accepts(dist: Path) -> None:
    built = sorted(p.name for p in dist.iterdir())
    assert [n.split("-")[0] for n in built] == ["trainmedic", "trainmedic"]
    assert any(n.endswith(".whl") for n in built) and any(n.endswith(".tar.gz") for n in built)
    check = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_wheel_installs_trainmedic_and_nothing_else_at_the_top(dist: Path) -> None:
    [wheel] = dist.glob("*.whl")
    members = zipfile.ZipFile(wheel).namelist()
    assert {m.split("/")[0] for m in members} == {"trainmedic", f"{wheel.name.split('-py3')[0]}.dist-info"}
    # trainmedic is a namespace of the three folders, and the Lua scripts, templates and playbooks come along.
    assert not any(m == "trainmedic/__init__.py" for m in members)
    for needed in ("trainmedic/client/wire/lua/decide.lua", "trainmedic/service/web/templates/base.html",
                   "trainmedic/service/web/static/trainmedic.js", "trainmedic/playbooks/default.yaml",
                   "trainmedic/service/gunicorn.conf.py", "trainmedic/playbooks/tests/training.test.yaml",
                   "trainmedic/playbooks/tests/ladder.yaml"):
        assert needed in members, needed
    # Every package of the tree is in it (a new subpackage missing from pyproject would be left out).
    for folder in ("client", "service"):
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.relative_to(ROOT).as_posix()
            assert f"trainmedic/{rel}" in members, rel


def _venv(where: Path) -> Path:
    venv.create(where, with_pip=True)
    return where / "bin"


def _install(bin_dir: Path, spec: str, cwd: Path) -> None:
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", spec], check=True, capture_output=True,
                   cwd=cwd, timeout=900)


def test_a_base_install_imports_beside_a_users_own_client_and_service_modules(dist: Path, tmp_path: Path) -> None:
    [wheel] = dist.glob("*.whl")
    bin_dir = _venv(tmp_path / "venv")
    _install(bin_dir, str(wheel), tmp_path)
    repo = tmp_path / "users-training-repo"
    repo.mkdir()
    (repo / "client.py").write_text("WHO = 'the user'\n")
    (repo / "service.py").write_text("WHO = 'the user'\n")
    code = ("import importlib.util as u, client, service; from trainmedic.client import RemediationClient; "
            "import trainmedic.client.wire.scripts as s; s.lua('decide'); s.lua('mark'); "
            "from trainmedic.client.checkpoints import newest_good; "
            "print(client.WHO, service.WHO, u.find_spec('flask') is None, u.find_spec('yaml') is None, "
            "u.find_spec('torch') is None, newest_good('.').path)")
    out = subprocess.run([str(bin_dir / "python"), "-c", code], capture_output=True, text=True, cwd=repo)
    assert out.stdout.split() == ["the", "user", "the", "user", "True", "True", "True", "None"], out.stderr
    # A command whose extra is missing says which one to install, in one line.
    serve = subprocess.run([str(bin_dir / "trainmedic"), "serve"], capture_output=True, text=True, cwd=repo)
    assert serve.returncode == 1 and serve.stderr.strip().splitlines() == [
        "trainmedic: `trainmedic serve` needs the service extra (flask is not installed): "
        "pip install 'trainmedic[service]'"]


def test_the_agent_extra_runs_the_agent_and_send_without_the_web_stack(dist: Path, tmp_path: Path) -> None:
    [wheel] = dist.glob("*.whl")
    bin_dir = _venv(tmp_path / "venv")
    _install(bin_dir, f"{wheel}[agent]", tmp_path)
    cli = str(bin_dir / "trainmedic")
    assert subprocess.run([str(bin_dir / "python"), "-c", "import flask"], capture_output=True).returncode == 1
    helped = subprocess.run([cli, "agent", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert helped.returncode == 0 and "--insecure-unsigned" in helped.stdout
    # Past every import: it stops at the first setting it lacks, in one line.
    agent = subprocess.run([cli, "agent", "--node", "gpu-1", "--redis-url", "redis://127.0.0.1:1/0",
                            "--state-dir", str(tmp_path / "s")], capture_output=True, text=True, cwd=tmp_path)
    assert agent.returncode == 1 and "needs TRAINMEDIC_VERIFY_KEY" in agent.stderr and "Traceback" not in agent.stderr
    send = subprocess.run([cli, "send", "--job", "j", "--url", "http://127.0.0.1:1", "scale_lr", "factor=0.5"],
                          capture_output=True, text=True, cwd=tmp_path, env={"PATH": str(bin_dir),
                                                                             "TRAINMEDIC_OPERATOR_TOKEN": "t"})
    assert send.returncode == 1 and "cannot reach http://127.0.0.1:1" in send.stderr, send.stderr


def test_make_demo_installs_what_the_demo_runs_and_not_the_test_tools() -> None:
    # NumPy too: torch warns at import without it.
    assert names(META["optional-dependencies"]["demo"]) == {"trainmedic", "torch", "numpy"}
    assert "trainmedic[service]" in META["optional-dependencies"]["demo"]
    planned = subprocess.run(["make", "-n", "-B", "demo"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert planned.returncode == 0, planned.stderr
    assert "pip install -q -e '.[demo]'" in planned.stdout and "[test]" not in planned.stdout
    assert "scripts/system-deps demo" in planned.stdout
    # Debian's Prometheus and Alertmanager only: no Slurm, Chromium or wrk for a demo.
    listed = subprocess.run(["bash", "-c", "source <(sed -n '/^tools=(/,/^)/p;/^target=/,/^fi/p' scripts/system-deps)"
                             " demo; printf '%s\\n' \"${tools[@]}\""], capture_output=True, text=True, cwd=ROOT)
    assert listed.stdout.split() == ["/usr/bin/prometheus-alertmanager:prometheus-alertmanager",
                                     "/usr/bin/prometheus:prometheus"], listed.stderr
