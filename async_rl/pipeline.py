r"""The async pipeline's driver, top to bottom: read the config once, start Ray, place the run on
the job's nodes, build the stages, start the weight sync, resume, train, stop.

    dataloader -> generate -> rollout -> reward ---\
                                      -> logp ------> actor_train -> param_update
                                      -> ref_logp --/       (weights -> rollout servers, logp)
                                      -> values ---/  \-> critic_train (with a critic: PPO with GAE)

`run_async_pipeline(config)` is what `python -m verl.trainer.main_ppo ... +actor_rollout_ref.async_pipeline=True`
runs (async_rl/plugin.py); it restarts a run whose stage failed mid-run from its newest
checkpoint, up to `trainer.max_restarts` times.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Optional, TypeVar

import psutil
import ray
from omegaconf import DictConfig, OmegaConf
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.utils.tracking import Tracking

from async_rl.build import BuiltPipeline, build_stages, place, resume, shutdown, start_weight_sync
from async_rl.core.config import runs_on_cpu
from async_rl.core.errors import PipelineError
from async_rl.loop import TrainingLoop
from async_rl.run_config import RunConfig, ray_init_kwargs, read_run_config
from async_rl.run_trace import start_trace, write_run_report, write_run_trace
from async_rl.stop_signals import (PipelinePreempted, kill_ray_processes, ray_processes, sigterm_blocked,
                                   stop_signals_caught)
from verl_patches.cpu_patches import apply_cpu_driver_patches, set_engine_device_env, use_cpu_platform
from verl_patches.tensordict_threads import patch_per_thread_device_recorder

logger = logging.getLogger(__name__)

RAY_EXIT_WAIT_S = 5.0  # after ray.shutdown and the SIGKILL of what is left, the wait until all are gone
# ray.init gives up when its new node has not registered within 30 s (hard-coded in ray._private.node), which
# a loaded machine can exceed (e.g. a run's own Ray on 2 cores beside other Ray clusters): the start
# is tried again, what the failed one started killed first. Ray raises a bare Exception, told by its text.
RAY_START_ATTEMPTS = 3
RAY_START_TIMED_OUT = "timed out during startup"

T = TypeVar("T")


def run_pipeline(run: RunConfig, tracking=None, restarts: int = 0,
                 after_training: Optional[Callable[[BuiltPipeline], None]] = None) -> list[dict]:
    """Train `run` to the end, logging to `tracking` (verl's Tracking; None: one of its own, finished at
    the end); returns every logged step's metrics. `after_training(built)` runs once training is done,
    before the actors go. Raises PipelineError (`during_training`: the stages had started) or
    PipelinePreempted."""
    own_tracking = tracking is None
    tracking = make_tracking(run.config) if own_tracking else tracking
    owns_ray, env_vars = start_ray(run.config)
    built = BuiltPipeline(run, env_vars=env_vars)
    try:
        # after ray.init, which installs its own SIGTERM handler
        with stop_signals_caught(run.async_cfg.stop_deadline_s) as built.stop:
            place(built)
            build_stages(built)
            start_trace(built)
            start_weight_sync(built)
            resume(built)
            history = TrainingLoop(built, tracking, restarts).run()
            if after_training is not None:
                after_training(built)
            timeline = run.config.ray_kwargs.get("timeline_json_file")
            if timeline:  # as verl's run_ppo: Ray's timeline of the run's tasks, once it trained
                ray.timeline(filename=timeline)
            return history
    except PipelineError as failure:
        failure.during_training = built.training
        raise
    except KeyboardInterrupt:
        if built.stop is None or not built.stop.requested:
            raise
        raise PipelinePreempted(built.stop.signum, None, "a second signal stopped it at once") from None
    finally:
        if built.stages:
            write_run_trace(built, attempt=restarts)
        started = ray_processes() if owns_ray else []  # before the actors go: their children are still theirs
        shutdown(built)
        if owns_ray:
            stop_ray(started)
        write_run_report(built, tracking)  # after the teardown: its time is not the stop deadline's
        if built.stop is not None:
            built.stop.cancel()
        if own_tracking:
            tracking.finish()


def run_async_pipeline(config, task_runner_class=None) -> None:
    """Drop-in for verl's `run_ppo(config, task_runner_class)` when async_pipeline=True (`config`: a verl
    config, or the RunConfig the plugin read from it).

    A stage failing mid-run (after training started) restarts the whole pipeline from the newest
    checkpoint in `trainer.default_local_dir` (from the start if there is none), up to
    `trainer.max_restarts` times, each logged with its cause; the metrics go on in one Tracking.
    A stop signal ends the process with 128 + its number once the checkpoint is saved."""
    run = config if isinstance(config, RunConfig) else read_run_config(config)
    max_restarts = run.async_cfg.max_restarts
    tracking = make_tracking(run.config)
    restarts = 0
    try:
        while True:
            try:
                run_pipeline(run, tracking, restarts)
                return
            except PipelineError as failure:
                if not failure.during_training or restarts >= max_restarts:
                    if max_restarts and failure.during_training:
                        raise PipelineError(f"{failure}\n(after {restarts} restarts: trainer.max_restarts="
                                            f"{max_restarts} used up)") from failure
                    raise
                restarts += 1
                newest = find_latest_ckpt_path(run.checkpoint.root)
                if newest:  # else the run starts over as it first did (its own resume settings)
                    run = run.resumed()
                why = " ".join(str(failure).split())[:500]
                message = (f"async_rl: restart {restarts} of {max_restarts} (trainer.max_restarts) from "
                           f"{newest or 'where the run started (no checkpoint written yet)'} after: {why}")
                logger.warning("%s\n%s", message, failure)
                print(message, flush=True)
    except PipelinePreempted as stopped:
        root = getattr(run.checkpoint, "root", None)
        newest = find_latest_ckpt_path(root) if root else None
        resume = f"a resume starts after {newest}" if newest else "no checkpoint: a resume starts from the beginning"
        logger.warning("%s; %s", stopped, resume)
        print(f"async_rl: {stopped}; {resume}", flush=True)
        raise SystemExit(stopped.exit_code) from None
    finally:
        tracking.finish()


def start_ray(config: DictConfig) -> tuple[bool, dict]:
    """Ray for the run: joins the one this process already started, else starts one
    (`ray_init_kwargs`). Returns (whether it started Ray, the env vars every process of the run gets)."""
    patch_per_thread_device_recorder()  # the driver calls worker groups from threads too (checkpoints)
    if runs_on_cpu(config):
        use_cpu_platform()
        set_engine_device_env()
        apply_cpu_driver_patches()
    kwargs = ray_init_kwargs(config)
    env_vars = kwargs["runtime_env"]["env_vars"]
    if "LOG_LEVEL" in env_vars:  # the driver too: it imports vLLM's API server when it starts a reward model on
        os.environ.setdefault("LOG_LEVEL", env_vars["LOG_LEVEL"])  # vLLM, which would silence its warnings
    owns = not ray.is_initialized()
    if owns:
        init_ray(kwargs)
    return owns, env_vars


def init_ray(kwargs: dict, attempts: int = RAY_START_ATTEMPTS) -> None:
    """`ray.init(**kwargs)` with SIGTERM blocked (Ray's processes and all they start ignore a scheduler's
    SIGTERM: stop_signals), started again when Ray's node did not start in time (`retry_ray_start`)."""

    def start() -> None:
        with sigterm_blocked():
            ray.init(**kwargs)

    retry_ray_start(start, attempts)


