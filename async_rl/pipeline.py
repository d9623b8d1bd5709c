r"""The pipeline driver: runs the built stages, watches them, tears everything down.

    dataloader -> generate -> rollout -> reward ---\
                                      -> logp ------> actor_train -> param_update
                                      -> ref_logp --/       (weights -> rollout servers, logp)
                                      -> values ---/  \-> critic_train (with a critic: PPO with GAE)

The driver validates the pipeline's keys before Ray starts (async_rl/run_config.py), builds
the stages as Ray actors (async_rl/pipeline_build.py), starts every stage's `run()`, logs
each training step through verl's `Tracking`, validates every `trainer.test_freq` steps,
and stops the whole run (all actors, Ray) on the first stage error or when no step
completes within `trainer.async_stall_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf, open_dict

from async_rl.checkpoints import read_checkpoint_config
from async_rl.config import critic_enabled, strip_async_keys
from async_rl.pipeline_build import CALL_TIMEOUT_S, SETUP_TIMEOUT_S, PipelineBuild, PipelineError
from async_rl.replica_supervisor import kill_actor
from async_rl.run_config import (
    count_rows,
    resolve_output_dirs,
    set_optimizer_horizon,
    total_training_steps,
    validate_pipeline_config,
)
from async_rl.stage_graph import build_edges
from async_rl.stop_signals import STOP_BUDGET_S, PipelinePreempted, stop_signals_caught

logger = logging.getLogger(__name__)

FAILURE_READ_TIMEOUT_S = 10.0  # after a stage failed, reading the steps finished before it may take this long
CLOSE_TIMEOUT_S = 10.0  # at shutdown, unlinking the weight sync's shared-memory files may take this long
DEAD_STAGE_GRACE_S = 2.0  # after a stage failed, the wait for a dead neighbour's run to fail too


class AsyncPipeline(PipelineBuild):
    """Builds and runs the async pipeline for one verl config."""

    def __init__(self, config: DictConfig, tracking=None, restarts: int = 0):
        """``tracking``: verl's Tracking to log to, else one of its own, finished at shutdown unless
        `trainer.max_restarts` lets the driver restart (it then spans the runs and the driver finishes
        it). ``restarts``: the driver's restarts before this run (logged)."""
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

            if str(self.config.trainer.device) == "cpu":  # vLLM's CPU build: no sleep mode
                from verl_patches.vllm_cpu import cpu_rollout_overrides

                cpu_rollout_overrides(self.config.actor_rollout_ref.rollout)

            use_staged_checkpoint_engine(
                self.config, self.async_cfg.consume_bucket_size_mb, self.async_cfg.enable_dual_buffer
            )
        self._stop_request = None
        self._training = False  # the stages' loops run
        self.stages: dict[str, Any] = {}
        self.replicas: list = []
        self.node_groups: tuple = ()  # one Ray placement group per job node (async_rl/resources.py)
        self.stage_nodes: dict[str, str] = {}  # stage -> the Ray node id its actor is placed on
        self.receivers: list = []  # weight receivers (param_update/overlapped.py)
        self.tracking = tracking
        self._finish_tracking = tracking is None and not self.async_cfg.max_restarts
        self.restarts = restarts
        self.validator = None
        self.history: list[dict] = []  # every logged step's metrics (tests and benches read it)
        self._unlogged: list[dict] = []  # steps waiting for their critic update's metrics
        self._critic_metrics: dict[int, dict] = {}
        self.critic = critic_enabled(self.config)
        self.edges = build_edges(self.async_cfg.user_stages, self.async_cfg.dynamic_sampling, self.critic)
        self.placement = self.plan_placement()
        self.stage_names = tuple(self.edges)

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
        if self.restarts:
            metrics["async/faults/pipeline_restarts"] = float(self.restarts)
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

    def _validate(self, step: int) -> None:
        """Validate through the rollout servers and log it with the served version (`val-aux/param_version`)."""
        version = ray.get(self.stages["generate"].served_version.remote(), timeout=CALL_TIMEOUT_S)
        metrics = self.validator.run(timeout_s=SETUP_TIMEOUT_S, step=step)
        self._log({**metrics, "val-aux/param_version": float(version)}, step)

    def run(self, after_training=None) -> list[dict]:
        """Train to the end; returns every logged step's metrics. Raises PipelineError on failure.

        `after_training(pipeline)`, if given, runs once training is done, before the actors go.
        """
        self._start_ray()
        try:
            with stop_signals_caught() as stop:  # after ray.init, which installs its own SIGTERM handler
                self._stop_request = stop
                self.build()
                if self.tracking is None:
                    self.tracking = self._make_tracking()
                self._loop()
                if after_training is not None:
                    after_training(self)
        finally:
            self.shutdown()
        return self.history

    def weight_digests(self) -> dict[str, dict[str, str]]:
        """Per-tensor digests of the weights held by the trainer, the logp workers (when they
        compute) and every rollout server (name -> digest): equal digests mean bit-identical weights.
        verl's vLLM replicas are read through param_update/vllm_digests.py (its conditions there)."""
        calls = {"actor_train": self.stages["actor_train"].weight_digests.remote()}
        if self.proximal_logp_workers() == "logp":
            calls["logp"] = self.stages["logp"].weight_digests.remote()
        rollout = str(self.config.actor_rollout_ref.rollout.name)
        # each replica's current server, a restarted one included
        handles = ray.get(self.stages["generate"].server_handles.remote(), timeout=CALL_TIMEOUT_S)
        if rollout == "cpu":
            calls.update({f"rollout_server_{i}": handle.weight_digests.remote() for i, handle in enumerate(handles)})
        digests = self._wait(calls, CALL_TIMEOUT_S, "read weight digests")
        if rollout == "vllm":
            from param_update.vllm_digests import replica_weight_digests

            async def read_all():  # gather needs the running loop
                reads = asyncio.gather(*(replica_weight_digests(h) for h in handles))
                return await asyncio.wait_for(reads, CALL_TIMEOUT_S)

            digests.update({f"rollout_replica_{i}": d for i, d in enumerate(asyncio.run(read_all()))})
        return digests

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
                    progress.close()
                    stage, exc = blame_stage(runs, ref, exc, pending)
                    self._log_steps_left()
                    raise PipelineError(f"pipeline stopped because stage '{stage}' failed:\n{_cause(exc)}") from exc
            new_steps = self._completed_steps(final=not pending)
            if new_steps:
                sync_timings = ray.get(self.stages["param_update"].pop_timings.remote(), timeout=CALL_TIMEOUT_S)
                if sync_timings:
                    version = max(sync_timings)
                    last_sync = {**sync_timings[version], "async/param_update/synced_version": float(version)}
                busy = self._busy_ratios(last_stats)
                busy.update(ray.get(self.stages["generate"].fault_counts.remote(), timeout=CALL_TIMEOUT_S))
                busy.update(self.placement.metrics())
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

    def _log_steps_left(self) -> None:
        """Log the steps the trainer finished before a stage failed or a stop signal (it may have
        checkpointed them, and a restart then goes on after them). Best effort: the trainer may be
        what failed."""
        try:
            steps = self._completed_steps(final=True, timeout_s=FAILURE_READ_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the failure itself is what gets raised
            return
        for metrics in steps:
            self._log(metrics, int(metrics["training/global_step"]))

    def _completed_steps(self, final: bool = False, timeout_s: float = CALL_TIMEOUT_S) -> list[dict]:
        """Metrics of the steps done since the last call, in order. With a critic a step is done once
        its critic update is too (its `critic/*` metrics join the actor's); `final`: every step left."""
        steps = ray.get(self.stages["actor_train"].pop_metrics.remote(), timeout=timeout_s)
        if not self.critic:
            return steps
        self._unlogged.extend(steps)
        self._critic_metrics.update(ray.get(self.stages["critic_train"].pop_metrics.remote(), timeout=timeout_s))
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
        self._log_steps_left()  # the step just saved: a resume goes on after it
        raise PipelinePreempted(signum, saved)

    def shutdown(self) -> None:
        """Unlink the weight sync's shared memory, kill every stage (their worker groups and servers go with
        them) and stop Ray if we started it."""
        if "actor_train" in self.stages:
            try:
                ray.get(self.stages["actor_train"].close_weight_sender.remote(), timeout=CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - best effort: a dead sender's files go at the next run's start
                logger.warning("the weight sync's shared-memory files were not unlinked; the next run removes them")
        for actor in [*self.stages.values(), *(s for r in self.replicas for s in getattr(r, "servers", []))]:
            kill_actor(actor)
        if self.node_groups and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            for group in self.node_groups:
                _quietly(remove_placement_group, group)
        if self.tracking is not None and self._finish_tracking and hasattr(self.tracking, "finish"):
            _quietly(self.tracking.finish)
        if getattr(self, "_owns_ray", False) and ray.is_initialized():
            ray.shutdown()


def _quietly(call, *args, **kwargs) -> None:
    """Best effort on teardown: an actor or group already gone is what we wanted."""
    try:
        call(*args, **kwargs)
    except Exception:  # noqa: BLE001
        pass


def blame_stage(runs: dict, failed_ref, exc: BaseException, pending: list) -> tuple[str, BaseException]:
    """The stage to name for a failure: the one whose own actor died (its `run` call fails with
    RayActorError) rather than the neighbour that failed first because it could not reach it; waits up
    to DEAD_STAGE_GRACE_S for the dead one's `run` to fail too. `runs`: run ObjectRef -> stage name."""
    if isinstance(exc, ray.exceptions.RayActorError) or not pending:
        return runs[failed_ref], exc
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=DEAD_STAGE_GRACE_S)
    for ref in done:
        try:
            ray.get(ref, timeout=DEAD_STAGE_GRACE_S)
        except ray.exceptions.RayActorError as died:
            return runs[ref], died
        except Exception:  # noqa: BLE001 - another stage failing the same way: keep the first
            pass
    return runs[failed_ref], exc


def _cause(exc: BaseException) -> str:
    """The deepest useful message of a Ray error (the StageError text)."""
    cause = getattr(exc, "cause", None)
    return str(cause) if cause is not None else str(exc)


def run_async_pipeline(config: DictConfig, task_runner_class=None) -> None:
    """Drop-in for verl's `run_ppo(config, task_runner_class)` when async_pipeline=True.

    A stage failing mid-run (after training started) restarts the whole pipeline from the newest
    checkpoint in `trainer.default_local_dir` (from the start if there is none), up to
    `trainer.max_restarts` times, each logged with its cause; the metrics go on in one Tracking.
    A stop signal ends the process with 128 + its number once the checkpoint is saved."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    pipeline, restarts = None, 0
    try:
        while True:
            # with restarts allowed, one Tracking (one metrics file) spans the runs; finished below
            pipeline = AsyncPipeline(config, tracking=pipeline.tracking if pipeline else None, restarts=restarts)
            max_restarts = pipeline.async_cfg.max_restarts
            try:
                pipeline.run()
                return
            except PipelineError as failure:
                if not pipeline._training or restarts >= max_restarts:
                    if max_restarts and pipeline._training:
                        raise PipelineError(f"{failure}\n(after {restarts} restarts: trainer.max_restarts="
                                            f"{max_restarts} used up)") from failure
                    raise
                restarts += 1
                newest = find_latest_ckpt_path(pipeline.checkpoint_cfg.root)
                if newest:  # else the run starts over as it first did (its own resume settings)
                    config = config.copy()
                    with open_dict(config.trainer):
                        config.trainer.resume_mode = "auto"  # the newest checkpoint this run wrote
                why = " ".join(str(failure).split())[:500]
                message = (f"async_rl: restart {restarts} of {max_restarts} (trainer.max_restarts) from "
                           f"{newest or 'where the run started (no checkpoint written yet)'} after: {why}")
                logger.warning("%s\n%s", message, failure)
                print(message, flush=True)
    except PipelinePreempted as stopped:
        logger.warning("%s", stopped)
        print(f"async_rl: {stopped}", flush=True)
        raise SystemExit(stopped.exit_code) from None
    finally:
        if pipeline is not None and pipeline.async_cfg.max_restarts and hasattr(pipeline.tracking, "finish"):
            pipeline.tracking.finish()
