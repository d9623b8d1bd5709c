"""The driver's restart loop (`run_async_pipeline`, `trainer.max_restarts=N`): a stage failing mid-run
restarts the whole pipeline from the newest checkpoint, up to N times, logging why; the metrics go on in
one Tracking. Runs are stand-ins (`run_pipeline` monkeypatched); end to end: tests/e2e/test_restarts.py."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

import async_rl.pipeline as pipeline_module
from async_rl.checkpoints import read_checkpoint_config
from async_rl.core.config import AsyncPipelineConfig
from async_rl.core.errors import PipelineError
from async_rl.pipeline import run_async_pipeline
from async_rl.run_config import RunConfig


class FakeTracking:
    finished = 0

    def finish(self):
        FakeTracking.finished += 1


class Runs:
    """Stands in for `run_pipeline`: records each run; `outcomes` says what each does."""

    def __init__(self, outcomes):
        self.outcomes, self.calls = list(outcomes), []

    def __call__(self, run, tracking, restarts=0, after_training=None):
        self.calls.append((run, tracking, restarts))
        outcome = self.outcomes.pop(0)
        if outcome != "ok":
            failure = PipelineError(f"pipeline stopped because stage 'actor_train' failed:\n{outcome}")
            failure.during_training = outcome != "fail at build"
            raise failure
        return []


@pytest.fixture
def fake(monkeypatch):
    FakeTracking.finished = 0
    monkeypatch.setattr(pipeline_module, "make_tracking", lambda config: FakeTracking())
    newest = {"path": "/ckpt/global_step_4"}
    monkeypatch.setattr(pipeline_module, "find_latest_ckpt_path", lambda root: newest["path"])

    def use(outcomes):
        runs = Runs(outcomes)
        monkeypatch.setattr(pipeline_module, "run_pipeline", runs)
        return runs

    return newest, use


def run_config(max_restarts) -> RunConfig:
    config = OmegaConf.create({"trainer": {"resume_mode": "disable", "default_local_dir": "/ckpt"}})
    return RunConfig(config, AsyncPipelineConfig(max_restarts=max_restarts), None, read_checkpoint_config(config),
                     6, False, "train", {}, {}, None)


def test_a_failed_run_restarts_from_the_newest_checkpoint_in_one_tracking(fake, capsys):
    _, use = fake
    runs = use(["rank died", "ok"])
    run_async_pipeline(run_config(2))
    (first, tracking, restarts_0), (second, tracking_2, restarts_1) = runs.calls
    assert first.config.trainer.resume_mode == "disable" and second.config.trainer.resume_mode == "auto"
    assert (restarts_0, restarts_1) == (0, 1) and tracking_2 is tracking
    assert FakeTracking.finished == 1  # one Tracking across the runs, finished once, at the end
    assert "restart 1 of 2 (trainer.max_restarts) from /ckpt/global_step_4 after: pipeline stopped because " \
           "stage 'actor_train' failed: rank died" in capsys.readouterr().out


def test_without_a_checkpoint_the_restart_starts_where_the_run_started(fake, capsys):
    newest, use = fake
    newest["path"] = None
    runs = use(["rank died", "ok"])
    run_async_pipeline(run_config(1))
    assert runs.calls[1][0].config.trainer.resume_mode == "disable"
    assert "from where the run started (no checkpoint written yet)" in capsys.readouterr().out


def test_restarts_used_up_stop_the_run_naming_the_cause_and_the_key(fake):
    _, use = fake
    runs = use(["rank died", "rank died again"])
    with pytest.raises(PipelineError, match=r"(?s)rank died again.*after 1 restarts: trainer.max_restarts=1 used up"):
        run_async_pipeline(run_config(1))
    assert len(runs.calls) == 2 and FakeTracking.finished == 1


def test_no_restart_by_default_or_for_a_failure_before_training(fake):
    _, use = fake
    runs = use(["rank died"])
    with pytest.raises(PipelineError, match="rank died$"):
        run_async_pipeline(run_config(0))
    assert len(runs.calls) == 1
    runs = use(["fail at build"])
    with pytest.raises(PipelineError, match="fail at build$"):
        run_async_pipeline(run_config(3))
    assert len(runs.calls) == 1  # one run each: nothing restarted
