"""verl's own trainers on CPU with this package's rollout backend (`rollout.name=cpu`), vLLM or SGLang.

Without `async_pipeline=True`, a verl command that asks for `trainer.device=cpu` and
`actor_rollout_ref.rollout.name=cpu` (a backend only this package provides) runs verl's own
trainer on the CPU backend: the synchronous one by default. `rollout.name=vllm` does the same
through verl's own vLLM servers where vLLM's CPU build is installed (`verl_patches/vllm_cpu.py`), and
`rollout.name=sglang` through verl's SGLang servers where SGLang's CPU build is
(`verl_patches/sglang_cpu.py`); `ROLLOUTS_ON_CPU` lists them. The plugin then does, before Ray
starts, what the pipeline does for itself: the CPU platform and patches in the driver; logical
CPUs and GPUs for Ray (verl's resource check counts GPUs; on CPU a "GPU" is one worker process); `VERL_PLATFORM=cpu` in every Ray worker, where the plugin applies the same patches
and registers the backend, each when the verl module it concerns is imported
(`verl_patches/post_import.py`). Every other verl command is left alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from omegaconf import OmegaConf, open_dict

from async_rl.core.config import async_pipeline_enabled, runs_on_cpu, strip_async_keys
from async_rl.rollout.cpu.options import CpuEngineOptions
from async_rl.rollout.cpu.registration import register_cpu_rollout
from verl_patches import sglang_cpu, vllm_cpu
from verl_patches.cpu_patches import apply_cpu_worker_patches
from verl_patches.cpu_reward_model import patch_disrm_on_cpu
from verl_patches.post_import import when_imported


@dataclass(frozen=True)
class RolloutOnCpu:
    """A rollout verl's own trainer can use on trainer.device=cpu: whether it is installed, the keys its
    servers need there (set in place on `actor_rollout_ref.rollout`, returning the names changed), the
    environment of every Ray worker and the check of its servers' own settings (raises, naming the key)."""
    label: str
    installed: Callable[[], bool]
    server_overrides: Optional[Callable[[Any], list]] = None
    worker_env: dict = field(default_factory=dict)
    check: Optional[Callable[[Any], Any]] = None


ROLLOUTS_ON_CPU = {
    "cpu": RolloutOnCpu("the CPU backend", lambda: True, check=CpuEngineOptions.from_rollout_config),
    # installed: looked up at each call (a test or a late install changes the module's answer)
    "vllm": RolloutOnCpu("vLLM on CPU", lambda: vllm_cpu.vllm_cpu_installed(), vllm_cpu.cpu_rollout_overrides,
                         vllm_cpu.WORKER_ENV),
    "sglang": RolloutOnCpu("SGLang on CPU", lambda: sglang_cpu.sglang_cpu_installed(),
                           sglang_cpu.cpu_rollout_overrides, sglang_cpu.WORKER_ENV),
}
WORKER_ENV = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", "TOKENIZERS_PARALLELISM": "false"}


def wants_cpu_rollout(config) -> bool:
    """A plain verl command (no pipeline flag) on trainer.device=cpu with rollout.name=cpu (or
    vllm / sglang, with its CPU build installed)."""
    name = str(config.get("actor_rollout_ref", {}).get("rollout", {}).get("name", ""))
    return (
        not async_pipeline_enabled(config)
        and name in ROLLOUTS_ON_CPU and ROLLOUTS_ON_CPU[name].installed()
        and runs_on_cpu(config)
    )


def prepare(config) -> None:
    """Set up the driver and the Ray init arguments (in `config.ray_kwargs.ray_init`) in place. A running
    cluster is joined only when asked (`RAY_ADDRESS`, or `ray_kwargs.ray_init.address`), with its own
    resources."""
    strip_async_keys(config)  # the pipeline's keys may remain in a demo command with the flag off
    worker_env = dict(WORKER_ENV)
    rollout = ROLLOUTS_ON_CPU[str(config.actor_rollout_ref.rollout.name)]
    if rollout.check is not None:
        rollout.check(config.actor_rollout_ref.rollout)
    changed = rollout.server_overrides(config.actor_rollout_ref.rollout) if rollout.server_overrides else []
    if changed:
        print(f"[async_rl] {rollout.label}: " + ", ".join(f"actor_rollout_ref.rollout.{c}" for c in changed),
              flush=True)
    worker_env.update({k: os.environ.get(k, v) for k, v in rollout.worker_env.items()})
    os.environ.update(worker_env)
    set_up_worker_process()
    devices = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)
    logical_cpus = 16  # verl's actors ask for whole CPUs
    if "async_training" in config:  # verl's fully_async_policy: its rollout's own devices; 23 CPUs for its actors
        devices += int(config.rollout.nnodes) * int(config.rollout.n_gpus_per_node)
        logical_cpus = 48
    if OmegaConf.select(config, "distillation.enabled", default=False):  # verl's teacher pool, devices of its own
        devices += int(config.distillation.nnodes) * int(config.distillation.n_gpus_per_node)
    with open_dict(config):
        ray_init = config.ray_kwargs.ray_init
        if not (ray_init.get("address") or os.environ.get("RAY_ADDRESS")):  # a running cluster's resources are its own
            ray_init.address = "local"  # never a cluster some other `ray start` on this machine left behind
            if ray_init.get("num_cpus") is None:
                ray_init.num_cpus = max(logical_cpus, os.cpu_count() or 1)  # logical
            if ray_init.get("num_gpus") is None:
                ray_init.num_gpus = devices
            if ray_init.get("include_dashboard") is None:
                ray_init.include_dashboard = False
        if ray_init.get("runtime_env") is None:
            ray_init.runtime_env = {}
        if ray_init.runtime_env.get("env_vars") is None:
            ray_init.runtime_env.env_vars = {}
        for key, value in worker_env.items():
            if key not in ray_init.runtime_env.env_vars:
                ray_init.runtime_env.env_vars[key] = value


def set_up_worker_process() -> None:
    """In a Ray worker of such a run (`VERL_PLATFORM=cpu`): the CPU patches and the backend, each applied
    when the module it patches is imported (a stage that never loads verl's engines or replicas never pays
    for them)."""
    apply_cpu_worker_patches()
    when_imported("verl.experimental.reward_loop.reward_loop", patch_disrm_on_cpu)
    when_imported("verl.workers.rollout.replica", register_cpu_rollout)
    sglang_cpu.apply_sglang_cpu_patches()  # verl's weight path into SGLang's CPU build (a no-op without it)
