"""Small, named patches that let verl 0.9.1's FSDP2 workers run on CPU.

Each is applied only inside the worker processes of a CPU run (`apply_cpu_worker_patches`), when the
module it patches is imported (`verl_patches/post_import.py`: a stage that never builds an engine never
loads verl's engine modules); verl's own commands on GPUs are untouched. Each has a test that fails
without it (tests/verl_patches/test_verl_patches.py; 5-7 in their own test modules).

1. `gloo_process_group`: verl builds the backend string `cpu:gloo,cpu:gloo` on a
   CPU platform, which torch rejects; use plain `gloo`.
2. `unpinned_cpu_offload`: forward-only FSDP2 engines use
   `CPUOffloadPolicy(pin_memory=True)`; pinning needs an accelerator.
3. `engine_device`: verl registers its FSDP engine for cuda/npu only; the env var
   `VERL_ENGINE_DEVICE=cuda` selects that (device-agnostic) engine class.
4. `value_model_attention`: verl's critic loads its value model with
   `attn_implementation="flash_attention_2"` hard-coded (`verl.utils.model.load_valuehead_model`),
   which needs CUDA; load it with the attention the critic's config asks for
   (`critic.model.override_config.attn_implementation`), sdpa by default.
5. `ulysses_sdpa` (verl_patches/ulysses_sdpa.py): verl's Ulysses sequence parallelism patches
   flash-attention's forward only; the same all-to-all around transformers' sdpa attention.
6. `packed_sdpa` (verl_patches/packed_sdpa.py): on a packed (padding-removed) micro-batch, sdpa attends
   within each sample, as flash-attention's varlen kernel does, instead of over the whole packed sequence.
7. `row_block_logprobs` (verl_patches/row_block_logprobs.py): verl's CPU log-probs of labels loop over
   packed tokens one at a time; the same values a block of rows at a time.
8. `master_port` (verl_patches/master_port.py): a worker group's rendezvous port below the kernel's
   ephemeral range, so that no outgoing connection takes it before rank 0 binds it (also in the
   driver of a CPU run: `apply_cpu_driver_patches`).
9. `vision_without_torchvision` (verl_patches/vision_without_torchvision.py): verl's image path where
   torchvision does not import: a vision-language model's processor loads (images only) instead of verl
   taking the model for a text-only one, and `qwen_vl_utils` reads images (also in the driver, which
   loads the data set).
"""

from __future__ import annotations

import functools
import os
import sys

from verl_patches.cpu_platform import make_cpu_platform_class
from verl_patches.master_port import patch_master_port
from verl_patches.packed_sdpa import patch_packed_sdpa
from verl_patches.post_import import when_imported
from verl_patches.vision_without_torchvision import (patch_processors_without_torchvision,
                                                     patch_qwen_vl_utils_without_torchvision)
from verl_patches.row_block_logprobs import patch_row_block_logprobs
from verl_patches.ulysses_sdpa import patch_ulysses_sdpa

_APPLIED: set[str] = set()


# the modules of verl 0.9.1 that bind `initialize_global_process_group_ray` by name at their import
GLOO_IMPORTERS = ("verl.workers.engine_workers", "verl.checkpoint_engine.base")


