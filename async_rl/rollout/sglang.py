"""verl's SGLang rollout as a pipeline backend: its replicas through verl (async_rl/rollout/
verl_replicas.py), and on `trainer.device=cpu` SGLang's CPU build with the keys it needs there
(verl_patches/sglang_cpu.py)."""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from async_rl.rollout import verl_replicas
from verl_patches.sglang_cpu import WORKER_ENV, cpu_rollout_overrides, sglang_cpu_installed


def unavailable(device: str) -> Optional[str]:
    if device == "cpu":
        return None if sglang_cpu_installed() else (
            "cpu on trainer.device=cpu (sglang runs verl's GPU server), or build SGLang's CPU backend "
            "(bash scripts/setup.sh --sglang-cpu; docs/sglang_cpu.md)")
    return verl_replicas.sglang_unavailable(device)


def prepare_server_config(rollout_cfg, device: str) -> None:
    """On CPU, the keys SGLang's CPU build needs in one server config, in place."""
    if device == "cpu":
        cpu_rollout_overrides(rollout_cfg)


def prepare_config(config: DictConfig, consume_bucket_mb: float, dual_buffer: bool) -> None:
    """The rollout's server config (`prepare_server_config`), then the checkpoint-engine backend."""
    prepare_server_config(config.actor_rollout_ref.rollout, str(config.trainer.device))
    verl_replicas.prepare_config(config, consume_bucket_mb, dual_buffer)


def ray_env(config: DictConfig) -> dict:
    """On CPU, `SGLANG_USE_CPU_ENGINE=1` for every Ray process of the run (unless set)."""
    import os

    if str(config.trainer.device) != "cpu":
        return {}
    return {key: os.environ.get(key, value) for key, value in WORKER_ENV.items()}
