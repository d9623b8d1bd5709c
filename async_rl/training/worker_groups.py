"""verl worker groups for the training stages (actor, ref, logp, critic) on their devices
(`async_rl.core.devices`), with the CPU platform selected in the driver on CPU runs."""

from __future__ import annotations

import copy

import ray
from omegaconf import DictConfig, OmegaConf, open_dict

from async_rl.core.config import runs_on_cpu
from async_rl.core.devices import GroupDevices, device_pool
from async_rl.training.workers import CONCURRENCY_GROUPS, CriticWorker, PipelineWorker
from verl_patches.cpu_patches import set_engine_device_env, use_cpu_platform


def _prepare_platform(config: DictConfig) -> bool:
    """Whether the run is on CPU (`trainer.device`); if so, verl's CPU platform and engine class
    are selected in the driver before any worker group is built."""
    on_cpu = runs_on_cpu(config)
    if on_cpu:
        use_cpu_platform()
        set_engine_device_env()
    return on_cpu


def _worker_group(on_cpu: bool, devices: "int | GroupDevices", name: str, remote_cls, **init_args):
    """verl `RayWorkerGroup` of `remote_cls(on_cpu=..., **init_args)` on `devices`."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    pool = device_pool(devices, not on_cpu, name)
    worker_cls = RayClassWithInitArgs(cls=remote_cls, on_cpu=on_cpu, **init_args)
    return RayWorkerGroup(pool, worker_cls, name_prefix=name, device_name="cpu" if on_cpu else "cuda")


def make_worker_group(config: DictConfig, role: str, devices: "int | GroupDevices", name: str,
                      trains: bool = False):
    """verl `RayWorkerGroup` of `PipelineWorker` (role `actor` or `ref`), models initialised. Under LoRA the
    reference is the base model without adapter, as verl's trainer computes it (`ref_in_actor`). `trains`:
    the group updates the policy, with verl's distillation loss where `distillation.enabled` (as verl's
    trainer gives its actor `distillation_config`)."""
    on_cpu = _prepare_platform(config)
    section = config.actor_rollout_ref
    for profiler in (section.actor.get("profiler"), section.ref.get("profiler")):
        if profiler is not None:  # resolved as verl's trainer resolves its config: verl's workers build their
            OmegaConf.resolve(profiler)  # profilers through hydra, which loses the `${...}` of a section
    if role == "ref":
        section = without_lora(section)
    distillation = {"distillation_config": config.get("distillation")} if trains else {}
    group = _worker_group(on_cpu, devices, name, ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(PipelineWorker),
                          config=section, role=role, **distillation)
    group.init_model()
    return group


def without_lora(section: DictConfig) -> DictConfig:
    """`actor_rollout_ref` with its model's LoRA off (no rank, no adapter to load)."""
    section = copy.deepcopy(section)
    with open_dict(section):
        section.model.lora_rank = 0
        section.model.lora_adapter_path = None
    return section


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
    profiler = config.critic.get("profiler", {})  # through hydra's path, as verl's trainer builds it
    if profiler:
        OmegaConf.resolve(profiler)
    worker_cfg = TrainingWorkerConfig(
        model_type="value_model",
        model_config=critic_cfg.model,
        engine_config=engine,
        optimizer_config=critic_cfg.optim,
        checkpoint_config=critic_cfg.checkpoint,
        profiler_config=omega_conf_to_dataclass(profiler) if profiler else None,
    )
    return worker_cfg, critic_cfg


def make_critic_worker_group(config: DictConfig, devices: "int | GroupDevices"):
    """verl `RayWorkerGroup` of the critic (`async_rl.training.workers.CriticWorker`), engine built and its
    loss verl's `value_loss`, as verl's trainer sets it up."""
    from functools import partial

    from verl.workers.utils.losses import value_loss

    on_cpu = _prepare_platform(config)
    worker_cfg, critic_cfg = critic_worker_config(config)
    group = _worker_group(on_cpu, devices, "critic", ray.remote(CriticWorker), config=worker_cfg)
    group.reset()
    group.set_loss_fn(partial(value_loss, config=critic_cfg))
    return group
