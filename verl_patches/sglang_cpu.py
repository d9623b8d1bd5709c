"""What verl 0.9.1's own SGLang rollout needs on CPU with SGLang's CPU build (docs/sglang_cpu.md).

SGLang's CPU kernels are published as the distribution `sglang-kernel-cpu` (module `sgl_kernel`),
built from SGLang's source (`scripts/setup.sh --sglang-cpu`). verl's `SGLangHttpServer` builds
SGLang's `ServerArgs` for a GPU: `enable_memory_saver=True` (CUDA only), `attention_backend=
"flashinfer"` for sglang >= 0.5.12, `mem_fraction_static=gpu_memory_utilization` (on CPU a share of
host RAM: verl's 0.5 reserves half of it for the KV cache) and no `device`. verl merges
`rollout.engine_kwargs.sglang` last into those arguments, so on CPU these are verl's own key, set
for the user with a printed line (`cpu_rollout_overrides`), not a patch:

- `device=cpu`, `disable_overlap_schedule=True` (SGLang's CPU backend runs without the overlap
  scheduler), `enable_memory_saver=False`;
- `attention_backend=torch_native`: SGLang 0.5.12 finds AMX through
  `torch._C._cpu._is_amx_tile_supported`, which torch 2.11 no longer has, and uses torch_native then;
- `mem_fraction_static=0.05`, SGLang's KV cache share of host RAM (sglang#11103: pass it on CPU);
- `free_cache_engine=False`: releasing memory needs the memory saver.

`SGLANG_USE_CPU_ENGINE=1` goes to every Ray worker of such a run (`WORKER_ENV`).

One patch, `patch_cpu_weight_transfer`, for the process that sends weights to SGLang (verl's
`ServerAdapter.update_weights` -> `sglang.srt.weight_sync.utils.update_weights`): SGLang's
`monkey_patch_torch_reductions` rewrites a device index only GPU tensors carry, so a CPU tensor fails
to pickle (`IndexError: tuple index out of range`); and torch's default `file_descriptor` sharing
passes descriptors through a resource sharer that refuses SGLang's scheduler, an unrelated process
(`AuthenticationError`; the scheduler dies). Patched, CPU tensors take torch's own reducer and
torch shares them by file name (`file_system`). Measured outside Ray (docs/sglang_cpu.md): a full
weight update through that path, then SGLang's log-probs equal HF's with the new weights within
2.4e-7. Tested in tests/verl_patches/test_sglang_cpu.py.
"""

from __future__ import annotations

import functools
import importlib.metadata

from verl_patches.post_import import when_imported

SGLANG_CPU_KERNELS = "sglang-kernel-cpu"

CPU_ENGINE_KWARGS = {
    "device": "cpu",
    "disable_overlap_schedule": True,
    "enable_memory_saver": False,
    "attention_backend": "torch_native",
    "mem_fraction_static": 0.05,
}
CPU_ROLLOUT_OVERRIDES = {"free_cache_engine": False}
# verl's SGLangReplica.launch_servers reads CUDA_VISIBLE_DEVICES in each rollout worker to place its server;
# on CPU Ray sets none (the workers hold no GPU), so each worker names one pseudo device, as the CPU platform's
# accelerator ids do (verl_patches/vllm_cpu.py); SGLang's CPU engine ignores it
WORKER_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "CUDA_VISIBLE_DEVICES": "0"}


def sglang_cpu_installed() -> bool:
    """True when SGLang and its CPU kernels (`sglang-kernel-cpu`) are installed."""
    try:
        importlib.metadata.distribution("sglang")
        importlib.metadata.distribution(SGLANG_CPU_KERNELS)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def cpu_rollout_overrides(rollout_config) -> list[str]:
    """Set what SGLang needs on CPU in `actor_rollout_ref.rollout` (a key the user set under
    `engine_kwargs.sglang` is kept), in place; returns what changed."""
    from omegaconf import open_dict

    changed = []
    with open_dict(rollout_config):
        for key, value in CPU_ROLLOUT_OVERRIDES.items():
            if rollout_config.get(key) != value:
                rollout_config[key] = value
                changed.append(f"{key}={value}")
        if rollout_config.get("engine_kwargs") is None:
            rollout_config.engine_kwargs = {}
        if rollout_config.engine_kwargs.get("sglang") is None:
            rollout_config.engine_kwargs.sglang = {}
        engine = rollout_config.engine_kwargs.sglang
        for key, value in CPU_ENGINE_KWARGS.items():
            if key not in engine:
                engine[key] = value
                changed.append(f"engine_kwargs.sglang.{key}={value}")
    return changed


_PATCHED_MARK = "_async_rl_sglang_cpu"


def cpu_tensors_through_torchs_reducer(reduce_tensor_modified):
    """SGLang's `_reduce_tensor_modified`, but CPU tensors go to torch's own reducer."""
    if getattr(reduce_tensor_modified, _PATCHED_MARK, False):
        return reduce_tensor_modified

    @functools.wraps(reduce_tensor_modified)
    def reduce_tensor(tensor, *args, **kwargs):
        from torch.multiprocessing import reductions

        if tensor.device.type == "cpu":
            return reductions._reduce_tensor_original(tensor, *args, **kwargs)
        return reduce_tensor_modified(tensor, *args, **kwargs)

    setattr(reduce_tensor, _PATCHED_MARK, True)
    return reduce_tensor


def patch_cpu_weight_transfer(patch_torch_module=None) -> None:
    """In the process that sends weights to SGLang on CPU: CPU tensors through torch's reducer (also
    when SGLang's reductions are already installed) and `file_system` sharing."""
    import torch.multiprocessing
    from torch.multiprocessing import reductions

    if patch_torch_module is None:
        import sglang.srt.utils.patch_torch as patch_torch_module
    patch_torch_module._reduce_tensor_modified = cpu_tensors_through_torchs_reducer(
        patch_torch_module._reduce_tensor_modified)
    if hasattr(reductions, "_reduce_tensor_original"):  # SGLang's reductions are in place
        reductions.reduce_tensor = patch_torch_module._reduce_tensor_modified
        reductions.init_reductions()
    torch.multiprocessing.set_sharing_strategy("file_system")


def apply_sglang_cpu_patches() -> None:
    """In a Ray worker of a CPU run (`VERL_PLATFORM=cpu`) where SGLang's CPU build is installed: the
    weight-transfer patch, right after SGLang's weight-sync module is imported (never imports SGLang)."""
    if not sglang_cpu_installed():
        return
    when_imported("sglang.srt.weight_sync.utils", patch_cpu_weight_transfer)
