"""The driver's work on a verl config before Ray starts, done once: check every key, derive the
run's numbers and layout, and prepare the config verl's workers get (`RunConfig`)."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Optional

import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.trainer.ppo.utils import need_reference_policy

import async_rl.rollout.backends  # noqa: F401 - registers the built-in rollout backends
from async_rl.api.rollout import RolloutBackend, rollout_backend
from async_rl.checkpoints import CheckpointConfig, read_checkpoint_config
from async_rl.core.config import (DELTA_SYNC_KEY, AsyncPipelineConfig, critic_enabled, read_async_config, runs_on_cpu,
                                   select_value, strip_async_keys)
from async_rl.core.data_checks import agent_names_in
from async_rl.core.decoupled_ppo import (PROXIMAL_IN_LOSS, apply_bypass_loss, apply_proximal_loss, apply_to_config,
                                        check_proximal_method, recomputes_proximal)
from async_rl.core.errors import AsyncConfigError
from async_rl.core.legacy_reward_keys import migrate_legacy_reward_keys
from async_rl.core.placement import Placement, plan_placement
from async_rl.core.scoring import overlong_shaping
from async_rl.core.stage_graph import STAGES_KEY, UserStageSpec, build_edges
from async_rl.core.verl_async_keys import job_nodes, standalone_rollout, versions_spanned_bound
from async_rl.core.verl_keys import refuse_unsupported, replaced_settings
from async_rl.core.verl_reads import refuse_unread_keys
from async_rl.file_checks import check_files
from async_rl.rollout.agent_loop_files import absolute_agent_files, check_agent_loops, check_trace_backend
from async_rl.rollout.reward_models import prepare_reward_model_config, reward_model_backend, reward_model_devices
from async_rl.rollout.rollout_dumps import RolloutDumps
from async_rl.rollout.teachers import absolute_teacher_paths, check_teachers
from state_machines.base import StateMachine

logger = logging.getLogger(__name__)

REPLICA_RESTARTS_KEY = "actor_rollout_ref.rollout.max_restarts"
DATALOADER_WORKERS_KEY = "data.dataloader_num_workers"
# the dataloader stage's workers when the command leaves verl's default (8 forked processes): none, the
# stage reads each batch itself; prompt batches are light beside generating them (docs/operations.md)
SIZED_DATALOADER_WORKERS = 0


@dataclass(frozen=True)
class RunConfig:
    """One run, read and checked before Ray starts.

    config: what verl's workers get (the pipeline's keys stripped, output directories absolute,
        the optimizer's horizon, decoupled PPO's rollout correction and the backend's own keys set).
    async_cfg: the pipeline's keys (`replica_max_restarts` resolved for the backend).
    proximal_logp_workers: which workers recompute pi_prox: "train", "logp", or None (verl's
        bypass mode: none do).
    edges: the stage graph, stage name -> its downstreams.
    user_stages: user stage name -> its class.
    dataloader_workers_named: the command named `data.dataloader_num_workers` (else the pipeline sized it,
        and a resume takes its checkpoint's count).
    """

    config: DictConfig
    async_cfg: AsyncPipelineConfig
    backend: RolloutBackend
    checkpoint: CheckpointConfig
    total_steps: int
    critic: bool
    proximal_logp_workers: Optional[str]
    edges: dict
    user_stages: dict
    placement: Placement
    dataloader_workers_named: bool = True

    @property
    def on_cpu(self) -> bool:
        """`trainer.device=cpu`: the devices are worker processes (logical GPUs for Ray where a backend asks)."""
        return runs_on_cpu(self.config)

    def resumed(self) -> "RunConfig":
        """The same run, resuming from the newest checkpoint it wrote (`trainer.resume_mode=auto`)."""
        config = self.config.copy()
        with open_dict(config.trainer):
            config.trainer.resume_mode = "auto"
        return dataclasses.replace(self, config=config, checkpoint=read_checkpoint_config(config))


def read_run_config(config: DictConfig) -> RunConfig:
    """Every check that needs no Ray, then the run's derived values; raises AsyncConfigError, ValueError
    or FileNotFoundError naming the key."""
    config, legacy = migrate_legacy_reward_keys(config)
    if legacy:
        logger.warning(legacy)
    async_cfg = versions_spanned_bound(config, standalone_rollout(config, read_async_config(config)))
    refuse_unsupported(config)
    refuse_unread_keys(config)
    for line in replaced_settings(config):
        logger.warning(line)
    critic = critic_enabled(config)
    read_checkpoint_config(config)
    user_stages = {spec.name: load_stage_class(spec) for spec in async_cfg.user_stages}
    backend = rollout_backend(str(config.actor_rollout_ref.rollout.name), str(config.trainer.device))
    async_cfg = dataclasses.replace(async_cfg, replica_max_restarts=_replica_restarts(async_cfg, backend))
    overlong_shaping(config)
    if not async_cfg.partial_rollout and not backend.waits_for_running:
        raise AsyncConfigError(
            "actor_rollout_ref.rollout.partial_rollout", False,
            f"True with rollout.name={backend.name} (its server aborts requests around a weight load; waiting for "
            "them instead needs a backend that can: cpu, vllm)",
        )
    _check_delta_sync(config, async_cfg, backend)
    check_proximal_method(config, async_cfg.proximal_logp_method, async_cfg.decoupled_ppo)
    check_files(config)
    check_agent_loops(config, agent_names_in(config.data.train_files) | agent_names_in(config.data.get("val_files") or []))
    check_trace_backend(config)
    check_teachers(config, str(config.trainer.device))
    RolloutDumps.from_config(config)  # skip.rollout's values, as verl's class checks them

    config = config.copy()
    strip_async_keys(config)
    workers_named = size_dataloader_workers(config)
    resolve_output_dirs(config)
    absolute_agent_files(config)
    if config.reward.reward_model.get("enable", False):  # its servers load it in Ray workers
        with open_dict(config):
            config.reward.reward_model.model_path = os.path.abspath(str(config.reward.reward_model.model_path))
    absolute_teacher_paths(config)
    checkpoint = read_checkpoint_config(config)
    total_steps = total_training_steps(config, count_rows(config.data.train_files))
    set_optimizer_horizon(config, total_steps)
    if async_cfg.decoupled_ppo:
        apply_to_config(config, async_cfg.behav_imp_weight_cap)
    if apply_bypass_loss(config):
        logger.warning("algorithm.rollout_correction.bypass_mode=True: the actor's loss is verl's bypass-mode loss "
                       "(%s), against the rollout's own log-probs", dict(config.algorithm.rollout_correction))
    if async_cfg.proximal_logp_method in PROXIMAL_IN_LOSS:
        apply_proximal_loss(config, async_cfg.proximal_logp_method)
    backend.prepare_config(config, async_cfg.consume_bucket_size_mb, async_cfg.enable_dual_buffer)
    prepare_reward_model_config(config)
    proximal = async_cfg.proximal_logp_workers if recomputes_proximal(config) else None
    roles = (["train"] + (["critic"] if critic else []) + (["logp"] if proximal == "logp" else [])
             + (["ref_logp"] if need_reference_policy(config) else []))
    placement = plan_placement(job_nodes(config), int(config.trainer.n_gpus_per_node),
                               async_cfg.ratios_by_role, roles, backend.replica_world_size(config.actor_rollout_ref.rollout))
    edges = build_edges(async_cfg.user_stages, async_cfg.dynamic_sampling, critic)
    return RunConfig(config, async_cfg, backend, checkpoint, total_steps, critic, proximal, edges, user_stages,
                     placement, workers_named)


def named_on_command_line(key: str) -> Optional[bool]:
    """Whether the Hydra command that composed the config named `key` (with or without `+`); None when
    no Hydra command is running (a config composed in code)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    named = {item.lstrip("+~").split("=", 1)[0] for item in HydraConfig.get().overrides.task}
    return key in named


def size_dataloader_workers(config: DictConfig) -> bool:
    """Use `SIZED_DATALOADER_WORKERS` when the command left `data.dataloader_num_workers` at verl's default
    (in place, logged); returns whether the user's value stands (named, or a config composed in code)."""
    if named_on_command_line(DATALOADER_WORKERS_KEY) is not False:
        return True
    default = config.data.get("dataloader_num_workers")
    if default != SIZED_DATALOADER_WORKERS:
        logger.warning("%s: the dataloader stage reads its batches itself (%d workers, not verl's default %s); "
                       "name the key to choose", DATALOADER_WORKERS_KEY, SIZED_DATALOADER_WORKERS, default)
        with open_dict(config.data):
            config.data.dataloader_num_workers = SIZED_DATALOADER_WORKERS
    return False


def _check_delta_sync(config: DictConfig, async_cfg: AsyncPipelineConfig, backend: RolloutBackend) -> None:
    """A delta applies to the full weights a receiver serves: the CPU rollout servers' (their load swaps or
    copies whole tensors) and verl's replicas' (their staged version, kept after verl's `update_weights`),
    where the backend `loads_deltas`; a LoRA version is an adapter merged at load, logp ranks load into shards."""
    if not async_cfg.delta_sync:
        return
    why = []
    if not backend.loads_deltas:
        why.append(f"rollout.name={backend.name} (delta sync into its replicas is untested: no end-to-end run of it)")
    if int(OmegaConf.select(config, "actor_rollout_ref.model.lora_rank", default=0) or 0) > 0:
        why.append("actor_rollout_ref.model.lora_rank > 0 (a version is an adapter, merged at its load)")
    if async_cfg.proximal_logp_workers == "logp":
        why.append("algorithm.proximal_logp_workers=logp (its ranks load into FSDP shards and keep no base)")
    if why:
        raise AsyncConfigError(DELTA_SYNC_KEY, True, "False with " + "; ".join(why))


def _replica_restarts(async_cfg: AsyncPipelineConfig, backend: RolloutBackend) -> int:
    """`actor_rollout_ref.rollout.max_restarts`: the backend's default when unset; above 0 only where the
    backend can restart a lost replica."""
    value = async_cfg.replica_max_restarts
    if value is None:
        return backend.default_max_restarts
    if value and backend.relaunch is None:
        raise AsyncConfigError(REPLICA_RESTARTS_KEY, value, f"0 with actor_rollout_ref.rollout.name={backend.name!r} "
                                                            "(its lost replicas are not restarted)")
    return value


def load_stage_class(spec: UserStageSpec) -> type:
    """Import a user stage's class ("package.module.Class"); AsyncConfigError naming its key."""
    key = f"{STAGES_KEY}.{spec.name}.cls"
    module_name, _, class_name = spec.cls_path.rpartition(".")
    if not module_name:
        raise AsyncConfigError(key, spec.cls_path, "a dotted path 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AsyncConfigError(key, spec.cls_path, f"an importable module ({type(exc).__name__}: {exc})") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, StateMachine)):
        raise AsyncConfigError(key, spec.cls_path, f"a subclass of state_machines.base.StateMachine in {module_name}")
    return cls


def ray_init_kwargs(config: DictConfig) -> dict:
    """verl's `ray_kwargs.ray_init` plus what a small CPU machine needs (logical CPUs, no dashboard) and
    the rollout backend's environment.

    A running cluster is joined only when asked (`RAY_ADDRESS`, or `+ray_kwargs.ray_init.address`);
    otherwise a local instance starts, whatever `ray start` ran on this machine before."""
    backend = rollout_backend(str(config.actor_rollout_ref.rollout.name))
    kwargs = OmegaConf.to_container(config.get("ray_kwargs", {}).get("ray_init", {}), resolve=True) or {}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    # Hydra reads `...env_vars.X=1` as an int; Ray takes strings only
    env_vars = {key: str(value) for key, value in (kwargs.get("runtime_env", {}).get("env_vars") or {}).items()}
    env_vars.setdefault("TOKENIZERS_PARALLELISM", "false")
    reward_model = reward_model_backend(config) if OmegaConf.select(config, "reward.reward_model.enable") else None
    for key, value in {**(reward_model.ray_env(config) if reward_model else {}), **backend.ray_env(config),
                       **determinism_env(config)}.items():
        env_vars.setdefault(key, value)
    joins_cluster = bool(kwargs.get("address") or os.environ.get("RAY_ADDRESS"))  # its resources are set
    if not joins_cluster:  # a fresh local instance, never a cluster some other `ray start` left behind
        kwargs["address"] = "local"
        kwargs.setdefault("include_dashboard", False)
    if runs_on_cpu(config):
        env_vars.update({"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda"})
        if not joins_cluster:
            # verl's replica pools ask for "GPUs": logical, one a slot (the reward model's own devices too)
            gpus = (job_nodes(config) * int(config.trainer.n_gpus_per_node) if backend.logical_gpus_on_cpu
                    else 0) + (reward_model_devices(config) if reward_model and reward_model.logical_gpus_on_cpu else 0)
            if gpus:
                kwargs.setdefault("num_gpus", gpus)
            kwargs.setdefault("num_cpus", max(16, os.cpu_count() or 1))  # logical: stages mostly wait
    runtime_env = {k: v for k, v in kwargs.get("runtime_env", {}).items() if v is not None}
    kwargs["runtime_env"] = {**runtime_env, "env_vars": env_vars}
    return kwargs


def determinism_env(config: DictConfig) -> dict[str, str]:
    """What verl's `run_ppo` puts in every process's environment for `rollout.full_determinism` (the
    policy's, or a reward model's): verl's deterministic paths, vLLM's batch invariance, Python's hash seed
    (the rollout's seed)."""
    rollout = config.actor_rollout_ref.rollout
    rm_determinism = select_value(config, "reward.reward_model.enable", False) and select_value(
        config, "reward.reward_model.rollout.full_determinism", False)
    if not (rollout.get("full_determinism") or rm_determinism):
        return {}
    return {"VERL_FULL_DETERMINISM": "1", "VLLM_BATCH_INVARIANT": "1", "PYTHONHASHSEED": str(rollout.seed)}


def count_rows(files) -> int:
    """Rows in the parquet training files (before verl's length filter)."""
    paths = list(files) if isinstance(files, (list, tuple)) or OmegaConf.is_list(files) else [files]
    return sum(pq.ParquetFile(str(p)).metadata.num_rows for p in paths)


def total_training_steps(config: DictConfig, train_rows: int) -> int:
    """trainer.total_training_steps, else epochs x full batches of the rows verl's dataset keeps
    (data.train_max_samples > 0 caps them, as in RLHFDataset)."""
    steps = config.trainer.get("total_training_steps")
    if steps:
        return int(steps)
    cap = int(config.data.get("train_max_samples", -1) or -1)
    rows = min(train_rows, cap) if cap > 0 else train_rows
    return int(config.trainer.total_epochs) * (rows // int(config.data.train_batch_size))


OUTPUT_DIR_KEYS = ("trainer.default_local_dir", "trainer.rollout_data_dir", "trainer.validation_data_dir")


def resolve_output_dirs(config: DictConfig) -> None:
    """Relative output directories are the driver's (its working directory), not each actor's."""
    for key in OUTPUT_DIR_KEYS:
        value = OmegaConf.select(config, key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            parent, _, leaf = key.rpartition(".")
            with open_dict(config):
                OmegaConf.select(config, parent)[leaf] = os.path.abspath(value)


def set_optimizer_horizon(config: DictConfig, total_steps: int) -> None:
    """As verl's trainer: the optimizer's `total_training_steps` (lr warmup / decay schedules) is the run's."""
    with open_dict(config):
        config.actor_rollout_ref.actor.optim.total_training_steps = total_steps
        if OmegaConf.select(config, "critic.optim") is not None:
            config.critic.optim.total_training_steps = total_steps
