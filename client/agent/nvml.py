"""GPU power limits through NVIDIA's pynvml: lower, remember the original in Redis, restore."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import redis

from trainmedic.client.wire import keys
from trainmedic.client.wire.actions import PowerLimit

from trainmedic.client.receiver.outcome import ActionFailed, ActionSkipped

log = logging.getLogger("trainmedic.agent")


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML names it."""

    index: int
    uuid: str
    name: str

    def as_dict(self) -> dict:
        return {"index": self.index, "uuid": self.uuid, "name": self.name}


@dataclass(frozen=True)
class PowerState:
    """A GPU's power limits in milliwatts."""

    min_mw: int
    max_mw: int
    default_mw: int
    current_mw: int

    def clamp(self, mw: int, floor_mw: int = 0) -> int:
        # The device's constraints win over the playbook's floor: NVML refuses anything outside them.
        return int(min(self.max_mw, max(self.min_mw, floor_mw, mw)))


def _watts(mw: int) -> float:
    return round(mw / 1000.0, 3)


def _pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise ActionFailed("The nvidia-ml-py package (module pynvml) is not installed on this node.") from None
    return pynvml


def describe(exc: Exception, doing: str) -> str:
    """One sentence for an NVML error raised while `doing` something."""
    nv = _pynvml()
    known = [
        ("NVMLError_LibraryNotFound",
         "the NVML library libnvidia-ml.so.1 was not found (is the NVIDIA driver installed?)"),
        ("NVMLError_DriverNotLoaded", "the NVIDIA driver is not loaded"),
        ("NVMLError_NoPermission", "NVML denied permission (the agent must run as root to change power limits)"),
        ("NVMLError_NotSupported", "this GPU does not support it"),
        ("NVMLError_InvalidArgument", "NVML rejected the argument"),
        ("NVMLError_NotFound", "NVML found no such GPU"),
        ("NVMLError_GpuIsLost", "the GPU has fallen off the bus"),
        ("NVMLError_Uninitialized", "NVML is not initialised"),
    ]
    for name, words in known:
        cls = getattr(nv, name, None)
        if cls is not None and isinstance(exc, cls):
            return f"Could not {doing}: {words}."
    return f"Could not {doing}: NVML error {exc}."


