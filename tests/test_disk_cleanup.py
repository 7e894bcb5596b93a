"""disk_cleanup on real temporary trees: keep-newest, age, patterns, protect, byte cap, links, `..`, files being
written, and allow-roots pinned at start."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from trainmedic.client.wire.actions import CATALOGUE, DiskCleanup, ParamError
from trainmedic.client import manifest
from trainmedic.client.agent import disk
from trainmedic.client.receiver.applier import ActionFailed

from tests.conftest import post_json
from tests.support.nvml import wait_record

DAY = 86400.0


def put(path: Path, size: int = 1000, age: float = 10 * DAY) -> Path:
    """A file of `size` bytes last modified `age` seconds ago."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    # Ages count from now, not from import: the suite may reach this test minutes after collecting it.
    now = time.time()
    os.utime(path, (now - age, now - age))
    return path


def ckpt_dir(path: Path, size: int = 1000, age: float = 10 * DAY, protected: str | None = None) -> Path:
    """A checkpoint folder (weights and optimizer state, plus a protected file if named) last modified `age` ago."""
    put(path / "model.safetensors", size - 100, age)
    put(path / "optimizer.pt", 100, age)
    if protected:
        put(path / protected, 50, age)
    now = time.time()
    os.utime(path, (now - age, now - age))
    return path


def params(**kw: Any) -> DiskCleanup:
    return CATALOGUE["disk_cleanup"].parse(kw)


def clean(roots: list[Path], p: DiskCleanup, **kw: Any) -> dict:
    """What the agent does: pin the allow-roots (at its start), then clean below them."""
    pinned = disk.pin_roots(roots)
    try:
        return disk.cleanup(pinned, p, **kw)
    finally:
        for root in pinned:
            os.close(root.fd)


