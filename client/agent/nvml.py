"""GPU power limits through NVIDIA's pynvml: lower, remember the original (state file and Redis), restore."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import redis

from ..receiver.applier import ActionFailed, ActionSkipped
from ..wire import keys
from ..wire.actions import PowerLimit
from .state import NodeState

log = logging.getLogger("trainmedic.agent")

POWER_COPY_TTL_MS = 30 * 86400 * 1000


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML names it."""

    index: int
    uuid: str
    name: str

    def as_dict(self) -> dict[str, Any]:
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

    def __enter__(self) -> Nvml:
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

    def find(self, context: dict[str, Any]) -> tuple[Any, Gpu]:
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
        idx: Any = index if not uuid else self._call("read the GPU's index", nv.nvmlDeviceGetIndex, handle)
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


def inventory() -> tuple[list[dict[str, Any]], str | None]:
    """This node's GPUs for the heartbeat, or an empty list and why."""
    try:
        with Nvml() as nvml:
            return [g.as_dict() for g in nvml.gpus()], None
    except ActionFailed as exc:
        return [], exc.message


class PowerLimiter:
    """power_limit and restore_power_limit for one node.

    The limit from before trainmedic's first throttle of a GPU is kept in the node's state file (the truth:
    Redis may lose it, and a second throttle must never take a throttled limit for the original) and copied
    into Redis for people to see.
    """

    def __init__(self, node: str, redis_client: Callable[[], redis.Redis], state: NodeState):
        self.node = node
        self.redis = redis_client
        self.state = state

    def _mirror(self, op: str, *args: Any) -> None:
        key = keys.power_memory(self.node)
        try:
            r = self.redis()
            getattr(r, op)(key, *args)
            # A copy for people to see, bounded in age like every key trainmedic writes (a node that is gone
            # leaves nothing behind for ever); each change refreshes it.
            r.pexpire(key, POWER_COPY_TTL_MS)
        except redis.RedisError:
            log.warning("could not update the copy of the remembered power limits in Redis (%s)", op)

    def throttle(self, params: PowerLimit, context: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Lower the alert's GPU to `watts` or `fraction` of its default, within its constraints."""
        with Nvml() as nvml:
            handle, gpu = nvml.find(context)
            state = nvml.power(handle)
            wanted = (int(params.watts * 1000) if params.watts is not None
                      else int(round((params.fraction or 1.0) * state.default_mw)))
            floor = int((params.floor_watts or 0) * 1000)
            new = state.clamp(wanted, floor)
            original = self.state.power.get(gpu.uuid, state.current_mw)
            result = {"gpu": gpu.as_dict(), "old_watts": _watts(state.current_mw), "requested_watts": _watts(wanted),
                      "new_watts": _watts(new), "min_watts": _watts(state.min_mw), "max_watts": _watts(state.max_mw),
                      "default_watts": _watts(state.default_mw), "remembered_watts": _watts(original)}
            if new != wanted:
                result["clamped_to"] = ("floor_watts" if new == floor and floor > state.min_mw
                                        else "min" if new == state.min_mw else "max")
            if dry_run:
                raise ActionSkipped("dry_run", "The agent runs with --dry-run, so nothing was changed.", dry_run=True,
                                    **result)
            fresh = gpu.uuid not in self.state.power
            if fresh:
                # Written before the change: a crash in between leaves the original known, never lost.
                self.state.set("power", gpu.uuid, state.current_mw)
            try:
                nvml.set_limit(handle, new)
            except ActionFailed:
                if fresh:
                    self.state.forget("power", gpu.uuid)
                raise
            self._mirror("hset", gpu.uuid, original)
            log.info("power limit of GPU %s (%s) set from %sW to %sW", gpu.index, gpu.uuid, result["old_watts"],
                     result["new_watts"])
            return result

    def restore(self, context: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Put back the limit from before trainmedic's first throttle."""
        with Nvml() as nvml:
            handle, gpu = nvml.find(context)
            original = self.state.power.get(gpu.uuid)
            if original is None:
                raise ActionSkipped("nothing_to_restore", "Trainmedic has not lowered this GPU's power limit, so "
                                    "there is nothing to restore.", gpu=gpu.as_dict())
            state = nvml.power(handle)
            target = state.clamp(int(original))
            result = {"gpu": gpu.as_dict(), "old_watts": _watts(state.current_mw), "new_watts": _watts(target),
                      "remembered_watts": _watts(int(original))}
            if dry_run:
                raise ActionSkipped("dry_run", "The agent runs with --dry-run, so nothing was changed.", dry_run=True,
                                    **result)
            nvml.set_limit(handle, target)
            self.state.forget("power", gpu.uuid)
            self._mirror("hdel", gpu.uuid)
            log.info("power limit of GPU %s (%s) restored to %sW", gpu.index, gpu.uuid, result["new_watts"])
            return result