class Nvml:
    """An NVML session (init on enter, shutdown on exit) whose errors become ActionFailed."""

    def __init__(self) -> None:
        self.nv = _pynvml()

    def __enter__(self) -> "Nvml":
        self._call("initialise NVML", self.nv.nvmlInit)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:  # a failed shutdown changes nothing for the action's outcome
            pass

    def _call(self, doing: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            raise ActionFailed(describe(exc, doing), nvml_error=str(exc)) from None

    def gpus(self) -> list[Gpu]:
        """Every GPU of this node."""
        return [self._gpu(self._call("find GPUs", self.nv.nvmlDeviceGetHandleByIndex, i), i)
                for i in range(self._call("count GPUs", self.nv.nvmlDeviceGetCount))]

    def _gpu(self, handle: Any, index: int) -> Gpu:
        return Gpu(index, self._call("read the GPU's UUID", self.nv.nvmlDeviceGetUUID, handle),
                   self._call("read the GPU's name", self.nv.nvmlDeviceGetName, handle))

    def find(self, context: dict) -> tuple[Any, Gpu]:
        """The handle and identity of the GPU named by the alert's gpu_uuid, else its gpu_id."""
        nv = self.nv
        uuid, index = context.get("gpu_uuid"), context.get("gpu_id")
        try:
            if uuid:
                handle = nv.nvmlDeviceGetHandleByUUID(str(uuid))
            elif index is not None:
                handle = nv.nvmlDeviceGetHandleByIndex(int(index))
            else:
                raise ActionFailed("The alert has no gpu_id or gpu_uuid label, so no GPU was chosen.")
        except (nv.NVMLError_InvalidArgument, nv.NVMLError_NotFound):
            which = f"UUID {uuid}" if uuid else f"index {index}"
            raise ActionFailed(f"There is no GPU with {which} on this node.") from None
        except nv.NVMLError as exc:
            raise ActionFailed(describe(exc, "find the GPU"), nvml_error=str(exc)) from None
        idx = index if not uuid else self._call("read the GPU's index", nv.nvmlDeviceGetIndex, handle)
        return handle, Gpu(int(idx), self._call("read the GPU's UUID", nv.nvmlDeviceGetUUID, handle),
                           self._call("read the GPU's name", nv.nvmlDeviceGetName, handle))

    def power(self, handle: Any) -> PowerState:
        """The GPU's power constraints, default and current limit."""
        nv = self.nv
        lo, hi = self._call("read the power limit constraints", nv.nvmlDeviceGetPowerManagementLimitConstraints, handle)
        default = self._call("read the default power limit", nv.nvmlDeviceGetPowerManagementDefaultLimit, handle)
        current = self._call("read the power limit", nv.nvmlDeviceGetPowerManagementLimit, handle)
        return PowerState(int(lo), int(hi), int(default), int(current))

    def set_limit(self, handle: Any, mw: int) -> None:
        self._call("set the power limit", self.nv.nvmlDeviceSetPowerManagementLimit, handle, int(mw))


def inventory() -> tuple[list[dict], str | None]:
    """This node's GPUs for the heartbeat, or an empty list and why."""
    try:
        with Nvml() as nvml:
            return [g.as_dict() for g in nvml.gpus()], None
    except ActionFailed as exc:
        return [], exc.reason


class PowerLimiter:
    """power_limit and restore_power_limit for one node; the original limit is kept in Redis per GPU."""

    def __init__(self, node: str, redis_client: Callable[[], redis.Redis]):
        self.node = node
        self.redis = redis_client

    def _memory(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self.redis(), op)(keys.power_memory(self.node), *args)
        except redis.RedisError:
            raise ActionFailed("Redis is unavailable, so the original power limit could not be "
                               "remembered or read; the limit was left unchanged.") from None

    def throttle(self, params: PowerLimit, context: dict, dry_run: bool = False) -> dict:
        """Lower the alert's GPU to `watts` or `fraction` of its default, within its constraints."""
        with Nvml() as nvml:
            handle, gpu = nvml.find(context)
            state = nvml.power(handle)
            wanted = (int(params.watts * 1000) if params.watts is not None
                      else int(round(params.fraction * state.default_mw)))
            floor = int((params.floor_watts or 0) * 1000)
            new = state.clamp(wanted, floor)
            result = {"gpu": gpu.as_dict(), "old_watts": _watts(state.current_mw), "requested_watts": _watts(wanted),
                      "new_watts": _watts(new), "min_watts": _watts(state.min_mw), "max_watts": _watts(state.max_mw),
                      "default_watts": _watts(state.default_mw)}
            if new != wanted:
                result["clamped_to"] = ("floor_watts" if new == floor and floor > state.min_mw
                                        else "min" if new == state.min_mw else "max")
            if dry_run:
                raise ActionSkipped({"dry_run": True, "reason": "the agent runs with --dry-run", **result})
            # HSETNX: a second throttle while throttled must not overwrite the limit from before the first.
            fresh = self._memory("hsetnx", gpu.uuid, state.current_mw)
            try:
                nvml.set_limit(handle, new)
            except ActionFailed:
                if fresh:
                    self._forget(gpu.uuid)
                raise
            remembered = int(self._memory("hget", gpu.uuid) or state.current_mw)
            result["remembered_watts"] = _watts(remembered)
            log.info("power limit of GPU %s (%s) set from %sW to %sW", gpu.index, gpu.uuid, result["old_watts"],
                     result["new_watts"])
            return result

    def restore(self, context: dict, dry_run: bool = False) -> dict:
        """Put back the limit remembered before trainmedic lowered it."""
        with Nvml() as nvml:
            handle, gpu = nvml.find(context)
            raw = self._memory("hget", gpu.uuid)
            if raw is None:
                raise ActionSkipped({"gpu": gpu.as_dict(), "reason": "trainmedic has not lowered this GPU's "
                                     "power limit, so there is nothing to restore"})
            state = nvml.power(handle)
            target = state.clamp(int(raw))
            result = {"gpu": gpu.as_dict(), "old_watts": _watts(state.current_mw), "new_watts": _watts(target),
                      "remembered_watts": _watts(int(raw))}
            if dry_run:
                raise ActionSkipped({"dry_run": True, "reason": "the agent runs with --dry-run", **result})
            nvml.set_limit(handle, target)
            self._forget(gpu.uuid)
            log.info("power limit of GPU %s (%s) restored to %sW", gpu.index, gpu.uuid, result["new_watts"])
            return result

    def _forget(self, uuid: str) -> None:
        try:
            self.redis().hdel(keys.power_memory(self.node), uuid)
        except redis.RedisError:
            log.warning("could not forget the remembered power limit of %s; a later restore will reapply it", uuid)
