"""The driver's work on a verl config before Ray starts: check every key, derive the run's
numbers (training steps, Ray's init arguments), and prepare the config the workers get."""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from async_rl.checkpoints import read_checkpoint_config
from async_rl.config import AsyncPipelineConfig, critic_enabled, read_async_config
from async_rl.config_error import AsyncConfigError


def validate_pipeline_config(config: DictConfig) -> AsyncPipelineConfig:
    """Everything checkable before Ray starts; raises AsyncConfigError / ValueError naming the key."""
    from async_rl.data_checks import check_rl_files
    from async_rl.rollout_backends import check_rollout_name
    from state_machines.reward import overlong_shaping

    async_cfg = read_async_config(config)
    critic_enabled(config)
    read_checkpoint_config(config)
    for spec in async_cfg.user_stages:
        spec.load_class()
    check_rollout_name(config.actor_rollout_ref.rollout.name, config.trainer.device)
    overlong_shaping(config)
    if not async_cfg.partial_rollout and str(config.actor_rollout_ref.rollout.name) not in ("cpu", "vllm"):
        raise AsyncConfigError(
            "actor_rollout_ref.rollout.partial_rollout", False,
            f"True with rollout.name={config.actor_rollout_ref.rollout.name} (its server aborts requests around a "
            "weight load; waiting for them instead is implemented for the cpu and vllm backends)",
        )
    for key in ("data.train_files", "actor_rollout_ref.model.path"):
        value = OmegaConf.select(config, key)
        paths = list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]
        for path in paths:
            if not path or (not str(path).startswith(("hdfs://", "s3://")) and not os.path.exists(str(path))):
                raise FileNotFoundError(f"{key}={path!r}: no such file or directory")
    prompt_key = str(config.data.get("prompt_key", "prompt"))
    for key in ("data.train_files", "data.val_files"):
        check_rl_files(OmegaConf.select(config, key), prompt_key, key)
    if int(config.trainer.get("total_training_steps") or 0) <= 0 and int(config.trainer.total_epochs) <= 0:
        raise ValueError("set trainer.total_training_steps or trainer.total_epochs to a positive number")
    return async_cfg


def ray_init_kwargs(config: DictConfig) -> dict:
    """verl's `ray_kwargs.ray_init` plus what a small CPU machine needs (logical CPUs, no dashboard).

    A running cluster is joined only when asked (`RAY_ADDRESS`, or `+ray_kwargs.ray_init.address`);
    otherwise a local instance starts, whatever `ray start` ran on this machine before."""
    kwargs = OmegaConf.to_container(config.get("ray_kwargs", {}).get("ray_init", {}), resolve=True) or {}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    env_vars = dict(kwargs.get("runtime_env", {}).get("env_vars", {}))
    env_vars.setdefault("TOKENIZERS_PARALLELISM", "false")
    if str(config.actor_rollout_ref.rollout.name) == "vllm":
        # vLLM 0.30's API server imports model_hosting_container_standards, which sets the root logger to
        # ERROR unless LOG_LEVEL is set: every warning (restarts, placement) of a process that imports it is lost
        env_vars.setdefault("LOG_LEVEL", os.environ.get("LOG_LEVEL", "WARNING"))
    joins_cluster = bool(kwargs.get("address") or os.environ.get("RAY_ADDRESS"))  # its resources are set
    if not joins_cluster:  # a fresh local instance, never a cluster some other `ray start` left behind
        kwargs["address"] = "local"
    if str(config.trainer.device) == "cpu":
        env_vars.update({"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda"})
        if str(config.actor_rollout_ref.rollout.name) == "vllm":  # vLLM's CPU build
            from verl_patches.vllm_cpu import WORKER_ENV

            for key, value in WORKER_ENV.items():
                env_vars.setdefault(key, os.environ.get(key, value))
            # verl's replica places its server workers in a resource pool of "GPUs": logical, one a slot
            if not joins_cluster:
                kwargs.setdefault("num_gpus", int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node))
        if not joins_cluster:
            kwargs.setdefault("num_cpus", max(16, os.cpu_count() or 1))  # logical: stages mostly wait
    if not joins_cluster:
        kwargs.setdefault("include_dashboard", False)
    runtime_env = {k: v for k, v in kwargs.get("runtime_env", {}).items() if v is not None}
    kwargs["runtime_env"] = {**runtime_env, "env_vars": env_vars}
    return kwargs


def count_rows(files) -> int:
    """Rows in the parquet training files (before verl's length filter)."""
    import pyarrow.parquet as pq

    paths = list(files) if isinstance(files, (list, tuple)) or OmegaConf.is_list(files) else [files]
    return sum(pq.ParquetFile(str(p)).metadata.num_rows for p in paths)


def total_training_steps(config: DictConfig, train_rows: int) -> int:
    steps = config.trainer.get("total_training_steps")
    if steps:
        return int(steps)
    return int(config.trainer.total_epochs) * (train_rows // int(config.data.train_batch_size))


OUTPUT_DIR_KEYS = ("trainer.default_local_dir", "trainer.rollout_data_dir", "trainer.validation_data_dir")


def resolve_output_dirs(config: DictConfig) -> None:
    """Relative output directories are the driver's (its working directory), not each actor's."""
    from omegaconf import open_dict

    for key in OUTPUT_DIR_KEYS:
        value = OmegaConf.select(config, key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            parent, _, leaf = key.rpartition(".")
            with open_dict(config):
                OmegaConf.select(config, parent)[leaf] = os.path.abspath(value)


def set_optimizer_horizon(config: DictConfig, total_steps: int) -> None:
    """As verl's trainer: the optimizer's `total_training_steps` (lr warmup / decay schedules) is the run's."""
    from omegaconf import open_dict

    with open_dict(config):
        config.actor_rollout_ref.actor.optim.total_training_steps = total_steps
        if OmegaConf.select(config, "critic.optim") is not None:
            config.critic.optim.total_training_steps = total_steps
