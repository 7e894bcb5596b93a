"""power_limit / restore_power_limit end to end: webhook -> Redis -> agent subprocess -> real pynvml -> C stand-in."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from trainmedic.client.wire import keys

from tests.conftest import post_json, write_playbooks
from tests.support.nvml import NO_PERMISSION, NOT_SUPPORTED, FakeGpu, wait_record

NODE = "gpu-node-1"
GPU0 = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
GPU1 = "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"

PLAYBOOKS = """
playbooks:
  - name: gpu-hot
    matchers: ['alertname="GPUTemperatureHigh"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    on_resolved: [{restore_power_limit: {}}]
  - name: gpu-hotter
    matchers: ['alertname="GPUTemperatureCritical"']
    target: node
    actions: [{power_limit: {watts: 400}}]
    on_resolved: [{restore_power_limit: {}}]
  - name: gpu-too-low
    matchers: ['alertname="GPUClampMin"']
    target: node
    actions: [{power_limit: {watts: 50}}]
  - name: gpu-too-high
    matchers: ['alertname="GPUClampMax"']
    target: node
    actions: [{power_limit: {watts: 5000}}]
  - name: gpu-floor
    matchers: ['alertname="GPUFloor"']
    target: node
    actions: [{power_limit: {fraction: 0.1, floor_watts: 300}}]
"""

_fp = itertools.count(1)


def alert(alertname: str, status: str = "firing", fingerprint: str | None = None, **labels: str) -> dict:
    fp = fingerprint or f"{next(_fp):016x}"
    a = {"status": status, "labels": {"alertname": alertname, "node": NODE, **labels}, "annotations": {},
         "startsAt": "2026-11-22T01:25:24.115697517Z",
         "endsAt": "2026-11-22T02:25:24Z" if status == "resolved" else "0001-01-01T00:00:00Z",
         "generatorURL": "", "fingerprint": fp}
    return {"receiver": "trainmedic", "status": status, "alerts": [a], "groupLabels": {}, "commonLabels": {},
            "commonAnnotations": {}, "externalURL": "http://am", "version": "4", "groupKey": "{}:{}",
            "truncatedAlerts": 0}


@pytest.fixture
def http(make_app: Any, tmp_path: Path) -> Any:
    return make_app(playbooks=str(write_playbooks(tmp_path / "pb.yaml", PLAYBOOKS))).test_client()


def fire(http: Any, r: Any, body: dict) -> dict:
    """Post an alert; wait for the agent's ack; the record."""
    resp = post_json(http, "/webhook", body)
    assert resp.status_code == 200, resp.get_json()
    rems = resp.get_json()["remediations"]
    assert len(rems) == 1 and rems[0]["status"] == "dispatched", rems
    return wait_record(r, rems[0]["id"])


def remembered(r: Any) -> dict:
    return r.hgetall(keys.power_memory(NODE))


@pytest.fixture
def agent(agents: Any, nvml_lib: Path, nvml_state: Any, r: Any) -> Any:
    a = agents(NODE, lib_dir=nvml_lib, state=nvml_state)
    a.wait_ready(r)
    return a


def test_the_agent_lowers_the_alerting_gpu_to_a_fraction_of_its_default(agent, http, r, nvml_state) -> None:
    rec = fire(http, r, alert("GPUTemperatureHigh", gpu_id="0"))
    act = rec["actions"][0]
    assert rec["status"] == "applied", rec
    assert act["result"]["old_watts"] == 700 and act["result"]["new_watts"] == 560
    assert act["result"]["gpu"]["uuid"] == GPU0
    assert nvml_state.limit_w(0) == 560
    assert nvml_state.limit_w(1) == 650  # the other GPU is untouched
    assert remembered(r) == {GPU0: "700000"}
    assert act["acked_by"].endswith(f":{agent.proc.pid}")


def test_it_chooses_the_gpu_by_uuid(agent, http, r, nvml_state) -> None:
    rec = fire(http, r, alert("GPUTemperatureCritical", gpu_uuid=GPU1))
    assert rec["status"] == "applied", rec
    assert rec["actions"][0]["result"]["gpu"]["index"] == 1
    assert nvml_state.limit_w(1) == 400 and nvml_state.limit_w(0) == 700


def test_it_clamps_to_the_device_minimum(agent, http, r, nvml_state) -> None:
    rec = fire(http, r, alert("GPUClampMin", gpu_id="0"))
    res = rec["actions"][0]["result"]
    assert rec["status"] == "applied", rec
    assert (res["requested_watts"], res["new_watts"], res["clamped_to"]) == (50, 200, "min")
    assert nvml_state.limit_w(0) == 200


def test_it_clamps_to_the_device_maximum(agent, http, r, nvml_state) -> None:
    nvml_state.write([FakeGpu(0, GPU0, current_mw=300_000)])
    rec = fire(http, r, alert("GPUClampMax", gpu_id="0"))
    assert rec["actions"][0]["result"]["clamped_to"] == "max"
    assert nvml_state.limit_w(0) == 700


def test_floor_watts_holds_a_fraction_up(agent, http, r, nvml_state) -> None:
    rec = fire(http, r, alert("GPUFloor", gpu_id="0"))
    res = rec["actions"][0]["result"]
    assert (res["requested_watts"], res["new_watts"], res["clamped_to"]) == (70, 300, "floor_watts")
    assert nvml_state.limit_w(0) == 300


def test_resolve_restores_the_previous_limit_not_the_default(agent, http, r, nvml_state) -> None:
    fire(http, r, alert("GPUTemperatureHigh", fingerprint="00000000000000a1", gpu_id="1"))
    assert nvml_state.limit_w(1) == 560
    rec = fire(http, r, alert("GPUTemperatureHigh", "resolved", fingerprint="00000000000000a1", gpu_id="1"))
    assert rec["actions"][0]["action"] == "restore_power_limit"
    assert rec["status"] == "applied", rec
    assert nvml_state.limit_w(1) == 650  # what it was, not the 700 W default
    assert remembered(r) == {}


def test_restore_works_after_the_agent_restarts(agents, nvml_lib, nvml_state, http, r) -> None:
    first = agents(NODE, lib_dir=nvml_lib, state=nvml_state)
    first.wait_ready(r)
    fire(http, r, alert("GPUTemperatureHigh", fingerprint="00000000000000b2", gpu_id="1"))
    assert first.stop() == 0
    second = agents(NODE, lib_dir=nvml_lib, state=nvml_state)
    second.wait_ready(r)
    rec = fire(http, r, alert("GPUTemperatureHigh", "resolved", fingerprint="00000000000000b2", gpu_id="1"))
    assert rec["actions"][0]["acked_by"].endswith(f":{second.proc.pid}")
    assert nvml_state.limit_w(1) == 650


def test_a_second_throttle_keeps_the_original_limit_for_the_restore(agent, http, r, nvml_state) -> None:
    fire(http, r, alert("GPUTemperatureHigh", fingerprint="00000000000000c1", gpu_id="1"))  # 650 -> 560
    rec = fire(http, r, alert("GPUTemperatureCritical", fingerprint="00000000000000c2", gpu_id="1"))  # -> 400
    assert rec["actions"][0]["result"]["old_watts"] == 560
    assert rec["actions"][0]["result"]["remembered_watts"] == 650
    assert nvml_state.limit_w(1) == 400 and remembered(r) == {GPU1: "650000"}
    fire(http, r, alert("GPUTemperatureCritical", "resolved", fingerprint="00000000000000c2", gpu_id="1"))
    assert nvml_state.limit_w(1) == 650
    # The other episode's restore then finds nothing remembered and changes nothing.
    rec = fire(http, r, alert("GPUTemperatureHigh", "resolved", fingerprint="00000000000000c1", gpu_id="1"))
    assert rec["actions"][0]["status"] == "skipped"
    assert rec["actions"][0]["reason"] == "nothing_to_restore"
    assert "nothing to restore" in rec["actions"][0]["result"]["message"]
    assert nvml_state.limit_w(1) == 650


def one_sentence(reason: str) -> bool:
    return reason.endswith(".") and reason.count(". ") == 0 and "\n" not in reason and len(reason) < 200


@pytest.mark.parametrize("labels, fails, words", [
    ({"gpu_id": "7"}, {}, "There is no GPU with index 7 on this node."),
    ({"gpu_uuid": "GPU-00000000-dead-beef-0000-000000000000"}, {},
     "There is no GPU with UUID GPU-00000000-dead-beef-0000-000000000000 on this node."),
    ({}, {}, "The alert has no gpu_id or gpu_uuid label, so no GPU was chosen."),
    ({"gpu_id": "0"}, {"set": NO_PERMISSION}, "Could not set the power limit: NVML denied permission"),
    ({"gpu_id": "0"}, {"constraints": NOT_SUPPORTED},
     "Could not read the power limit constraints: this GPU does not support it."),
    ({"gpu_id": "0"}, {"set": NOT_SUPPORTED}, "Could not set the power limit: this GPU does not support it."),
    ({"gpu_id": "0"}, {"init": 9}, "Could not initialise NVML: the NVIDIA driver is not loaded."),
])
def test_every_nvml_error_is_a_failed_action_with_one_sentence(agent, http, r, nvml_state, labels, fails,
                                                               words) -> None:
    nvml_state.fail(**fails)
    rec = fire(http, r, alert("GPUTemperatureHigh", **labels))
    act = rec["actions"][0]
    assert (rec["status"], act["status"]) == ("failed", "failed"), rec
    assert act["result"]["error"].startswith(words), act["result"]
    assert one_sentence(act["result"]["error"]), act["result"]["error"]
    assert nvml_state.limit_w(0) == 700
    # Nothing remembered for a throttle that did not happen, so a later restore changes nothing.
    assert remembered(r) == {}
    # The agent is still up and applies the next command once NVML behaves.
    assert agent.proc.poll() is None
    nvml_state.fail()
    assert fire(http, r, alert("GPUTemperatureHigh", gpu_id="0"))["status"] == "applied"
    assert nvml_state.limit_w(0) == 560


def test_a_node_without_the_nvml_library_fails_the_action_and_keeps_running(agents, http, r) -> None:
    agent = agents(NODE)  # LD_LIBRARY_PATH without libnvidia-ml.so.1
    info = agent.wait_ready(r)
    assert info["gpus"] == [] and "libnvidia-ml.so.1 was not found" in info["nvml"]
    rec = fire(http, r, alert("GPUTemperatureHigh", gpu_id="0"))
    reason = rec["actions"][0]["result"]["error"]
    assert rec["status"] == "failed"
    assert reason == ("Could not initialise NVML: the NVML library libnvidia-ml.so.1 was not found "
                      "(is the NVIDIA driver installed?).")
    rec = fire(http, r, alert("GPUTemperatureHigh", "resolved", fingerprint=rec["alert"]["fingerprint"],
                              gpu_id="0"))
    assert rec["status"] == "failed" and agent.proc.poll() is None


def test_a_dry_run_agent_says_what_it_would_set_and_sets_nothing(agents, nvml_lib, nvml_state, http, r) -> None:
    agents(NODE, lib_dir=nvml_lib, state=nvml_state, dry_run=True).wait_ready(r)
    rec = fire(http, r, alert("GPUTemperatureHigh", gpu_id="0"))
    act = rec["actions"][0]
    assert rec["status"] == "skipped"  # every action had nothing to do: not a failure
    assert act["status"] == "skipped" and act["result"]["dry_run"] is True
    assert act["result"]["new_watts"] == 560
    assert nvml_state.limit_w(0) == 700 and remembered(r) == {}
