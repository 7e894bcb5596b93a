"""The built-in rollback_checkpoint restores only a checkpoint that is whole, in real Transformers Trainer and
Lightning runs on the CPU (tests/rollback_worker.py, one process or two gloo ranks).

The test damages checkpoints as a crash, a full disk, a partial copy or a flipped bit would (keeping their
mtime, as damage at save time leaves it), or kills (-9) a run half-way through a save and resumes it; the
rollback passes over each newer broken checkpoint, says why, and restores the newest whole one, or, with none,
fails and leaves training exactly as an untouched twin run.
"""
from __future__ import annotations

import html
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from trainmedic.client import manifest

from tests.conftest import OP_AUTH
from tests.support.jobs import send, wait_record, wait_until
from tests.test_rollback import HOLD, fire, own_ack, run, start

NO_SPIKE = 10**6


def ckpt(tmp: Path, framework: str, step: int) -> Path:
    """Where the worker's run saves its checkpoint of `step`."""
    return tmp / "hf" / f"checkpoint-{step}" if framework == "hf" else tmp / "pl" / f"step={step}.ckpt"


def weights(path: Path) -> Path:
    return path / "model.safetensors" if path.is_dir() else path


def manifest_file(path: Path) -> Path:
    return Path(manifest.location(str(path))[0])


def wait_manifests(tmp: Path, framework: str, steps: list[int]) -> None:
    """Until the background thread has written the manifest of each of these checkpoints."""
    wait_until(lambda: all(manifest_file(ckpt(tmp, framework, s)).exists() for s in steps), timeout=100,
               what=f"the manifests of checkpoints {steps}")


