"""The README's quick start, as a new user runs it: the sample alert, the curl that posts it, the example loop."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from tests.conftest import ROOT, load_fixture
from trainmedic.service.decide.detections import fingerprint

SAMPLE = ROOT / "examples" / "alertmanager-webhook.json"
README = (ROOT / "README.md").read_text()


def quick_start(heading: str) -> str:
    """The text of one `###` section of the README's quick start."""
    return README.split(f"### {heading}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]


def test_the_sample_alert_is_shaped_as_alertmanager_0_25_sends_it() -> None:
    sample, real = json.loads(SAMPLE.read_text()), load_fixture("firing_single.json")
    assert sample.keys() == real.keys() and sample["version"] == "4"
    [alert] = sample["alerts"]
    assert alert.keys() == real["alerts"][0].keys() and alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["fingerprint"] == fingerprint(alert["labels"])  # what Alertmanager computes from the labels
    assert alert["labels"]["alertname"] == "TrainingLossSpike" and alert["labels"]["job_name"] == "example-job"


def test_the_quick_start_curl_and_example_loop_make_the_lr_halve(gunicorn: Any, redis_url: str,
                                                                   tmp_path: Path) -> None:
    text = quick_start("Make something happen")
    assert ".venv/bin/pip install -e '.[demo]'" in text and "`demo` extra" in text
    [loop] = [line.split("#")[0].strip() for line in text.splitlines() if "examples/train.py --job" in line]
    [curl] = re.findall(r"^    (curl .*?\\\n\s+\S+)$", text, re.M)
    argv = shlex.split(curl.replace("\\\n", " "))
    assert argv[-1] == "http://127.0.0.1:9095/webhook"
    # The service as `make serve` runs it: no webhook token, so loopback needs none.
    server = gunicorn(workers=1, TRAINMEDIC_WEBHOOK_TOKEN="")
    argv[-1] = f"{server.url}/webhook"
    log = open(tmp_path / "train.log", "wb")
    proc = subprocess.Popen([sys.executable, *shlex.split(loop)[1:], "--redis-url", redis_url,
                             "--step-time", "0.02", "--checkpoint-every", "20"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        step = re.compile(r'^trainmedic_training_step\{job_name="example-job"\} (\d+)', re.M)
        # Past its first checkpoint (step 20), so that the rollback has one to restore.
        while int((step.findall(requests.get(server.url + "/metrics", timeout=5).text) or ["0"])[0]) < 25:
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "train.log").read_text()
            time.sleep(0.2)
        posted = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30)
        [made] = json.loads(posted.stdout)["remediations"]
        assert made["playbook"] == "loss-spike", posted.stdout
        record: dict = {}
        while time.monotonic() < deadline + 30:
            record = requests.get(f"{server.url}/remediations/{made['id']}", timeout=5).json()
            if record["status"] != "dispatched":
                break
            time.sleep(0.1)
        assert record["status"] == "applied", [(a["status"], a["result"]) for a in record["actions"]]
        assert [a["action"] for a in record["actions"]] == ["rollback_checkpoint", "scale_lr"]
        # The same notification again is the same episode: nothing runs twice.
        again = json.loads(subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30).stdout)
        assert again["remediations"] == [] and again["duplicates"] == 1
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert "scale_lr applied" in (tmp_path / "train.log").read_text()


def test_the_example_loop_without_torch_names_the_extra_in_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "no-torch"
    blocker.mkdir()
    # Python imports sitecustomize at start-up: from here, `import torch` fails as if it were not installed.
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    ran = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--job", "example-job"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(blocker)})
    assert ran.returncode == 1 and ran.stdout == ""
    assert ran.stderr.splitlines() == [
        "examples/train.py needs torch, which the demo extra brings: pip install 'trainmedic[demo]' "
        "(in a checkout: .venv/bin/pip install -e '.[demo]')"]