def retry_ray_start(start: Callable[[], T], attempts: int = RAY_START_ATTEMPTS) -> T:
    """`start()`, a start of Ray in this process (`ray.init`, a test's `Cluster`). When Ray's node did not
    start in time, the processes that start left are killed and `start()` runs again, `attempts` times in
    all; any other error is raised at once."""
    for attempt in range(1, attempts):
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        try:
            return start()
        except Exception as exc:
            if RAY_START_TIMED_OUT not in str(exc):
                raise
            left = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
            print(f"async_rl: Ray's node did not start in time ({exc}); killed the {len(left)} processes it left, "
                  f"starting Ray again (attempt {attempt + 1} of {attempts})", flush=True)
            kill_ray_processes(left)
            psutil.wait_procs(left, timeout=RAY_EXIT_WAIT_S)
            ray.shutdown()
    return start()  # the last attempt: any error is raised


def stop_ray(processes: Optional[list] = None) -> None:
    """`ray.shutdown()` of the Ray this process started, then SIGKILL to any of `processes` (default:
    Ray's processes and their descendants now) still alive (the raylet's agents, a killed actor's
    children outlive a raylet that did not stop them); waits up to `RAY_EXIT_WAIT_S` for them to go.
    Without Ray's graceful SIGTERM and one-second wait per process: they have SIGTERM blocked
    (`start_ray`), so Ray's SIGKILL after the wait is what would stop them anyway."""
    if not ray.is_initialized():
        return
    processes = ray_processes() if processes is None else processes
    node = getattr(ray._private.worker, "_global_node", None)
    kill_all = getattr(node, "kill_all_processes", None)
    if kill_all is not None:
        node.kill_all_processes = lambda **kwargs: kill_all(**{**kwargs, "allow_graceful": False})
    ray.shutdown()
    kill_ray_processes(processes)
    psutil.wait_procs(processes, timeout=RAY_EXIT_WAIT_S)


def make_tracking(config: DictConfig) -> Tracking:
    cfg = config.trainer
    return Tracking(project_name=cfg.project_name, experiment_name=cfg.experiment_name,
                    default_backend=list(cfg.logger) if OmegaConf.is_list(cfg.logger) else cfg.logger,
                    config=OmegaConf.to_container(config, resolve=True))
