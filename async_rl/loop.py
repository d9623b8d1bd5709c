"""The driver's loop while the stages train: start every stage's `run()`, log each training step
through verl's `Tracking`, validate every `trainer.test_freq` steps, and stop the run on the first
stage error, when no step completes within `trainer.async_stall_timeout_s`, or on a stop signal
(the running step finishes and the last completed one is saved)."""

from __future__ import annotations

import signal
import time

import ray
from tqdm import tqdm

from async_rl.build import BuiltPipeline
from async_rl.core.errors import PipelineError
from async_rl.core.stage_table import ACTOR_TRAIN, CRITIC_TRAIN, GENERATE, PARAM_UPDATE
from async_rl.core.timeouts import CALL_TIMEOUT_S, SETUP_TIMEOUT_S
from async_rl.stop_signals import TEARDOWN_RESERVE_S, PipelinePreempted

FAILURE_READ_TIMEOUT_S = 10.0  # after a stage failed, reading the steps finished before it may take this long
DEAD_STAGE_GRACE_S = 2.0  # after a stage failed, the wait for a dead neighbour's run to fail too


class TrainingLoop:
    """Trains a built pipeline to the end; `history` is every logged step's metrics.

    Args:
        tracking: verl's Tracking (`log(data, step)`).
        restarts: the driver's restarts before this run (logged as `async/faults/pipeline_restarts`).
    """

    def __init__(self, built: BuiltPipeline, tracking, restarts: int = 0):
        self.built, self.tracking, self.restarts = built, tracking, restarts
        self.stages = built.stages
        self.names = tuple(built.run.edges)
        self.history: list[dict] = []
        self._unlogged: list[dict] = []  # steps waiting for their critic update's metrics
        self._critic_metrics: dict[int, dict] = {}
        self._last_stats: dict = {}

    def run(self) -> list[dict]:
        """Validate first (verl's `val_before_train`), train every step, validate last; raises PipelineError
        naming the failed stage, PipelinePreempted on a stop signal."""
        cfg, built = self.built.run.config, self.built
        test_freq = int(cfg.trainer.get("test_freq", -1) or -1)
        built.raise_if_stopping("before training")
        if cfg.trainer.get("val_before_train", True):
            self.validate(step=built.start_step)
            if cfg.trainer.get("val_only", False):  # as verl's trainer: validate the initial policy, train nothing
                return self.history
        runs = {self.stages[n].run.remote(): n for n in self.names}
        built.training = True
        self.busy_ratios()
        step, last_progress = built.start_step, time.monotonic()
        last_sync: dict = {}  # the newest completed weight sync's timings, logged with each step
        progress = tqdm(total=built.run.total_steps, initial=built.start_step, desc="async-rl", unit="step",
                        dynamic_ncols=True)
        pending = list(runs)
        while pending:
            if built.stop.requested:
                progress.close()
                self.checkpoint_and_stop()
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            for ref in done:
                try:
                    ray.get(ref, timeout=CALL_TIMEOUT_S)
                except ray.exceptions.RayError as exc:
                    progress.close()
                    stage, exc = blame_stage(runs, ref, exc, pending)
                    self.log_steps_left()
                    raise PipelineError(f"pipeline stopped because stage '{stage}' failed:\n{_cause(exc)}") from exc
            new_steps = self.completed_steps(final=not pending)
            if new_steps:
                sync_timings = ray.get(self.stages[PARAM_UPDATE].pop_timings.remote(), timeout=CALL_TIMEOUT_S)
                if sync_timings:
                    version = max(sync_timings)
                    last_sync = {**sync_timings[version], "async/param_update/synced_version": float(version)}
                shared = self.busy_ratios()
                shared.update(ray.get(self.stages[GENERATE].fault_counts.remote(), timeout=CALL_TIMEOUT_S))
                shared.update(built.run.placement.metrics())
                for metrics in new_steps:
                    step = int(metrics["training/global_step"])
                    self.log({**metrics, **shared, **last_sync}, step)
                    progress.update(1)
                    progress.set_postfix(score=f"{metrics.get('critic/score/mean', float('nan')):.3f}",
                                         stale=int(metrics["async/staleness/max"]))
                    if test_freq > 0 and step % test_freq == 0 and step < built.run.total_steps:
                        self.validate(step)
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > built.run.async_cfg.stall_timeout_s:
                states = built.wait({n: self.stages[n].stats.remote() for n in self.names}, CALL_TIMEOUT_S,
                                    "read stage stats")
                trace = built.run.async_cfg.trace_path
                where = f"; the timeline so far: {trace}/trace.json and report.html" if trace else ""
                raise PipelineError(f"no training step completed for {built.run.async_cfg.stall_timeout_s:g} s "
                                    f"(trainer.async_stall_timeout_s); stage states: {states}{where}")
        progress.close()
        if built.stop.requested:  # every step trained before the stop came round: saved at the end, as verl saves
            return self.history
        if test_freq > 0 or cfg.trainer.get("val_before_train", True):
            self.validate(step)
        return self.history

    def log(self, metrics: dict, step: int) -> None:
        if self.restarts:
            metrics["async/faults/pipeline_restarts"] = float(self.restarts)
        self.history.append({"step": step, **metrics})
        self.tracking.log(data=metrics, step=step)

    def busy_ratios(self) -> dict[str, float]:
        """Each stage's busy share of the wall time since the last call (`async/<stage>/busy_ratio`)."""
        stats = self.built.wait({n: self.stages[n].stats.remote() for n in self.names}, CALL_TIMEOUT_S,
                                "read stage stats")
        ratios = {}
        for name, s in stats.items():
            prev = self._last_stats.get(name, {"busy_s": 0.0, "wall_s": 0.0})
            wall = s["wall_s"] - prev["wall_s"]
            ratios[f"async/{name}/busy_ratio"] = (s["busy_s"] - prev["busy_s"]) / wall if wall > 0 else 0.0
        self._last_stats.update(stats)
        return ratios

    def validate(self, step: int) -> None:
        """Validate through the rollout servers and log it with the served version (`val-aux/param_version`)."""
        version = ray.get(self.built.clock.handle.versions.remote(), timeout=CALL_TIMEOUT_S)["served_version"]
        metrics = self.built.validator.run(timeout_s=SETUP_TIMEOUT_S, step=step)
        self.log({**metrics, "val-aux/param_version": float(version)}, step)

    def completed_steps(self, final: bool = False, timeout_s: float = CALL_TIMEOUT_S) -> list[dict]:
        """Metrics of the steps done since the last call, in order. With a critic a step is done once
        its critic update is too (its `critic/*` metrics join the actor's); `final`: every step left."""
        steps = ray.get(self.stages[ACTOR_TRAIN].pop_metrics.remote(), timeout=timeout_s)
        if not self.built.run.critic:
            return steps
        self._unlogged.extend(steps)
        self._critic_metrics.update(ray.get(self.stages[CRITIC_TRAIN].pop_metrics.remote(), timeout=timeout_s))
        done = []
        while self._unlogged and (final or int(self._unlogged[0]["training/global_step"]) in self._critic_metrics):
            metrics = self._unlogged.pop(0)
            metrics.update(self._critic_metrics.pop(int(metrics["training/global_step"]), {}))
            done.append(metrics)
        return done

    def log_steps_left(self) -> None:
        """Log the steps the trainer finished before a stage failed or a stop signal (it may have
        checkpointed them, and a restart then goes on after them). Best effort: the trainer may be
        what failed."""
        try:
            steps = self.completed_steps(final=True, timeout_s=FAILURE_READ_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the failure itself is what gets raised
            return
        for metrics in steps:
            self.log(metrics, int(metrics["training/global_step"]))

    def checkpoint_and_stop(self) -> None:
        """On a stop signal: the running step finishes, the last completed one is saved, both within
        `trainer.stop_deadline_s` less the teardown's share; raises PipelinePreempted."""
        signum = self.built.stop.signum
        budget_s = max(1.0, self.built.stop.seconds_left() - TEARDOWN_RESERVE_S)
        ref = self.stages[ACTOR_TRAIN].checkpoint_and_stop.remote()
        try:
            saved = ray.get(ref, timeout=budget_s)
        except ray.exceptions.GetTimeoutError:
            raise PipelinePreempted(signum, None, f"the running step and its checkpoint did not end within "
                                                  f"{budget_s:.0f} s (trainer.stop_deadline_s), abandoned") from None
        except ray.exceptions.RayError as exc:
            raise PipelineError(f"saving the checkpoint on {signal.Signals(signum).name} failed:\n{_cause(exc)}") from exc
        self.log_steps_left()  # the step just saved: a resume goes on after it
        raise PipelinePreempted(signum, saved)


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
