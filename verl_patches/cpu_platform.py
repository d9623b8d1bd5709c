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
import types
from typing import Any, Optional

import torch

CPU_PLATFORM_NAME = "cpu"


class _CPUDeviceModule(types.SimpleNamespace):
    """Stands in for `torch.cuda` where verl calls memory/RNG helpers on its device module."""

    def __init__(self):
        super().__init__()

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(_index) -> None:
        return None

    @staticmethod
    def synchronize(_index=None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state():
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def memory_allocated(_device=None) -> int:
        return 0

    @staticmethod
    def memory_reserved(_device=None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(_device=None) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(_device=None) -> int:
        return 0

    @staticmethod
    def reset_peak_memory_stats(_device=None) -> None:
        return None

    @staticmethod
    def mem_get_info(_device=None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def get_device_name(_device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(_device=None):
        return types.SimpleNamespace(name="cpu", total_memory=0)

    class Event:  # verl's timers create device events; wall time is enough on CPU
        def __init__(self, enable_timing: bool = False):
            self._t = None

        def record(self, *_a, **_k):
            import time

            self._t = time.perf_counter()

        def elapsed_time(self, other) -> float:
            return (other._t - self._t) * 1000.0

        def synchronize(self):
            return None


def make_cpu_platform_class():
    """Build and register the CPU platform class (imports verl lazily)."""
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    existing = PlatformRegistry.get(CPU_PLATFORM_NAME)
    if existing is not None and existing.__name__ == "PlatformCPU":
        return existing

    device_module = _CPUDeviceModule()

    class PlatformCPU(PlatformBase):
        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self):
            return device_module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check=False) -> bool:
            return False  # chosen only explicitly, through VERL_PLATFORM=cpu

        def current_device(self) -> str:
            # verl passes this to `.to(...)`/`to_empty(device=...)`; an int means an accelerator.
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: Optional[int] = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    PlatformRegistry.register(platform=CPU_PLATFORM_NAME)(PlatformCPU)
    return PlatformCPU