def test_it_keeps_the_newest_keep_last_of_each_run_and_deletes_the_rest(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for i, step in enumerate((100, 200, 300, 400, 500)):
        ckpt_dir(root / "llama" / f"checkpoint-{step}", 1000, age=(20 - i) * DAY)
    put(root / "bert" / "epoch=1-step=10.ckpt", 500, 30 * DAY)
    put(root / "bert" / "epoch=2-step=20.ckpt", 500, 29 * DAY)
    res = clean([root], params(keep_last=3, older_than="7d"))
    assert sorted(res["deleted"]) == [str(root / "llama" / "checkpoint-100"), str(root / "llama" / "checkpoint-200")]
    assert res["bytes_freed"] == 2000 and res["deleted_count"] == 2
    assert sorted(p.name for p in (root / "llama").iterdir()) == ["checkpoint-300", "checkpoint-400", "checkpoint-500"]
    assert len(list((root / "bert").iterdir())) == 2  # a run with fewer than keep_last keeps them all
    assert res["kept"] == 5


def test_newest_means_last_modified_not_highest_name(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    put(root / "a" / "ckpt-9.pt", age=8 * DAY)
    put(root / "a" / "ckpt-10.pt", age=9 * DAY)  # older though its number is higher
    res = clean([root], params(keep_last=1, older_than="1d"))
    assert res["deleted"] == [str(root / "a" / "ckpt-10.pt")]


def test_only_entries_older_than_older_than_go(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for age in (1, 2, 3, 8, 9):
        put(root / "r" / f"ckpt-{age}d.pt", age=age * DAY)
    res = clean([root], params(keep_last=0, older_than="7d"))
    assert sorted(Path(p).name for p in res["deleted"]) == ["ckpt-8d.pt", "ckpt-9d.pt"]
    assert sorted(p.name for p in (root / "r").iterdir()) == ["ckpt-1d.pt", "ckpt-2d.pt", "ckpt-3d.pt"]


def test_only_entries_matching_the_patterns_go(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    keep = [put(root / "r" / n) for n in ("notes.txt", "data.bin", "config.json", "events.out.tfevents.1")]
    gone = [put(root / "r" / n) for n in ("model.pt", "opt.pth", "last.ckpt", "checkpoint_7", "global_step40")]
    res = clean([root], params(keep_last=0, older_than="1d"))
    assert sorted(res["deleted"]) == sorted(map(str, gone))
    assert all(p.exists() for p in keep) and not any(p.exists() for p in gone)

    res = clean([root], params(keep_last=0, older_than="1d", patterns=["*.bin"]))
    assert res["deleted"] == [str(root / "r" / "data.bin")]


def test_a_checkpoint_folder_is_one_entry_and_never_searched_inside(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    ckpt_dir(root / "r" / "checkpoint-1", age=9 * DAY)
    put(root / "r" / "checkpoint-2" / "inner.pt", age=9 * DAY)
    put(root / "r" / "checkpoint-2" / "nested" / "deep.pt", age=9 * DAY)
    res = clean([root], params(keep_last=1, older_than="1d"))
    assert res["deleted_count"] == 1 and res["kept"] == 1
    assert len(list((root / "r").iterdir())) == 1


def test_the_byte_cap_deletes_oldest_first_and_never_more_than_max_bytes(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for i in range(6):
        put(root / "r" / f"ckpt-{i}.pt", 1000, age=(30 - i) * DAY)
    res = clean([root], params(keep_last=0, older_than="1d", max_bytes=2500))
    assert [Path(p).name for p in res["deleted"]] == ["ckpt-0.pt", "ckpt-1.pt"]
    assert res["bytes_freed"] == 2000 <= 2500
    assert res["over_cap"] == 4
    assert len(list((root / "r").iterdir())) == 4


def test_a_link_to_outside_the_root_is_neither_followed_nor_its_target_deleted(tmp_path: Path) -> None:
    root, outside = tmp_path / "runs", tmp_path / "precious"
    target = put(outside / "model.pt", 5000, age=90 * DAY)
    ckpt_dir(outside / "checkpoint-9", age=90 * DAY)
    put(root / "r" / "real.pt", 10, age=90 * DAY)
    (root / "r" / "linked.pt").symlink_to(target)                         # a matching link to a file
    (root / "r" / "checkpoint-9").symlink_to(outside / "checkpoint-9")     # a matching link to a folder
    (root / "elsewhere").symlink_to(outside, target_is_directory=True)    # a run folder that is a link
    inner = ckpt_dir(root / "r" / "checkpoint-1", age=90 * DAY)
    (inner / "shared.pt").symlink_to(target)                              # a link inside a doomed folder
    for p in (inner / "shared.pt", inner):
        os.utime(p, (time.time() - 90 * DAY, time.time() - 90 * DAY), follow_symlinks=False)

    res = clean([root], params(keep_last=0, older_than="1d"))

    assert sorted(res["deleted"]) == [str(root / "r" / "checkpoint-1"), str(root / "r" / "real.pt")]
    assert res["bytes_freed"] == 1010  # the link inside counted nothing
    assert target.read_bytes() == b"x" * 5000 and (outside / "checkpoint-9" / "model.safetensors").exists()
    assert (root / "r" / "linked.pt").is_symlink() and (root / "r" / "checkpoint-9").is_symlink()
    assert sorted(res["links_ignored"]) == [str(root / "r" / "checkpoint-9"), str(root / "r" / "linked.pt")]


def test_a_folder_swapped_for_a_link_after_the_scan_is_not_followed(tmp_path: Path, monkeypatch) -> None:
    root, outside = tmp_path / "runs", tmp_path / "precious"
    ckpt_dir(outside / "run" / "checkpoint-1", age=90 * DAY)
    ckpt_dir(root / "run" / "checkpoint-1", age=90 * DAY)
    real_select = disk._select

    def select_then_swap(*args: Any) -> Any:
        chosen = real_select(*args)
        shutil.rmtree(root / "run")
        (root / "run").symlink_to(outside / "run", target_is_directory=True)  # the classic race
        return chosen

    monkeypatch.setattr(disk, "_select", select_then_swap)
    with pytest.raises(ActionFailed, match="Nothing could be deleted"):
        clean([root], params(keep_last=0, older_than="1d"))
    assert (outside / "run" / "checkpoint-1" / "model.safetensors").exists()


def test_dot_dot_in_an_allow_root_is_resolved_and_cannot_widen_it(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    put(root / "r" / "old.pt", age=9 * DAY)
    sibling = put(tmp_path / "other" / "old.pt", age=9 * DAY)
    res = clean([root / "r" / ".." / "r" / ".."], params(keep_last=0, older_than="1d"))
    assert res["roots"] == [str(root.resolve())] and res["deleted"] == [str(root.resolve() / "r" / "old.pt")]
    assert sibling.exists()
    with pytest.raises(ValueError, match="anywhere on the host"):
        disk.pin_roots([tmp_path / ".." / ".." / ".." / ".." / ".." / ".." / ".." / ".."])


@pytest.mark.parametrize("patterns", [["../*.pt"], [".."], ["r/*.pt"], ["/etc/*"], []])
def test_patterns_name_entries_never_paths(patterns: list) -> None:
    with pytest.raises(ParamError):
        CATALOGUE["disk_cleanup"].parse({"patterns": patterns})


def test_a_file_being_written_is_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    put(root / "r" / "old.pt", age=9 * DAY)
    put(root / "r" / "writing.pt", age=5)
    folder = ckpt_dir(root / "r" / "checkpoint-9", age=9 * DAY)
    put(folder / "optimizer.pt.tmp", age=2)  # a save still in progress inside an old-looking folder
    res = clean([root], params(keep_last=0, older_than=0))
    assert res["deleted"] == [str(root / "r" / "old.pt")]
    assert sorted(x["path"] for x in res["left_alone"]) == [str(folder), str(root / "r" / "writing.pt")]
    assert {x["reason"] for x in res["left_alone"]} == {"modified in the last minute"}
    assert (root / "r" / "writing.pt").exists() and folder.exists()


def test_a_dry_run_lists_what_would_go_and_deletes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    files = [put(root / "r" / f"ckpt-{i}.pt", 100, age=(20 - i) * DAY) for i in range(4)]
    res = clean([root], params(keep_last=1, older_than="1d"), dry_run=True)
    assert res["dry_run"] is True and res["deleted"] == [] and res["bytes_freed"] == 0
    assert sorted(res["would_delete"]) == sorted(map(str, files[:3])) and res["bytes_would_free"] == 300
    assert all(f.exists() for f in files)


def test_an_allow_root_that_does_not_exist_is_refused_at_start_and_one_removed_later_fails(tmp_path: Path) -> None:
    put(tmp_path / "runs" / "old.pt", age=9 * DAY)
    with pytest.raises(ValueError) as err:
        disk.pin_roots([tmp_path / "runs", tmp_path / "gone"])
    assert str(err.value) == f"--allow-root {tmp_path / 'gone'} does not exist or is not a folder"
    with pytest.raises(ActionFailed, match="without --allow-root"):
        disk.cleanup([], params())
    later = tmp_path / "later"
    later.mkdir()
    pinned = disk.pin_roots([later])
    later.rmdir()
    with pytest.raises(ActionFailed) as failed:
        disk.cleanup(pinned, params())
    assert failed.value.message == f"The allow-root {later} was removed after the agent started; nothing was deleted."
    assert (tmp_path / "runs" / "old.pt").exists()


def test_nested_allow_roots_are_walked_once(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    put(root / "a" / "b" / "old.pt", 700, age=9 * DAY)
    res = clean([root, root / "a", root / "a" / "b"], params(keep_last=0, older_than="1d"))
    assert res["roots"] == [str(root)] and res["bytes_freed"] == 700


# -- end to end: the shipped disk-space-low playbook, a real agent subprocess


def disk_alert(node: str, fingerprint: str) -> dict:
    return {"receiver": "trainmedic", "status": "firing", "version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0,
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am",
            "alerts": [{"status": "firing", "labels": {"alertname": "DiskSpaceLow", "instance": f"{node}:9100",
                                                       "mountpoint": "/data"},
                        "annotations": {}, "startsAt": "2026-11-22T01:25:24Z", "endsAt": "0001-01-01T00:00:00Z",
                        "generatorURL": "", "fingerprint": fingerprint}]}


def run_tree(root: Path) -> list[Path]:
    return [ckpt_dir(root / "llama" / f"checkpoint-{s}", 2000, age=(40 - s) * DAY) for s in range(1, 6)]


def test_the_agent_cleans_its_allow_root_when_disk_space_is_low(agents, http, r, tmp_path: Path) -> None:
    root = tmp_path / "data" / "runs"
    ckpts = run_tree(root)
    best = put(root / "llama" / "best.pt", 4000, age=25 * DAY)  # the shipped playbook's *.pt must not take it
    agents("gpu-node-7", allow_roots=[root]).wait_ready(r)
    resp = post_json(http, "/webhook", disk_alert("gpu-node-7", "d15c000000000001"))
    rec = wait_record(r, resp.get_json()["remediations"][0]["id"])
    res = rec["actions"][0]["result"]
    assert rec["status"] == "applied", rec
    assert sorted(res["deleted"]) == sorted(map(str, ckpts[:2])) and res["bytes_freed"] == 4000
    assert [c.exists() for c in ckpts] == [False, False, True, True, True]
    assert best.read_bytes() == b"x" * 4000 and res["protected"] == [str(best)]


def test_a_dry_run_agent_only_lists_and_an_agent_with_a_missing_root_does_not_start(agents, http, r,
                                                                                    tmp_path: Path) -> None:
    root = tmp_path / "runs"
    ckpts = run_tree(root)
    agents("gpu-node-8", allow_roots=[root], dry_run=True).wait_ready(r)
    dry = post_json(http, "/webhook", disk_alert("gpu-node-8", "d15c000000000002")).get_json()
    rec = wait_record(r, dry["remediations"][0]["id"])
    assert rec["status"] == "skipped"  # nothing done is not a failure
    act = rec["actions"][0]
    assert act["status"] == "skipped" and act["reason"] == "dry_run"
    assert sorted(act["result"]["would_delete"]) == sorted(map(str, ckpts[:2]))
    assert all(c.exists() for c in ckpts)
    missing = agents("gpu-node-9", allow_roots=[tmp_path / "not-there"])
    assert missing.proc.wait(20) == 1
    assert missing.log().strip().splitlines() == [
        f"trainmedic: --allow-root {tmp_path / 'not-there'} does not exist or is not a folder"]


# -- protect: what people keep is never deleted (defaults best*, *final*, *.json, *.yaml, *.yml, *.md, *.txt)


def test_best_and_final_checkpoints_survive_the_default_patterns(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    best = put(root / "r" / "best.pt", 300, age=25 * DAY)
    final = put(root / "final" / "ckpt-1.pt", 300, age=25 * DAY)  # a component below the root matches *final*
    old = [put(root / "r" / f"ckpt-{i}.pt", 100, age=(30 - i) * DAY) for i in range(5)]
    res = clean([root], params(keep_last=0, older_than="7d"))
    assert sorted(res["deleted"]) == sorted(map(str, old))
    assert best.exists() and final.exists()
    assert sorted(res["protected"]) == [str(root / "final"), str(best)]


def test_a_checkpoint_folder_is_pruned_around_its_protected_files(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    hf = ckpt_dir(root / "r" / "checkpoint-100", 1000, age=20 * DAY, protected="trainer_state.json")
    put(hf / "nested" / "config.json", 20, age=20 * DAY)
    put(hf / "nested" / "shard.pt", 500, age=20 * DAY)
    for folder in (hf / "nested", hf):  # making nested/ touched both folders
        os.utime(folder, (time.time() - 20 * DAY, time.time() - 20 * DAY))
    plain = ckpt_dir(root / "r" / "checkpoint-200", 1000, age=19 * DAY)
    res = clean([root], params(keep_last=0, older_than="7d"))
    assert res["deleted"] == [str(plain)] and res["deleted_count"] == 1  # only what is gone
    assert res["pruned"] == [{"path": str(hf), "kept": ["nested/config.json", "trainer_state.json"]}]
    assert res["pruned_count"] == 1
    assert res["bytes_freed"] == 1000 + 500 + 1000  # what went; the protected files counted nothing
    assert sorted(str(p.relative_to(hf)) for p in hf.rglob("*")) == ["nested", "nested/config.json",
                                                                     "trainer_state.json"]
    assert not plain.exists()
    assert sorted(res["protected"]) == [str(hf / "nested" / "config.json"), str(hf / "trainer_state.json")]


def test_a_run_folder_that_keeps_a_protected_file_is_pruned_and_every_deleted_path_is_gone(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    run1 = root / "run1"
    put(run1 / "weights.bin", 4000, age=30 * DAY)
    put(run1 / "logs" / "events.log", 300, age=30 * DAY)
    put(run1 / "config.yaml", 70, age=30 * DAY)
    put(root / "run2" / "weights.bin", 2000, age=30 * DAY)
    for folder in (run1 / "logs", run1, root / "run2"):
        os.utime(folder, (time.time() - 30 * DAY, time.time() - 30 * DAY))
    res = clean([root], params(keep_last=0, older_than="7d", patterns=["run*"]))
    assert res["deleted"] == [str(root / "run2")]
    assert res["pruned"] == [{"path": str(run1), "kept": ["config.yaml"]}]
    assert all(not Path(p).exists() for p in res["deleted"])
    assert sorted(p.name for p in run1.iterdir()) == ["config.yaml"]  # logs/ went with everything in it
    assert res["bytes_freed"] == 4000 + 300 + 2000


def test_a_dry_run_lists_a_folder_it_would_prune_with_what_would_stay(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    hf = ckpt_dir(root / "r" / "checkpoint-100", 1000, age=20 * DAY, protected="trainer_state.json")
    plain = ckpt_dir(root / "r" / "checkpoint-200", 1000, age=19 * DAY)
    res = clean([root], params(keep_last=0, older_than="7d"), dry_run=True)
    assert res["would_delete"] == [str(plain)] and res["would_delete_count"] == 1
    assert res["would_prune"] == [{"path": str(hf), "kept": ["trainer_state.json"]}]
    assert res["would_prune_count"] == 1 and res["pruned"] == [] and res["deleted"] == []
    assert res["bytes_would_free"] == 2000
    assert (hf / "model.safetensors").exists() and plain.exists()


# -- bytes freed: only data whose last link went


def test_a_hard_link_whose_data_lives_outside_the_root_frees_nothing(tmp_path: Path) -> None:
    root, outside = tmp_path / "runs", tmp_path / "precious"
    original = put(outside / "model.pt", 5000, age=90 * DAY)
    linked = root / "r" / "ckpt-1.pt"
    linked.parent.mkdir(parents=True)
    os.link(original, linked)
    plain = put(root / "r" / "ckpt-2.pt", 300, age=90 * DAY)
    folder = ckpt_dir(root / "r" / "checkpoint-3", 1000, age=90 * DAY)
    os.link(original, folder / "shared.pt")  # a hard link inside a doomed folder
    os.utime(folder, (time.time() - 90 * DAY, time.time() - 90 * DAY))

    res = clean([root], params(keep_last=0, older_than="1d"))

    assert sorted(res["deleted"]) == sorted(map(str, (linked, plain, folder)))
    assert not linked.exists() and not folder.exists() and not plain.exists()
    assert res["bytes_freed"] == 300 + 1000  # the 5000 bytes still live in precious/model.pt
    assert original.read_bytes() == b"x" * 5000 and original.stat().st_nlink == 1


def test_hard_links_that_all_go_free_their_data_once(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    first = ckpt_dir(root / "r" / "checkpoint-1", 1000, age=30 * DAY)
    second = root / "r" / "checkpoint-2"
    second.mkdir()
    for name in ("model.safetensors", "optimizer.pt"):  # a checkpoint that shares its files with the one before
        os.link(first / name, second / name)
    os.link(first / "model.safetensors", first / "model-copy.safetensors")
    for folder in (first, second):
        os.utime(folder, (time.time() - 29 * DAY, time.time() - 29 * DAY))

    dry = clean([root], params(keep_last=0, older_than="1d"), dry_run=True)
    assert dry["bytes_would_free"] == 1000
    res = clean([root], params(keep_last=0, older_than="1d"))
    assert sorted(res["deleted"]) == [str(first), str(second)] and not (root / "r" / "checkpoint-1").exists()
    assert res["bytes_freed"] == 1000


def test_the_byte_cap_counts_what_would_really_be_freed(tmp_path: Path) -> None:
    root, outside = tmp_path / "runs", tmp_path / "precious"
    original = put(outside / "model.pt", 5000, age=90 * DAY)
    linked = root / "r" / "ckpt-0.pt"
    linked.parent.mkdir(parents=True)
    os.link(original, linked)  # the oldest: frees nothing, so it costs nothing of the cap
    own = [put(root / "r" / f"ckpt-{i}.pt", 1000, age=(30 - i) * DAY) for i in (1, 2, 3)]
    res = clean([root], params(keep_last=0, older_than="1d", max_bytes=2500))
    assert res["deleted"] == [str(linked), str(own[0]), str(own[1])]
    assert res["bytes_freed"] == 2000 and res["over_cap"] == 1
    assert original.exists() and own[2].exists()


def test_protect_extends_the_defaults(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    mine = put(root / "r" / "keep-this.pt", age=20 * DAY)
    best = put(root / "r" / "best-so-far.pt", age=20 * DAY)
    gone = put(root / "r" / "ckpt-1.pt", age=20 * DAY)
    p = params(keep_last=0, older_than="7d", protect=["keep-*"])
    assert p.protected[:7] == ("best*", "*final*", "*.json", "*.yaml", "*.yml", "*.md", "*.txt")
    res = clean([root], p)
    assert res["deleted"] == [str(gone)] and mine.exists() and best.exists()


@pytest.mark.parametrize("protect", [["../x"], ["a/b"], [""], "best*"])
def test_protect_names_entries_never_paths(protect: Any) -> None:
    with pytest.raises(ParamError):
        CATALOGUE["disk_cleanup"].parse({"protect": protect})


# -- allow-roots are checked and pinned once, when the agent starts


def test_an_allow_root_that_is_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.raises(ValueError, match="is a link; name the folder itself"):
        disk.pin_roots([tmp_path / "link"])


def test_an_allow_root_below_a_folder_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "runs").mkdir(parents=True)
    shared.chmod(0o777)  # anyone may rename runs/ and put a link in its place
    with pytest.raises(ValueError, match=f"{shared} is writable by other users"):
        disk.pin_roots([shared / "runs"])
    shared.chmod(0o1777)  # sticky, like /tmp: others may not rename what we own
    [root] = disk.pin_roots([shared / "runs"])
    os.close(root.fd)


def test_a_root_swapped_for_a_link_after_the_start_changes_nothing(tmp_path: Path) -> None:
    data, victim = tmp_path / "data", tmp_path / "victim"
    old = put(data / "r" / "old.pt", age=20 * DAY)
    precious = put(victim / "r" / "old.pt", age=20 * DAY)
    pinned = disk.pin_roots([data])
    data.rename(tmp_path / "moved")  # someone swaps the path for a link to another folder
    data.symlink_to(victim, target_is_directory=True)
    try:
        res = disk.cleanup(pinned, params(keep_last=0, older_than="7d"))
    finally:
        os.close(pinned[0].fd)
    assert res["deleted"] == [str(old)]  # reported by the path it had when pinned
    assert precious.exists() and not (tmp_path / "moved" / "r" / "old.pt").exists()


# ---------------------------------------------------------------- the newest whole checkpoint of a run

def whole_run(root: Path, layout: str) -> list[Path]:
    """Six checkpoints of one run, each with its manifest (as the callbacks and checkpoints.save write them),
    20 down to 15 days old; the three newest then broken: cut short, a file gone, a manifest that is not one."""
    made = []
    for i, step in enumerate(range(10, 70, 10)):
        age = (20 - i) * DAY
        if layout == "folder":
            path = ckpt_dir(root / f"checkpoint-{step}", 1000, age)
        else:
            path = put(root / f"step={step}.ckpt", 1000, age)
        manifest.write(str(path), manifest.describe(str(path), step, {"saved_at": time.time() - age}))
        made.append(path)
    newest, second, third = made[-1], made[-2], made[-3]
    os.truncate(newest / "model.safetensors" if layout == "folder" else newest, 10)
    if layout == "folder":
        (second / "optimizer.pt").unlink()
    else:
        Path(manifest.location(str(second))[0]).unlink()  # no manifest: nothing says it is whole
    Path(manifest.location(str(third))[0]).write_text("{not json")
    for p in made:  # the damage happened when they were written, as a crash leaves it
        for q in [p, *p.rglob("*")] + [Path(manifest.location(str(p))[0])]:
            if q.exists():
                os.utime(q, (time.time() - (20 - made.index(p)) * DAY,) * 2)
    return made


def gone(res: dict) -> list[str]:
    """What a cleanup took: deleted, or pruned down to its protected files (a folder keeps its manifest)."""
    return sorted(res["deleted"] + [p["path"] for p in res["pruned"]])


def data_left(path: Path) -> bool:
    return path.is_file() or (path / "model.safetensors").exists()


@pytest.mark.parametrize("layout", ["folder", "file"])
def test_the_newest_whole_checkpoint_stays_when_the_three_newer_ones_are_broken(tmp_path: Path, layout: str) -> None:
    root = tmp_path / "runs"
    made = whole_run(root / "llama", layout)
    res = clean([root], params(keep_last=3, older_than="7d"))
    assert gone(res) == sorted(map(str, made[:2]))
    assert [data_left(p) for p in made] == [False, False, True, True, True, True]
    good = made[2]
    assert all(f.exists() for f in ([good, *good.iterdir()] if good.is_dir() else [good]))
    assert {"path": str(good), "reason": disk.WHOLE} in res["left_alone"] and res["kept"] == 4

    # Whatever keep_last says: with 0, everything else old enough goes, and it still stays.
    res = clean([root], params(keep_last=0, older_than="7d"))
    assert str(good) not in gone(res) and set(map(str, made[3:])) <= set(gone(res))
    assert data_left(good) and {"path": str(good), "reason": disk.WHOLE} in res["left_alone"]


def test_without_manifests_keep_last_alone_decides_as_before(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    made = [ckpt_dir(root / "r" / f"checkpoint-{s}", age=(20 - s) * DAY) for s in range(1, 5)]
    res = clean([root], params(keep_last=1, older_than="7d"))
    assert gone(res) == sorted(map(str, made[:3])) and res["left_alone"] == []


def test_the_agent_keeps_the_last_good_checkpoint_of_a_run_whose_newest_are_broken(
        agents, http, r, tmp_path: Path) -> None:
    root = tmp_path / "data" / "runs"
    made = whole_run(root / "llama", "folder")
    agents("gpu-node-9", allow_roots=[root]).wait_ready(r)
    resp = post_json(http, "/webhook", disk_alert("gpu-node-9", "d15c000000000009"))  # keep_last: 3
    rec = wait_record(r, resp.get_json()["remediations"][0]["id"])
    res = rec["actions"][0]["result"]
    assert rec["status"] == "applied", rec
    assert gone(res) == sorted(map(str, made[:2]))
    assert {"path": str(made[2]), "reason": disk.WHOLE} in res["left_alone"]
    assert (made[2] / "model.safetensors").exists() and (made[2] / "optimizer.pt").exists()
