"""Resource split (`trainer.use_nodes_ratios`) and verl worker groups for the stages."""

from __future__ import annotations

import math

import ray
from omegaconf import DictConfig

from async_rl.config import AsyncPipelineConfig


def total_device_slots(config: DictConfig) -> int:
    """Devices (GPUs; on CPU, worker processes) the job may use: nnodes x n_gpus_per_node."""
    return int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)


def split_world_sizes(total_slots: int, async_cfg: AsyncPipelineConfig) -> dict[str, int]:
    """World size per role: floor(ratio x slots), at least 1.

    Ratios may sum above 1: roles that share a fraction are placed on the same devices
    (the proposal's [0.5, 0.5, 0.5, 0.5]: train, logp and ref_logp on one half,
    generate on the other). `critic` (values and critic_train) is the optional 5th ratio.
    """
    return {role: max(1, math.floor(ratio * total_slots)) for role, ratio in async_cfg.ratios_by_role.items()}


def _prepare_platform(config: DictConfig) -> bool:
    """Whether the run is on CPU (`trainer.device`); if so, verl's CPU platform and engine class
    are selected in the driver before any worker group is built."""
    on_cpu = str(config.trainer.device) == "cpu"
    if on_cpu:
        from verl_patches.cpu_patches import set_engine_device_env, use_cpu_platform

        use_cpu_platform()
        set_engine_device_env()
    return on_cpu


def _worker_group(on_cpu: bool, world_size: int, name: str, remote_cls, **init_args):
    """verl `RayWorkerGroup` of `remote_cls(on_cpu=..., **init_args)` on its own pool of `world_size` devices."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([world_size], use_gpu=not on_cpu, max_colocate_count=1, name_prefix=name)
    worker_cls = RayClassWithInitArgs(cls=remote_cls, on_cpu=on_cpu, **init_args)
    return RayWorkerGroup(pool, worker_cls, name_prefix=name, device_name="cpu" if on_cpu else "cuda")


def make_worker_group(config: DictConfig, role: str, world_size: int, name: str):
    """verl `RayWorkerGroup` of `PipelineWorker` (role `actor` or `ref`), models initialised."""
    from async_rl.workers import CONCURRENCY_GROUPS, PipelineWorker

    on_cpu = _prepare_platform(config)
    group = _worker_group(on_cpu, world_size, name, ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(PipelineWorker),
                          config=config.actor_rollout_ref, role=role)
    group.init_model()
    return group


def critic_worker_config(config: DictConfig):
    """verl's critic config -> the `TrainingWorkerConfig` verl's trainer builds from it (value model,
    engine with the critic's token budgets, optimizer, checkpoint contents), and the `CriticConfig`
    (its loss settings)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import TrainingWorkerConfig

    critic_cfg = omega_conf_to_dataclass(config.critic)
    engine = critic_cfg.engine
    engine.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    engine.max_token_len_per_gpu = critic_cfg.ppo_max_token_len_per_gpu
    worker_cfg = TrainingWorkerConfig(
        model_type="value_model",
        model_config=critic_cfg.model,
        engine_config=engine,
        optimizer_config=critic_cfg.optim,
        checkpoint_config=critic_cfg.checkpoint,
    )
    return worker_cfg, critic_cfg


def make_critic_worker_group(config: DictConfig, world_size: int):
    """verl `RayWorkerGroup` of the critic (`async_rl.workers.CriticWorker`), engine built and its
    loss verl's `value_loss`, as verl's trainer sets it up."""
    from functools import partial

    from verl.workers.utils.losses import value_loss

    from async_rl.workers import CriticWorker

    on_cpu = _prepare_platform(config)
    worker_cfg, critic_cfg = critic_worker_config(config)
    group = _worker_group(on_cpu, world_size, "critic", ray.remote(CriticWorker), config=worker_cfg)
    group.reset()
    group.set_loss_fn(partial(value_loss, config=critic_cfg))
    return group


def devices_needed(world_sizes: dict[str, int], num_replicas: int, replica_devices: int, ref_enabled: bool,
                   logp_enabled: bool = True, critic_enabled: bool = False) -> int:
    """Devices the pipeline's pools take: one worker group per role in use plus the rollout replicas.

    Each role gets its own pool (no sharing between pools), so this is a plain sum.
    """
    groups = (world_sizes["train"] + (world_sizes["logp"] if logp_enabled else 0)
              + (world_sizes["ref_logp"] if ref_enabled else 0) + (world_sizes["critic"] if critic_enabled else 0))
    return groups + num_replicas * replica_devices


def check_cluster_fits(needed: int, on_cpu: bool, cluster_resources: dict) -> None:
    """Fail at once, not after a placement timeout, when Ray cannot place every pool."""
    resource = "CPU" if on_cpu else "GPU"
    have = int(cluster_resources.get(resource, 0))
    if needed > have:
        unit = "worker processes (logical CPUs)" if on_cpu else "GPUs"
        raise RuntimeError(
            f"the pipeline needs {needed} {unit} for its worker groups and rollout replicas, Ray has {have}: "
            f"lower trainer.nnodes x trainer.n_gpus_per_node or trainer.use_nodes_ratios"
            + (", or raise ray_kwargs.ray_init.num_cpus" if on_cpu else "")
        )
