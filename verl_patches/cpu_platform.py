"""A CPU platform for verl's `PlatformRegistry` (patch 1 of ARCHITECTURE.md).

verl 0.9.1 falls back to the "nvidia" platform when no accelerator is found, so its
workers ask for `cuda` devices and `nccl` on a CPU machine. This platform names the
device `cpu`, the collective backend `gloo` and the Ray resource `CPU`; its memory and
RNG calls are harmless no-ops or CPU equivalents.

It never auto-detects (`is_platform_available` is False): verl picks it only when
`VERL_PLATFORM=cpu` is set, which the async pipeline does for `trainer.device=cpu`.
Without the flag verl behaves as if this package were absent.
"""

from __future__ import annotations

import contextlib
import time
import types

import torch

CPU_PLATFORM_NAME = "cpu"


def _none(*_args, **_kwargs) -> None:
    return None


def _returns(value):
    """A function of any arguments returning ``value`` (a fresh copy of a dict or list)."""
    return lambda *_args, **_kwargs: value.copy() if isinstance(value, (dict, list)) else value


_zero = _returns(0)


def _mem_get_info(_device=None) -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


class _WallClockEvent:
    """verl's timers create device events; wall time is enough on CPU (torch.cpu.Event has no timing)."""

    def __init__(self, enable_timing: bool = False):
        self._t = None

    def record(self, *_args, **_kwargs):
        self._t = time.perf_counter()

    def elapsed_time(self, other) -> float:
        """Milliseconds from this event to ``other``."""
        return (other._t - self._t) * 1000.0

    synchronize = _none


# stands in for `torch.cuda` where verl calls memory/RNG helpers on its device module
_CPU_DEVICE_MODULE = types.SimpleNamespace(
    is_available=torch.cpu.is_available, current_device=torch.cpu.current_device,
    device_count=torch.cpu.device_count, set_device=_none, synchronize=_none, empty_cache=_none,
    manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
    get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
    memory_allocated=_zero, memory_reserved=_zero, max_memory_allocated=_zero, max_memory_reserved=_zero,
    reset_peak_memory_stats=_none, mem_get_info=_mem_get_info, get_device_name=lambda _device=None: "cpu",
    get_device_properties=lambda _device=None: types.SimpleNamespace(name="cpu", total_memory=0),
    Event=_WallClockEvent,
)


def make_cpu_platform_class():
    """Build and register the CPU platform class (imports verl lazily)."""
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    existing = PlatformRegistry.get(CPU_PLATFORM_NAME)
    if existing is not None and existing.__name__ == "PlatformCPU":
        return existing

    class PlatformCPU(PlatformBase):
        device_name = vendor_name = property(_returns("cpu"))
        device_module = property(_returns(_CPU_DEVICE_MODULE))
        is_available = _returns(True)
        is_platform_available = _returns(False)  # chosen only explicitly, through VERL_PLATFORM=cpu
        current_device = _returns("cpu")  # verl passes it to `.to(...)`; an int would mean an accelerator
        device_count = _returns(1)
        set_device = synchronize = set_allocator_settings = empty_cache = _none
        profiler_start = profiler_stop = cudart = _none
        manual_seed = manual_seed_all = staticmethod(torch.manual_seed)
        get_device_capability = _returns((None, None))
        communication_backend_name = _returns("gloo")
        visible_devices_envvar = _returns("CUDA_VISIBLE_DEVICES")
        ray_resource_name = _returns("CPU")
        ray_resource_options = _returns({})
        ray_noset_envvars = _returns([])
        is_ipc_supported = _returns(False)

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

    PlatformRegistry.register(platform=CPU_PLATFORM_NAME)(PlatformCPU)
    return PlatformCPU
