"""The pipeline driver: builds the stages as Ray actors, wires them, runs, watches, tears down.

    dataloader -> generate -> rollout -> reward ---\
                                      -> logp ------> actor_train -> param_update
                                      -> ref_logp --/       (weights -> rollout servers, logp)
                                      -> values ---/  \-> critic_train (with a critic: PPO with GAE)

The driver validates the pipeline's keys before Ray starts, starts every stage's
`run()`, logs each training step through verl's `Tracking`, validates every
`trainer.test_freq` steps, and stops the whole run (all actors, Ray) on the first stage
error or when no step completes within `trainer.async_stall_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from async_rl.checkpoints import read_checkpoint_config
from async_rl.config import AsyncPipelineConfig, critic_enabled, read_async_config, strip_async_keys
from async_rl.config_error import AsyncConfigError
from async_rl.resources import check_cluster_fits, devices_needed, split_world_sizes, total_device_slots
from async_rl.stage_graph import build_edges, upstream_counts
from async_rl.stop_signals import STOP_BUDGET_S, PipelinePreempted, stop_signals_caught

logger = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 120.0


class PipelineError(RuntimeError):
    """The pipeline stopped: a stage failed, stalled, or could not start."""


def validate_pipeline_config(config: DictConfig) -> AsyncPipelineConfig:
    """Everything checkable before Ray starts; raises AsyncConfigError / ValueError naming the key."""
    from async_rl.rollout_backends import check_rollout_name
    from state_machines.reward import overlong_shaping

    async_cfg = read_async_config(config)
    critic_enabled(config)
    read_checkpoint_config(config)
    for spec in async_cfg.user_stages:
        spec.load_class()
    check_rollout_name(config.actor_rollout_ref.rollout.name, config.trainer.device)
    overlong_shaping(config)
    if not async_cfg.partial_rollout and str(config.actor_rollout_ref.rollout.name) != "cpu":
        raise AsyncConfigError(
            "actor_rollout_ref.rollout.partial_rollout", False,
            "True with rollout.name=sglang or vllm (their servers abort requests around a weight load; "
            "waiting for them instead is implemented by the cpu backend only)",
        )
    for key in ("data.train_files", "actor_rollout_ref.model.path"):
        value = OmegaConf.select(config, key)
        paths = list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]
        for path in paths:
            if not path or (not str(path).startswith(("hdfs://", "s3://")) and not os.path.exists(str(path))):
                raise FileNotFoundError(f"{key}={path!r}: no such file or directory")
    if int(config.trainer.get("total_training_steps") or 0) <= 0 and int(config.trainer.total_epochs) <= 0:
        raise ValueError("set trainer.total_training_steps or trainer.total_epochs to a positive number")
    return async_cfg


def ray_init_kwargs(config: DictConfig) -> dict:
    """verl's `ray_kwargs.ray_init` plus what a small CPU machine needs (logical CPUs, no dashboard)."""
    kwargs = OmegaConf.to_container(config.get("ray_kwargs", {}).get("ray_init", {}), resolve=True) or {}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    env_vars = dict(kwargs.get("runtime_env", {}).get("env_vars", {}))
    env_vars.setdefault("TOKENIZERS_PARALLELISM", "false")
    if str(config.trainer.device) == "cpu":
        env_vars.update({"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda"})
        kwargs.setdefault("num_cpus", max(16, os.cpu_count() or 1))  # logical: stages mostly wait
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


