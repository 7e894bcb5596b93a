"""Checkpoint manifests and trainmedic.client.checkpoints on real files: save() with its manifest, verify() with
and without one, newest_good() and its reasons, bad manifests, links out of the run folder, and the callbacks'
background manifest writer. Real Trainer and Lightning runs are tests/test_checkpoint_integrity.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainmedic.client import checkpoints, manifest
from trainmedic.client.checkpoints import Found, PassedOver, Why
from trainmedic.client.integrations import _hf_checkpoints
from trainmedic.client.integrations._manifests import ManifestWriter

from tests.conftest import ROOT
from tests.support.jobs import send, wait_record
from tests.support.loop import Loop


def state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "step": seed}


def saved(folder: Path, steps: range) -> list[Path]:
    """Plain-loop checkpoints step-N.pt saved with save(), one after another."""
    folder.mkdir(parents=True, exist_ok=True)
    return [Path(checkpoints.save(state(s), folder / f"step-{s}.pt", step=s)) for s in steps]


def hf_folder(path: Path, step: int, shards: int = 1) -> Path:
    """A Trainer checkpoint folder as the Trainer writes it (safetensors weights, sharded with an index)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    weights = {f"layer{i}.weight": torch.randn(8, 8) for i in range(shards * 2)}
    if shards == 1:
        save_file(weights, str(path / "model.safetensors"))
    else:
        index = {}
        for n in range(shards):
            name = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: v for i, (k, v) in enumerate(weights.items()) if i % shards == n}
            save_file(part, str(path / name))
            index.update(dict.fromkeys(part, name))
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    torch.save(state(step)["opt"], path / "optimizer.pt")
    torch.save({"last_epoch": step}, path / "scheduler.pt")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def cut(path: Path) -> None:
    """Cut a file to half its size; its times stay (as damage done while it was written leaves them)."""
    st = path.stat()
    os.truncate(path, st.st_size // 2)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def flip(path: Path) -> None:
    """Flip one byte in the middle of a file; its times stay."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_save_writes_the_checkpoint_and_its_manifest_and_newest_good_finds_the_newest(tmp_path: Path) -> None:
    paths = saved(tmp_path / "ckpts", range(1, 4))
    text = json.loads((tmp_path / "ckpts" / "step-3.trainmedic.json").read_text())
    assert set(text) == {"step", "files", "trainmedic"} and text["step"] == 3
    [entry] = text["files"]
    assert entry["path"] == "step-3.pt" and entry["size"] == paths[2].stat().st_size
    with open(paths[2], "rb") as f:
        assert entry["sha256"] == manifest.digest_of(f)
    assert torch.load(paths[2], weights_only=True)["step"] == 3
    assert checkpoints.newest_good(tmp_path / "ckpts") == Found(str(paths[2]), 3, ())
    # No temporary file is left beside them.
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == sorted(
        [p.name for p in paths] + [f"step-{s}.trainmedic.json" for s in (1, 2, 3)])


def test_newest_good_passes_over_each_broken_one_newest_first_and_says_why(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    paths = saved(folder, range(1, 6))
    flip(paths[4])                                           # a flipped bit
    cut(paths[3])                                            # a full disk
    (folder / "step-3.trainmedic.json").write_text("{half")  # a manifest that is not one
    (folder / "step-2.trainmedic.json").unlink()             # saved without one, and cut short
    cut(paths[1])
    found = checkpoints.newest_good(folder)
    assert found.path == str(paths[0]) and found.step == 1
    assert found.passed_over == (PassedOver(str(paths[4]), Why.DIGEST_MISMATCH),
                                 PassedOver(str(paths[3]), Why.SIZE_MISMATCH),
                                 PassedOver(str(paths[2]), Why.UNREADABLE),
                                 PassedOver(str(paths[1]), Why.UNREADABLE))
    assert [p.as_dict()["why"] for p in found.passed_over] == ["digest_mismatch", "size_mismatch", "unreadable",
                                                               "unreadable"]


def test_newest_good_keeps_those_before_a_step_or_a_time_and_says_none_when_none_is_whole(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    paths = saved(folder, range(1, 4))
    assert checkpoints.newest_good(folder, before_step=3).path == str(paths[1])
    middle = manifest.read(str(paths[1]))
    assert middle is not None and middle.saved_at is not None
    assert checkpoints.newest_good(folder, saved_before=middle.saved_at).path == str(paths[0])
    for p in paths:
        cut(p)
    found = checkpoints.newest_good(folder)
    assert found.path is None and found.step is None
    assert [p.why for p in found.passed_over] == [Why.SIZE_MISMATCH] * 3
    assert checkpoints.newest_good(tmp_path / "no-such-folder") == Found(None, None, ())


@pytest.mark.parametrize("text", [
    "{not json", "[]", '{"step": 1, "files": []}', '{"step": -1, "files": [FILE]}',
    '{"step": 1, "files": [{"path": "../step-1.pt", "size": 1, "sha256": "HEX"}]}',
    '{"step": 1, "files": [{"path": "/etc/passwd", "size": 1, "sha256": "HEX"}]}',
    '{"step": 1, "files": [{"path": "other.pt", "size": 1, "sha256": "HEX"}]}',
    '{"step": 1, "files": [{"path": "step-1.pt", "size": -5, "sha256": "HEX"}]}',
    '{"step": 1, "files": [{"path": "step-1.pt", "size": true, "sha256": "HEX"}]}',
    '{"step": 1, "files": [{"path": "step-1.pt", "size": 1, "sha256": "nothex"}]}',
    '{"step": 1, "files": [FILE, FILE]}', '{"step": 1, "files": [FILE], "trainmedic": []}',
], ids=["not-json", "not-an-object", "no-files", "negative-step", "dot-dot", "absolute", "another-file",
        "negative-size", "bool-size", "bad-digest", "twice", "bad-trainmedic"])
def test_a_bad_manifest_makes_its_checkpoint_unreadable_and_never_raises(tmp_path: Path, text: str) -> None:
    [path] = saved(tmp_path, range(1, 2))
    good = (tmp_path / "step-1.trainmedic.json").read_text()
    file = json.dumps(json.loads(good)["files"][0])
    (tmp_path / "step-1.trainmedic.json").write_text(text.replace("FILE", file).replace("HEX", "a" * 64))
    assert checkpoints.verify(path) == Why.UNREADABLE
    assert checkpoints.newest_good(tmp_path).passed_over == (PassedOver(str(path), Why.UNREADABLE),)
    with pytest.raises(manifest.ManifestError):
        manifest.read(str(path))


def test_a_manifest_naming_a_path_outside_its_folder_never_reads_it(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "run" / "checkpoint-5", 5)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 10)
    m = manifest.describe(str(folder), 5, {})
    (folder / "link.bin").symlink_to(secret)  # a link inside the folder that leads out of it
    manifest.write(str(folder), manifest.Manifest(5, (*m.files, manifest.Entry("link.bin", 10, "0" * 64)), {}))
    assert checkpoints.verify(folder) == Why.MISSING_FILE
    text = json.loads((folder / "trainmedic.json").read_text())
    text["files"].append({"path": "sub/../../secret.bin", "size": 10, "sha256": "0" * 64})
    (folder / "trainmedic.json").write_text(json.dumps(text))
    assert checkpoints.verify(folder) == Why.UNREADABLE


def test_without_a_manifest_a_file_verifies_when_it_opens(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    pt, st = tmp_path / "model.pt", tmp_path / "model.safetensors"
    torch.save(state(1), pt)
    save_file({"w": torch.randn(64, 64)}, str(st))
    assert checkpoints.verify(pt) is None and checkpoints.verify(st) is None
    cut(pt)
    cut(st)  # the header still parses; the tensors it names end past the end of the file
    assert checkpoints.verify(pt) == Why.UNREADABLE and checkpoints.verify(st) == Why.UNREADABLE
    st.write_bytes(b"\xff" * 64)
    assert checkpoints.verify(st) == Why.UNREADABLE
    assert checkpoints.verify(tmp_path / "gone.pt") == Why.MISSING_FILE


def test_a_trainer_folder_without_a_manifest_verifies_when_its_files_are_complete_and_open(tmp_path: Path) -> None:
    one = hf_folder(tmp_path / "checkpoint-1", 1)
    sharded = hf_folder(tmp_path / "checkpoint-2", 2, shards=2)
    assert checkpoints.verify(one) is None and checkpoints.verify(sharded) is None
    (one / "scheduler.pt").unlink()
    assert checkpoints.verify(one) == Why.INCOMPLETE
    cut(sharded / "model-00002-of-00002.safetensors")
    assert checkpoints.verify(sharded) == Why.UNREADABLE
    (sharded / "model-00002-of-00002.safetensors").unlink()  # the index names a shard that is not there
    assert checkpoints.verify(sharded) == Why.INCOMPLETE
    three = hf_folder(tmp_path / "checkpoint-3", 3)
    cut(three / "optimizer.pt")
    assert checkpoints.verify(three) == Why.UNREADABLE


def test_a_checkpoint_folder_linked_out_of_the_run_folder_is_not_followed(tmp_path: Path) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    hf_folder(run / "checkpoint-1", 1)
    outside = hf_folder(elsewhere / "checkpoint-9", 9)
    (run / "checkpoint-9").symlink_to(outside, target_is_directory=True)
    hf_folder(run / "real-4", 4)
    (run / "checkpoint-4").symlink_to(run / "real-4", target_is_directory=True)  # a link inside: followed
    steps = sorted(c.step or 0 for c in _hf_checkpoints.checkpoints(str(run), "TrainMedicCallback", None))
    assert steps == [1, 4]
    assert checkpoints.newest_good(run).path in (str(run / "checkpoint-4"), str(run / "real-4"))
    assert all("checkpoint-9" not in p.path for p in checkpoints.newest_good(run).passed_over)


def test_the_manifest_writer_writes_in_the_background_and_never_raises(tmp_path: Path) -> None:
    writer = ManifestWriter()
    folder = hf_folder(tmp_path / "checkpoint-7", 7)
    (folder / ".trainmedic.json.abc.tmp").write_text("left by a writer killed half-way")
    writer.submit(str(tmp_path / "checkpoint-gone"), 6, {})  # removed before it was hashed: no manifest
    writer.submit(str(folder), 7, {"saved_at": time.time()})
    assert writer.wait(100)
    assert not (tmp_path / "checkpoint-gone").exists() and writer.written == [str(folder / "trainmedic.json")]
    m = manifest.read(str(folder))
    assert m is not None and m.step == 7 and ".trainmedic.json.abc.tmp" not in [e.path for e in m.files]
    assert sorted(e.path for e in m.files) == ["model.safetensors", "optimizer.pt", "scheduler.pt",
                                               "trainer_state.json"]
    assert checkpoints.verify(folder) is None
    # Beside a file: the manifests of files the framework has since removed go with the next one.
    torch.save(state(1), tmp_path / "step=1.ckpt")
    writer.submit(str(tmp_path / "step=1.ckpt"), 1, {})
    assert writer.wait(100)
    (tmp_path / "step=1.ckpt").unlink()
    torch.save(state(2), tmp_path / "step=2.ckpt")
    writer.submit(str(tmp_path / "step=2.ckpt"), 2, {})
    assert writer.wait(100)
    assert not (tmp_path / "step=1.trainmedic.json").exists() and (tmp_path / "step=2.trainmedic.json").exists()


def test_save_refuses_a_step_that_is_not_a_whole_number_and_writes_nothing(tmp_path: Path) -> None:
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="step must be a whole number of at least 0"):
            checkpoints.save({}, tmp_path / "x.pt", step=bad)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_importing_the_checkpoints_helper_imports_no_torch() -> None:
    code = ("import sys, trainmedic.client.checkpoints, trainmedic.client.manifest; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_readme_rollback_recipe_restores_the_newest_whole_checkpoint_of_a_plain_loop(
        r: Any, redis_url: str, tmp_path: Path) -> None:
    loop = Loop(redis_url, "plain-recipe")
    rc, model, opt, sched = loop.rc, loop.param, loop.opt, loop.sched
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    restored: list[torch.Tensor] = []

    # The README's recipes, as a plain loop writes them (the model is one parameter here).
    @rc.handler("save_checkpoint")
    def save(params: dict) -> dict:
        path = checkpoints.save({"model": model.detach().clone(), "opt": opt.state_dict(),
                                 "sched": sched.state_dict(), "trainmedic": rc.state_dict(), "step": loop.t},
                                ckpts / f"step-{loop.t}.pt", step=loop.t)
        return {"path": path}

    @rc.handler("rollback_checkpoint")
    def rollback(params: dict) -> dict:
        found = checkpoints.newest_good(ckpts, saved_before=rc.alert_start)  # whole, and saved before the alert
        passed = [p.as_dict() for p in found.passed_over]
        if found.path is None:
            raise RuntimeError(f"no whole checkpoint was saved before the alert began (passed over: {passed})")
        ckpt = torch.load(found.path, weights_only=True)
        with torch.no_grad():
            model.copy_(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        rc.rolled_back_to(ckpt["trainmedic"])
        restored.append(model.detach().clone())
        return {"checkpoint": found.path, "checkpoint_step": ckpt["step"], "skipped_batches": loop.t - ckpt["step"],
                "passed_over": passed}

    try:
        values = {}
        for _ in range(3):
            loop.run_for(0.05)
            wait_record(r, send(r, "plain-recipe", "save_checkpoint"), tick=loop.tick)
            values[int(loop.acks[-1].result["path"].rsplit("-", 1)[1][:-3])] = None
        steps = sorted(values)
        newest = ckpts / f"step-{steps[-1]}.pt"
        flip(newest)
        done = wait_record(r, send(r, "plain-recipe", "rollback_checkpoint"), tick=loop.tick)
        [roll] = done["actions"]
        assert roll["status"] == "applied", roll
        assert roll["result"]["checkpoint"] == str(ckpts / f"step-{steps[1]}.pt")
        assert roll["result"]["passed_over"] == [{"path": str(newest), "why": "digest_mismatch"}]
        saved_model = torch.load(ckpts / f"step-{steps[1]}.pt", weights_only=True)["model"]
        assert len(restored) == 1 and torch.equal(restored[0], saved_model)
    finally:
        rc.close()