def patch_gloo_process_group() -> None:
    """Make `initialize_global_process_group_ray` use backend `gloo` on CPU (in verl.utils.distributed and in
    the modules of GLOO_IMPORTERS already imported; those imported later take the patched name)."""
    if "gloo_process_group" in _APPLIED:
        return
    import verl.utils.distributed as dist_utils

    original = dist_utils.initialize_global_process_group_ray

    @functools.wraps(original)
    def initialize_with_gloo(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    dist_utils.initialize_global_process_group_ray = initialize_with_gloo
    for name in GLOO_IMPORTERS:
        if name in sys.modules:
            sys.modules[name].initialize_global_process_group_ray = initialize_with_gloo
    _APPLIED.add("gloo_process_group")


def patch_unpinned_cpu_offload() -> None:
    """Force `pin_memory=False` in the CPUOffloadPolicy verl's FSDP2 engine builds."""
    if "unpinned_cpu_offload" in _APPLIED:
        return
    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl

    original_policy = fsdp_impl.CPUOffloadPolicy

    def unpinned_policy(*args, **kwargs):
        kwargs["pin_memory"] = False
        return original_policy(*args, **kwargs)

    unpinned_policy.__wrapped__ = original_policy  # `inspect.unwrap` finds verl's
    fsdp_impl.CPUOffloadPolicy = unpinned_policy
    _APPLIED.add("unpinned_cpu_offload")


def patch_value_model_attention() -> None:
    """Load verl's value model (critic) with the configured attention instead of flash_attention_2."""
    if "value_model_attention" in _APPLIED:
        return
    import verl.utils.model as model_utils

    original = model_utils.load_valuehead_model

    @functools.wraps(original)
    def load_with_configured_attention(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        attention = getattr(model_config, "_attn_implementation", None)
        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation=attention if attention and attention != "flash_attention_2" else "sdpa",
            trust_remote_code=trust_remote_code,
        )

    model_utils.load_valuehead_model = load_with_configured_attention
    _APPLIED.add("value_model_attention")


def patch_sdpa_attention() -> None:
    """Both sdpa wrappers, the packed one inside: Ulysses gathers a rank's slice of the sequence first."""
    patch_packed_sdpa()
    patch_ulysses_sdpa()


def set_engine_device_env() -> None:
    """Select verl's FSDP engine class (registered for cuda/npu) on CPU."""
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")


def use_cpu_platform() -> None:
    """Make verl's platform singleton the CPU platform in this process (and its children via env)."""
    from verl.plugin.platform import get_platform, set_platform

    os.environ["VERL_PLATFORM"] = "cpu"
    platform_cls = make_cpu_platform_class()
    if get_platform().device_name != "cpu":
        set_platform(platform_cls())


# the patches that the process building verl's worker groups needs (the driver of a CPU run; it also loads
# the data set's processor)
DRIVER_PATCHES_ON_IMPORT = {"verl.single_controller.ray.base": patch_master_port,
                            "transformers.processing_utils": patch_processors_without_torchvision,
                            "verl.utils.dataset.rl_dataset": patch_qwen_vl_utils_without_torchvision}

# each patch, and the module whose import applies it (a worker of a CPU run builds worker groups too: verl's
# TaskRunner)
PATCHES_ON_IMPORT = {
    "verl.utils.distributed": patch_gloo_process_group,
    "verl.workers.engine.fsdp.transformer_impl": patch_unpinned_cpu_offload,
    "verl.utils.model": patch_value_model_attention,
    "transformers.modeling_utils": patch_sdpa_attention,
    "verl.utils.torch_functional": patch_row_block_logprobs,
    **DRIVER_PATCHES_ON_IMPORT,
}


PATCH_LOG_ENV = "ASYNC_RL_PATCH_LOG"  # a file: each patch applied appends {"pid", "patch", "module"} to it


def recorded(patch, module: str):
    """`patch`, which also appends what it applied to the file `$ASYNC_RL_PATCH_LOG` names, if set (what a
    bench reports as the patches each run's processes had: `applied_patches`)."""
    @functools.wraps(patch)
    def apply() -> None:
        patch()
        if os.environ.get(PATCH_LOG_ENV):
            import json

            with open(os.environ[PATCH_LOG_ENV], "a") as log:
                log.write(json.dumps({"pid": os.getpid(), "patch": patch.__name__, "module": module}) + "\n")

    return apply


def applied_patches(path: str) -> dict[int, set[str]]:
    """pid -> names of the patches applied in that process, from a `$ASYNC_RL_PATCH_LOG` file ({} if none)."""
    import json

    if not os.path.exists(path):
        return {}
    out: dict[int, set[str]] = {}
    with open(path) as log:
        for line in log:
            if line.strip():
                entry = json.loads(line)
                out.setdefault(entry["pid"], set()).add(entry["patch"])
    return out


def apply_cpu_worker_patches() -> None:
    """The CPU platform now, and every patch once its module is imported (now where it already is);
    idempotent. Call in a worker process before verl builds engines."""
    use_cpu_platform()
    set_engine_device_env()
    for module, patch in PATCHES_ON_IMPORT.items():
        when_imported(module, recorded(patch, module))


def apply_cpu_driver_patches() -> None:
    """In the process that builds verl's worker groups of a CPU run: each of DRIVER_PATCHES_ON_IMPORT once
    its module is imported."""
    for module, patch in DRIVER_PATCHES_ON_IMPORT.items():
        when_imported(module, patch)