class AsyncPipeline:
    """Builds and runs the async pipeline for one verl config."""

    def __init__(self, config: DictConfig):
        self.async_cfg = validate_pipeline_config(config)
        self.config = config.copy()
        strip_async_keys(self.config)
        resolve_output_dirs(self.config)
        self.checkpoint_cfg = read_checkpoint_config(self.config)
        self.total_steps = total_training_steps(self.config, count_rows(self.config.data.train_files))
        self.start_step = 0
        self.resume_point = None
        set_optimizer_horizon(self.config, self.total_steps)
        if self.async_cfg.decoupled_ppo:
            from async_rl.decoupled_ppo import apply_to_config

            apply_to_config(self.config, self.async_cfg.behav_imp_weight_cap)
        if str(self.config.actor_rollout_ref.rollout.name) != "cpu":  # verl's GPU servers load through it
            from param_update.checkpoint_engine import use_staged_checkpoint_engine

            use_staged_checkpoint_engine(
                self.config, self.async_cfg.consume_bucket_size_mb, self.async_cfg.enable_dual_buffer
            )
        self._stop_request = None
        self._training = False  # the stages' loops run
        self.stages: dict[str, Any] = {}
        self.replicas: list = []
        self.receivers: list = []  # weight receivers (param_update/overlapped.py)
        self.tracking = None
        self.validator = None
        self.history: list[dict] = []  # every logged step's metrics (tests and benches read it)
        self._unlogged: list[dict] = []  # steps waiting for their critic update's metrics
        self._critic_metrics: dict[int, dict] = {}
        self.critic = critic_enabled(self.config)
        self.edges = build_edges(self.async_cfg.user_stages, self.async_cfg.dynamic_sampling, self.critic)
        self.stage_names = tuple(self.edges)

    # ---- build ----------------------------------------------------------------------
    def _start_ray(self) -> None:
        if str(self.config.trainer.device) == "cpu":
            from verl_patches.cpu_patches import set_engine_device_env, use_cpu_platform

            use_cpu_platform()
            set_engine_device_env()
        self._ray_kwargs = ray_init_kwargs(self.config)
        if not ray.is_initialized():
            ray.init(**self._ray_kwargs)
            self._owns_ray = True
        else:
            self._owns_ray = False

    def _stage(self, stage_name: str, cls, *args, **kwargs):
        actor_cls = ray.remote(cls).options(
            name=f"async_rl_{stage_name}_{os.getpid()}",
            num_cpus=0,
            max_concurrency=64,
            runtime_env={"env_vars": self._ray_kwargs["runtime_env"]["env_vars"]},
        )
        handle = actor_cls.remote(*args, **kwargs)
        self.stages[stage_name] = handle
        return handle

    def build(self) -> None:
        from state_machines.actor_train import ActorTrainStage
        from state_machines.dataloader import DataloaderStage
        from state_machines.generate import GenerateStage
        from state_machines.logp import LogpStage
        from state_machines.param_update import ParamUpdateStage
        from state_machines.ref_logp import RefLogpStage
        from state_machines.reward import RewardStage
        from state_machines.rollout import RolloutStage
        from verl.trainer.ppo.utils import need_reference_policy
        from verl.utils import hf_tokenizer

        from async_rl.checkpoints import CheckpointDir, RunCheckpointer
        from async_rl.rollout_backends import launch_rollout_replicas, make_rollout_replicas
        from async_rl.validation import Validator

        cfg = self.config
        sizes = split_world_sizes(total_device_slots(cfg), self.async_cfg)
        self.world_sizes = sizes
        tokenizer = hf_tokenizer(cfg.actor_rollout_ref.model.path, trust_remote_code=False)
        replicas = make_rollout_replicas(cfg, generate_slots=sizes["generate"])
        on_cpu = str(cfg.trainer.device) == "cpu"
        proximal = self.proximal_logp_workers()
        needed = devices_needed(sizes, len(replicas), 1 if on_cpu else replicas[0].world_size,
                                need_reference_policy(cfg), proximal == "logp", self.critic)
        check_cluster_fits(needed, on_cpu, ray.cluster_resources())
        self.replicas = launch_rollout_replicas(replicas, cfg.actor_rollout_ref.rollout.name, timeout_s=SETUP_TIMEOUT_S)
        servers = [r.server_handle for r in self.replicas]
        self.validator = Validator(cfg, tokenizer, servers)
        steps = self.total_steps
        eta = self.async_cfg.max_staleness
        rollout_cfg = cfg.actor_rollout_ref.rollout
        resume = self.resume_point = self._find_resume_point(sizes["train"])
        state = resume.state if resume is not None else None
        self.start_step = state.global_step if state is not None else 0

        refill = self.async_cfg.dynamic_sampling  # draws prompts until the training batches are full
        sampling = None
        dataloader = self._stage("dataloader", DataloaderStage, cfg, tokenizer, None if refill else steps,
                                 state.generated_batches if state else 0, state.dataloader_state if state else None)
        generate = self._stage("generate", GenerateStage, servers, rollout_cfg, eta, dynamic_sampling=refill,
                               steps_formed=self.start_step)
        self._stage(
            "rollout", RolloutStage, int(cfg.data.max_prompt_length), int(rollout_cfg.response_length),
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        )
        self._stage("reward", RewardStage, cfg, tokenizer, self.async_cfg.reward_timeout_s)
        if refill:
            from state_machines.dynamic_sampling import DynamicSamplingStage

            sampling = self._stage("dynamic_sampling", DynamicSamplingStage, cfg, eta, steps, generate, dataloader,
                                   self.start_step, state.generated_batches if state else 0,
                                   state.sampling_pool if state else None)
        bucket_bytes = self._check_weight_sync()
        dual = self.async_cfg.enable_dual_buffer
        logp = self._stage("logp", LogpStage, cfg, sizes["logp"], bucket_bytes["consume"], compute=proximal == "logp")
        self._stage("ref_logp", RefLogpStage, cfg, sizes["ref_logp"], need_reference_policy(cfg))
        receivers = self._weight_receivers(logp if proximal == "logp" else None)
        param_update = self._stage("param_update", ParamUpdateStage, receivers, generate)
        critic = None
        if self.critic:
            from state_machines.critic_train import CriticTrainStage
            from state_machines.values import ValuesStage

            critic = self._stage("critic_train", CriticTrainStage, cfg, sizes["critic"], self.start_step)
            self._stage("values", ValuesStage, critic)
        checkpointer = None
        if self.checkpoint_cfg.save_freq > 0:
            CheckpointDir(self.checkpoint_cfg.root).remove_partials()
            checkpointer = RunCheckpointer(self.checkpoint_cfg, steps, dataloader, sampling, critic)
        self._stage("actor_train", ActorTrainStage, cfg, sizes["train"], eta, param_update, bucket_bytes["preduce"],
                    compute_proximal=proximal == "train", start_step=self.start_step, checkpointer=checkpointer,
                    kl_coef=state.kl_coef if state else None, critic_sink=critic)
        for spec in self.async_cfg.user_stages:
            self._stage(spec.name, spec.load_class(), config=cfg, name=spec.name, **spec.kwargs)

        # engines start in parallel; each has its own timeout-bounded wait
        groups = ("actor_train", "logp", "ref_logp") + (("critic_train",) if self.critic else ())
        self._wait({n: self.stages[n].setup.remote() for n in groups}, SETUP_TIMEOUT_S, "start verl worker groups")
        self._configure_receivers(dual, bucket_bytes["consume"])
        self._wire()
        if resume is not None:
            self._load_resume_point(resume)

    def _find_resume_point(self, train_world_size: int):
        """The checkpoint this run continues from (verl's resume_mode rules), or None."""
        from async_rl.checkpoints import find_resume_point

        workers = int(self.config.data.get("dataloader_num_workers", 0) or 0)
        return find_resume_point(self.checkpoint_cfg, train_world_size, workers, self.async_cfg.dynamic_sampling,
                                 self.world_sizes["critic"] if self.critic else None)

    def _load_resume_point(self, resume) -> None:
        """Load the checkpoint into the train ranks and serve its weights before anything generates."""
        from state_machines.param_update import NewWeights

        step = resume.state.global_step
        logger.warning("resuming from %s (step %d, written by %s)", resume.path, step, resume.written_by)
        loads = {"actor_train": self.stages["actor_train"].load_checkpoint.remote(
            resume.path, self.checkpoint_cfg.del_local_after_load)}
        if self.critic:
            loads["critic_train"] = self.stages["critic_train"].load_checkpoint.remote(
                resume.path, self.checkpoint_cfg.del_local_after_load)
        self._wait(loads, SETUP_TIMEOUT_S, f"load the checkpoint {resume.path}")
        self._wait({"param_update": self.stages["param_update"].process_data.remote(NewWeights(step, time.time())),
                    "actor_train": self.stages["actor_train"].send_weights.remote()},
                   SETUP_TIMEOUT_S, f"send the weights of step {step} to the rollout servers")

    def proximal_logp_workers(self) -> str | None:
        """Which workers recompute pi_prox: "train", "logp", or None (verl's bypass mode: none do)."""
        from async_rl.decoupled_ppo import uses_behaviour_as_old

        return None if uses_behaviour_as_old(self.config) else self.async_cfg.proximal_logp_workers

    def _weight_receivers(self, logp) -> list:
        """The weight sync's receivers: every rollout replica, then the logp stage if it computes."""
        from param_update.checkpoint_engine import GPUReplicaReceiver
        from param_update.overlapped import ActorReceiver

        on_cpu = str(self.config.actor_rollout_ref.rollout.name) == "cpu"
        rollout = [
            ActorReceiver(f"rollout_server_{i}", r.server_handle, True) if on_cpu
            else GPUReplicaReceiver(f"rollout_replica_{i}", r)
            for i, r in enumerate(self.replicas)
        ]
        self.receivers = rollout + ([ActorReceiver("logp", logp, False)] if logp is not None else [])
        return self.receivers

    def _configure_receivers(self, dual: bool, consume_bytes: int) -> None:
        """Set every rollout receiver up for the trainer's layout (a mismatch fails here, at start)."""
        from param_update.checkpoint_engine import GPUReplicaReceiver
        from param_update.overlapped import ActorReceiver

        layout = ray.get(self.stages["actor_train"].weight_layout.remote(), timeout=CALL_TIMEOUT_S)
        servers = [r for r in self.receivers if isinstance(r, ActorReceiver) and r.serves_generation]
        partial = self.async_cfg.partial_rollout
        calls = {r.name: r.handle.configure_weight_sync.remote(dual, consume_bytes, layout, partial) for r in servers}
        self._wait(calls, SETUP_TIMEOUT_S, "set up the rollout servers' weight staging")
        gpu = [r for r in self.receivers if isinstance(r, GPUReplicaReceiver)]
        if gpu:
            asyncio.run(asyncio.wait_for(asyncio.gather(*(r.configure(layout, dual) for r in gpu)), SETUP_TIMEOUT_S))

    def _check_weight_sync(self) -> dict[str, int]:
        """Bucket sizes (bytes) after the start-time checks of param_update/capacity.py."""
        from param_update.capacity import check_weight_sync, model_weight_bytes

        store = ray.cluster_resources().get("object_store_memory")
        return check_weight_sync(
            model_weight_bytes(self.config.actor_rollout_ref.model.path),
            self.async_cfg.preduce_bucket_size_mb,
            self.async_cfg.consume_bucket_size_mb,
            self.async_cfg.enable_dual_buffer,
            int(store) if store else None,
        )

    def _wire(self) -> None:
        """Connect every stage to its downstreams (`self.edges`)."""
        upstreams = upstream_counts(self.edges)
        calls = {
            name: self.stages[name].connect.remote([self.stages[d] for d in downstream], upstreams[name])
            for name, downstream in self.edges.items()
        }
        self._wait(calls, CALL_TIMEOUT_S, "wire stages")

    def _wait(self, refs: dict[str, Any], timeout_s: float, what: str) -> dict[str, Any]:
        """Results of `refs` (name -> ObjectRef); PipelineError naming the late or failed ones, PipelinePreempted
        on a stop signal meanwhile."""
        names = list(refs)
        deadline = time.monotonic() + timeout_s
        pending = list(refs.values())
        while pending:
            self._raise_if_stop_requested(f"while waiting to {what}")
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, max(deadline - time.monotonic(), 0)))
            if pending and time.monotonic() >= deadline:
                late = [n for n, r in refs.items() if r in pending]
                raise PipelineError(f"timed out after {timeout_s:g} s waiting to {what}: {late}")
        try:
            return dict(zip(names, ray.get(list(refs.values()), timeout=timeout_s)))
        except ray.exceptions.RayError as exc:
            raise PipelineError(f"failed to {what}: {exc}") from exc

    def _raise_if_stop_requested(self, where: str) -> None:
        """Before training starts a stop signal has nothing to save: stop at once (after, the loop
        stops at a step boundary with a checkpoint)."""
        if self._stop_request is not None and self._stop_request.requested and not self._training:
            raise PipelinePreempted(self._stop_request.signum, None, where)

    # ---- run ------------------------------------------------------------------------
    def _make_tracking(self):
        from verl.utils.tracking import Tracking

        cfg = self.config
        return Tracking(
            project_name=cfg.trainer.project_name,
            experiment_name=cfg.trainer.experiment_name,
            default_backend=list(cfg.trainer.logger) if OmegaConf.is_list(cfg.trainer.logger) else cfg.trainer.logger,
            config=OmegaConf.to_container(cfg, resolve=True),
        )

    def _log(self, metrics: dict, step: int) -> None:
        self.history.append({"step": step, **metrics})
        self.tracking.log(data=metrics, step=step)

    def _busy_ratios(self, last: dict) -> dict[str, float]:
        stats = self._wait({n: self.stages[n].stats.remote() for n in self.stage_names}, CALL_TIMEOUT_S, "read stage stats")
        ratios = {}
        for name, s in stats.items():
            prev = last.get(name, {"busy_s": 0.0, "wall_s": 0.0})
            wall = s["wall_s"] - prev["wall_s"]
            ratios[f"async/{name}/busy_ratio"] = (s["busy_s"] - prev["busy_s"]) / wall if wall > 0 else 0.0
        last.update(stats)
        return ratios

    def _validate(self, step: int) -> dict:
        version = ray.get(self.stages["generate"].served_version.remote(), timeout=CALL_TIMEOUT_S)
        metrics = self.validator.run(timeout_s=SETUP_TIMEOUT_S, step=step)
        metrics["val-aux/param_version"] = float(version)
        self._log(metrics, step)
        return metrics

    def run(self, after_training=None) -> list[dict]:
        """Train to the end; returns every logged step's metrics. Raises PipelineError on failure.

        `after_training(pipeline)`, if given, runs once training is done, before the actors go.
        """
        self._start_ray()
        try:
            with stop_signals_caught() as stop:  # after ray.init, which installs its own SIGTERM handler
                self._stop_request = stop
                self.build()
                self.tracking = self._make_tracking()
                self._loop()
                if after_training is not None:
                    after_training(self)
        finally:
            self.shutdown()
        return self.history

    def weight_digests(self) -> dict[str, dict[str, str]]:
        """Per-tensor digests of the weights held by the trainer, the logp workers (when they
        compute) and every rollout server (name -> digest): equal digests mean bit-identical weights."""
        calls = {"actor_train": self.stages["actor_train"].weight_digests.remote()}
        if self.proximal_logp_workers() == "logp":
            calls["logp"] = self.stages["logp"].weight_digests.remote()
        if str(self.config.actor_rollout_ref.rollout.name) == "cpu":
            calls.update({f"rollout_server_{i}": r.server_handle.weight_digests.remote()
                          for i, r in enumerate(self.replicas)})
        return self._wait(calls, CALL_TIMEOUT_S, "read weight digests")

    def _loop(self) -> None:
        from tqdm import tqdm

        cfg = self.config
        test_freq = int(cfg.trainer.get("test_freq", -1) or -1)
        self._raise_if_stop_requested("before training")
        if cfg.trainer.get("val_before_train", True):
            self._validate(step=self.start_step)
            if cfg.trainer.get("val_only", False):  # as verl's trainer: validate the initial policy, train nothing
                return
        runs = {self.stages[n].run.remote(): n for n in self.stage_names}
        self._training = True
        last_stats: dict = {}
        self._busy_ratios(last_stats)
        step, last_progress = self.start_step, time.monotonic()
        last_sync: dict = {}  # the newest completed weight sync's timings, logged with each step
        progress = tqdm(total=self.total_steps, initial=self.start_step, desc="async-rl", unit="step",
                        dynamic_ncols=True)
        pending = list(runs)
        while pending:
            if self._stop_request.requested:
                progress.close()
                self._checkpoint_and_stop()
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            for ref in done:
                try:
                    ray.get(ref, timeout=CALL_TIMEOUT_S)
                except ray.exceptions.RayError as exc:
                    raise PipelineError(f"pipeline stopped because stage '{runs[ref]}' failed:\n{_cause(exc)}") from exc
            new_steps = self._completed_steps(final=not pending)
            if new_steps:
                sync_timings = ray.get(self.stages["param_update"].pop_timings.remote(), timeout=CALL_TIMEOUT_S)
                if sync_timings:
                    version = max(sync_timings)
                    last_sync = {**sync_timings[version], "async/param_update/synced_version": float(version)}
                busy = self._busy_ratios(last_stats)
                for metrics in new_steps:
                    step = int(metrics["training/global_step"])
                    metrics.update(busy)
                    metrics.update(last_sync)
                    self._log(metrics, step)
                    progress.update(1)
                    progress.set_postfix(score=f"{metrics.get('critic/score/mean', float('nan')):.3f}",
                                         stale=int(metrics["async/staleness/max"]))
                    if test_freq > 0 and step % test_freq == 0 and step < self.total_steps:
                        self._validate(step)
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > self.async_cfg.stall_timeout_s:
                states = self._wait({n: self.stages[n].stats.remote() for n in self.stage_names}, CALL_TIMEOUT_S,
                                    "read stage stats")
                raise PipelineError(
                    f"no training step completed for {self.async_cfg.stall_timeout_s:g} s "
                    f"(trainer.async_stall_timeout_s); stage states: {states}"
                )
        progress.close()
        if test_freq > 0 or cfg.trainer.get("val_before_train", True):
            self._validate(step)

    def _completed_steps(self, final: bool = False) -> list[dict]:
        """Metrics of the steps done since the last call, in order. With a critic a step is done once
        its critic update is too (its `critic/*` metrics join the actor's); `final`: every step left."""
        steps = ray.get(self.stages["actor_train"].pop_metrics.remote(), timeout=CALL_TIMEOUT_S)
        if not self.critic:
            return steps
        self._unlogged.extend(steps)
        self._critic_metrics.update(ray.get(self.stages["critic_train"].pop_metrics.remote(), timeout=CALL_TIMEOUT_S))
        done = []
        while self._unlogged and (final or int(self._unlogged[0]["training/global_step"]) in self._critic_metrics):
            metrics = self._unlogged.pop(0)
            metrics.update(self._critic_metrics.pop(int(metrics["training/global_step"]), {}))
            done.append(metrics)
        return done

    def _checkpoint_and_stop(self) -> None:
        """On a stop signal: the running step finishes, the last completed one is saved; raises PipelinePreempted."""
        signum = self._stop_request.signum
        ref = self.stages["actor_train"].checkpoint_and_stop.remote()
        try:
            saved = ray.get(ref, timeout=STOP_BUDGET_S)
        except ray.exceptions.GetTimeoutError:
            raise PipelinePreempted(signum, None, f"the running step and its checkpoint took over {STOP_BUDGET_S:g} s, "
                                                  "abandoned; the newest earlier checkpoint stands") from None
        except ray.exceptions.RayError as exc:
            raise PipelineError(f"saving the checkpoint on {signal.Signals(signum).name} failed:\n{_cause(exc)}") from exc
        raise PipelinePreempted(signum, saved)

    def shutdown(self) -> None:
        """Kill every stage (their worker groups and servers go with them) and stop Ray if we started it."""
        for handle in list(self.stages.values()):
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass
        for replica in self.replicas:
            for server in getattr(replica, "servers", []):
                try:
                    ray.kill(server, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
        if self.tracking is not None:
            try:
                self.tracking.finish() if hasattr(self.tracking, "finish") else None
            except Exception:  # noqa: BLE001
                pass
        if getattr(self, "_owns_ray", False) and ray.is_initialized():
            ray.shutdown()


def _cause(exc: BaseException) -> str:
    """The deepest useful message of a Ray error (the StageError text)."""
    cause = getattr(exc, "cause", None)
    return str(cause) if cause is not None else str(exc)


def run_async_pipeline(config: DictConfig, task_runner_class=None) -> None:
    """Drop-in for verl's `run_ppo(config, task_runner_class)` when async_pipeline=True.

    A stop signal ends the process with 128 + its number once the checkpoint is saved."""
    try:
        AsyncPipeline(config).run()
    except PipelinePreempted as stopped:
        logger.warning("%s", stopped)
        print(f"async_rl: {stopped}", flush=True)
        raise SystemExit(stopped.exit_code) from None
