"""One small, named patch so that verl 0.9.1 can hand vLLM 0.30 a LoRA adapter as tensors.

verl replaces vLLM's `WorkerLoRAManager._load_adapter` (`verl.utils.vllm.utils.VLLMHijack`) to load an
adapter from tensors (its `TensorLoRARequest`: what its weight sync and the pipeline's send). For
vLLM >= 0.25 it calls `WeightsMapper.get_unstacked_mapper()`, which vLLM 0.30 renamed
`get_rename_mapper()` (the same mapper: renames kept, stacked and dropping maps left out), so every
adapter load fails with `AttributeError: 'WeightsMapper' object has no attribute
'get_unstacked_mapper'`. `alias_unstacked_mapper` gives `WeightsMapper` the old name where only the
new one exists; applied at `import verl` (the plugin) where vLLM is installed, in the vLLM worker
process as soon as it imports vLLM's model utilities. Test: tests/verl_patches/test_vllm_cpu_patches.py.
"""

from __future__ import annotations

import importlib.util

from verl_patches.vllm_cpu import on_import

MODEL_UTILS = "vllm.model_executor.models.utils"


def alias_unstacked_mapper(utils_module) -> None:
    """On an imported `vllm.model_executor.models.utils`: `WeightsMapper.get_unstacked_mapper` is
    `get_rename_mapper` when vLLM has only the latter (nothing changes otherwise)."""
    mapper = utils_module.WeightsMapper
    if not hasattr(mapper, "get_unstacked_mapper") and hasattr(mapper, "get_rename_mapper"):
        mapper.get_unstacked_mapper = mapper.get_rename_mapper


def apply_vllm_lora_names_patch() -> None:
    """Where vLLM is installed: `alias_unstacked_mapper` now or right after vLLM's model utilities are imported."""
    if importlib.util.find_spec("vllm") is not None:
        on_import(MODEL_UTILS, "WeightsMapper", alias_unstacked_mapper)