def damage(path: Path, how: str) -> None:
    """Flip a byte in the middle of a file, or cut it to half its size; its times stay as they were."""
    st = path.stat()
    if how == "flip":
        with open(path, "r+b") as f:
            f.seek(st.st_size // 2)
            byte = f.read(1)[0]
            f.seek(st.st_size // 2)
            f.write(bytes([byte ^ 0xFF]))
    else:
        os.truncate(path, st.st_size // 2)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def passed(result: dict) -> list[tuple[str, str]]:
    return [(Path(p["path"]).name, p["why"]) for p in result["passed_over"]]


def probes(rank: dict) -> dict[int, float]:
    return {row[0]: row[1] for row in rank["rows"]}


def check_manifest(path: Path, step: int) -> dict:
    """The manifest lists every file of the checkpoint but itself, each with its size and SHA-256."""
    m = manifest.read(str(path))
    assert m is not None and m.step == step
    assert m.saved_at is not None and m.trainmedic["job"]
    folder = Path(manifest.location(str(path))[1])
    on_disk = sorted(p.relative_to(folder).as_posix() for p in (path.rglob("*") if path.is_dir() else [path])
                     if p.is_file() and p.name != manifest.MANIFEST)
    assert [e.path for e in m.files] == on_disk
    for e in m.files:
        with open(folder / e.path, "rb") as f:
            assert (folder / e.path).stat().st_size == e.size and manifest.digest_of(f) == e.sha256
    # Written last: after every file it lists.
    assert all(manifest_file(path).stat().st_mtime_ns >= (folder / e.path).stat().st_mtime_ns for e in m.files)
    return json.loads(manifest_file(path).read_text())


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_the_rollback_passes_over_damaged_checkpoints_and_restores_the_newest_whole_one(
        framework: str, r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    job, ids, shapes = f"{framework}-damaged", {}, {}
    http = make_app().test_client()

    def at_46(gate: dict) -> None:
        wait_manifests(tmp_path, framework, [10, 20, 30, 40])
        shapes["40"] = check_manifest(ckpt(tmp_path, framework, 40), 40)
        damage(weights(ckpt(tmp_path, framework, 40)), "flip")       # a flipped bit
        damage(weights(ckpt(tmp_path, framework, 30)), "truncate")   # a full disk
        manifest_file(ckpt(tmp_path, framework, 20)).unlink()         # saved without a manifest, and cut short
        damage(weights(ckpt(tmp_path, framework, 20)), "truncate")
        ids["spike"] = fire(http, job, gate["t_spike"])

    [rank] = run(framework, 1, tmp_path, redis_url, job, {46: HOLD}, {46: at_46}, steps=60)
    assert set(shapes["40"]) == {"step", "files", "trainmedic"}
    rec = wait_record(r, ids["spike"])
    roll = rec["actions"][0]
    assert rec["status"] == "applied" and roll["status"] == "applied", roll
    assert roll["result"]["checkpoint_step"] == 10 and roll["result"]["skipped_batches"] == 47 - 10
    assert Path(roll["result"]["checkpoint"]).name == ckpt(tmp_path, framework, 10).name
    names = [ckpt(tmp_path, framework, s).name for s in (40, 30, 20)]
    assert passed(roll["result"]) == list(zip(names, ["digest_mismatch", "size_mismatch", "unreadable"]))
    probe = probes(rank)
    assert probe[47] == pytest.approx(probe[10], rel=1e-6)  # checkpoint 10's weights, exactly
    assert rank["global_step"] == 60  # and training went on to the end
    # The record page says which checkpoints were passed over, and why, in words.
    page = html.unescape(re.sub(r"<[^>]+>", "", http.get(f"/records/{ids['spike']}", headers=OP_AUTH).get_data(
        as_text=True)))
    assert "Passed over, newest first:" in page
    for p, why in zip(roll["result"]["passed_over"], ["a file's SHA-256 differs from its manifest's",
                                                      "a file is not the size its manifest lists",
                                                      "its manifest or weights do not parse"]):
        assert f"{p['path']} {why}" in page


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_with_every_checkpoint_broken_the_rollback_fails_and_training_goes_on_as_its_untouched_twin(
        framework: str, r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    job, ids = f"{framework}-all-broken", {}
    make_app()
    (tmp_path / "twin").mkdir()
    [twin] = run(framework, 1, tmp_path / "twin", redis_url, f"{job}-twin", {}, {}, spike_at=NO_SPIKE, steps=40)

    def at_25(gate: dict) -> None:
        wait_manifests(tmp_path, framework, [10, 20])
        damage(weights(ckpt(tmp_path, framework, 20)), "flip")
        if framework == "hf":  # saved without a manifest, and a file of the Trainer's missing
            manifest_file(ckpt(tmp_path, framework, 10)).unlink()
            (ckpt(tmp_path, framework, 10) / "optimizer.pt").unlink()
        else:
            damage(weights(ckpt(tmp_path, framework, 10)), "truncate")
        ids["roll"] = send(r, job, "rollback_checkpoint")

    [rank] = run(framework, 1, tmp_path, redis_url, job, {25: HOLD}, {25: at_25}, spike_at=NO_SPIKE, steps=40)
    rec = wait_record(r, ids["roll"])
    [roll] = rec["actions"]
    assert rec["status"] == "failed" and roll["status"] == "failed" and roll["reason"] == "no_good_checkpoint"
    assert roll["result"]["error"].startswith("None of the 2 checkpoints in ")
    assert roll["result"]["error"].endswith("is whole, so nothing was restored."), roll["result"]["error"]
    why_10 = "incomplete" if framework == "hf" else "size_mismatch"
    assert passed(roll["result"]) == [(ckpt(tmp_path, framework, 20).name, "digest_mismatch"),
                                      (ckpt(tmp_path, framework, 10).name, why_10)]
    assert own_ack(rank, ids["roll"], 0)["status"] == "failed"
    # Nothing was restored: the weights, LR, scheduler and data went on exactly as in the run nobody touched.
    assert rank["global_step"] == twin["global_step"] == 40
    assert rank["rows"] == twin["rows"]


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_a_save_killed_half_way_is_passed_over_by_the_rollback_of_the_resumed_run(
        framework: str, r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    job, ids = f"{framework}-killed", {}
    make_app()
    [first] = start(framework, 1, tmp_path, redis_url, job, {}, spike_at=NO_SPIKE, steps=60, hold_in_save=40)
    try:
        wait_until(lambda: (tmp_path / "saving-40.json").exists() or first.poll() is not None, timeout=120,
                   what="the run to be inside its save of checkpoint 40")
        assert first.poll() is None, (tmp_path / "rank0.log").read_text()[-3000:]
        wait_manifests(tmp_path, framework, [10, 20, 30])
        os.kill(first.pid, signal.SIGKILL)
    finally:
        if first.poll() is None:
            first.kill()
        first.wait()
    assert first.returncode == -signal.SIGKILL
    cut = ckpt(tmp_path, framework, 40)
    assert cut.exists() and not manifest_file(cut).exists()
    time.sleep(0.05)  # the resumed run's alert begins strictly after the cut save's files

    def at_45(gate: dict) -> None:
        ids["roll"] = send(r, job, "rollback_checkpoint")

    [rank] = run(framework, 1, tmp_path, redis_url, job, {45: HOLD}, {45: at_45}, spike_at=NO_SPIKE, steps=50,
                 save_every=0, resume_from=str(ckpt(tmp_path, framework, 30)))
    rec = wait_record(r, ids["roll"])
    [roll] = rec["actions"]
    assert roll["status"] == "applied", roll
    assert roll["result"]["checkpoint_step"] == 30 and roll["result"]["skipped_batches"] == 46 - 30
    # The Trainer's cut save lacks trainer_state.json; Lightning's (written in place) is half a file.
    assert passed(roll["result"]) == [(cut.name, "incomplete" if framework == "hf" else "unreadable")]
    probe = probes(rank)
    assert min(probe) == 30 and probe[46] == pytest.approx(probe[30], rel=1e-6)
    assert rank["global_step"] == 50


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_both_ranks_pass_over_a_checkpoint_missing_a_part_and_restore_the_same_whole_one(
        framework: str, r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    job, ids, listed = f"{framework}-ranks-damaged", {}, {}
    http = make_app().test_client()

    def at_46(gate: dict) -> None:
        wait_manifests(tmp_path, framework, [10, 20, 30, 40])
        forty = ckpt(tmp_path, framework, 40)
        check_manifest(forty, 40)
        # One manifest per checkpoint, however many ranks wrote it.
        listed["manifests"] = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json")
                                     if p.name.endswith(manifest.SUFFIX) or p.name == manifest.MANIFEST)
        if framework == "hf":  # each rank writes its own RNG state into the checkpoint: rank 1's goes
            listed["files"] = [e.path for e in manifest.read(str(forty)).files]  # type: ignore[union-attr]
            (forty / "rng_state_1.pth").unlink()
        else:  # rank 0 writes a DDP run's one .ckpt: cut short
            damage(forty, "truncate")
        ids["spike"] = fire(http, job, gate["t_spike"])

    ranks = run(framework, 2, tmp_path, redis_url, job, {46: HOLD}, {46: at_46}, steps=60)
    rec = wait_record(r, ids["spike"], timeout=30)
    roll = rec["actions"][0]
    assert roll["status"] == "applied" and roll["result"]["ranks"] == 2 == roll["result"]["ranks_applied"], roll
    assert roll["result"]["checkpoint_step"] == 30
    why = "missing_file" if framework == "hf" else "size_mismatch"
    assert passed(roll["result"]) == [(ckpt(tmp_path, framework, 40).name, why)]
    if framework == "hf":
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(listed["files"])
        assert listed["manifests"] == [f"hf/checkpoint-{s}/trainmedic.json" for s in (10, 20, 30, 40)]
    else:
        assert listed["manifests"] == [f"pl/step={s}.trainmedic.json" for s in (10, 20, 30, 40)]
    for rank in ranks:
        own = own_ack(rank, ids["spike"], 0)
        assert own["status"] == "applied" and own["result"]["checkpoint_step"] == 30
        assert passed(own["result"]) == [(ckpt(tmp_path, framework, 40).name, why)]
        assert probes(rank)[47] == pytest.approx(probes(rank)[30], rel=1e-6)
    assert ranks[0]["rows"] == ranks[1]["rows"]
