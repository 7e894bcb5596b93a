"""The client installs and imports without the service's dependencies."""
from __future__ import annotations

import subprocess
import sys
import tomllib
import venv
from pathlib import Path

from tests.conftest import ROOT


def test_importing_the_client_pulls_in_no_web_stack() -> None:
    code = ("import sys, trainmedic.client; from trainmedic.client import RemediationClient; "
            "bad = [m for m in ('flask', 'gunicorn', 'werkzeug', 'yaml', 'transformers', 'lightning') "
            "if m in sys.modules]; print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""


def test_the_base_distribution_depends_on_redis_only() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert [d.split(">")[0].split("=")[0] for d in meta["dependencies"]] == ["redis"]
    assert any(d.startswith("flask") for d in meta["optional-dependencies"]["service"])
    assert meta["scripts"] == {"trainmedic": "trainmedic.service.cli:main"}


def test_a_plain_install_gives_a_working_client_without_flask(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(ROOT)], check=True, capture_output=True,
                   cwd=tmp_path, timeout=600)
    code = ("import importlib.util as u, trainmedic.client; from trainmedic.client import RemediationClient; "
            "print(u.find_spec('flask') is None, u.find_spec('gunicorn') is None)")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.split() == ["True", "True"]
