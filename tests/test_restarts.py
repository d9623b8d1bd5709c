"""`+trainer.max_restarts=N`: a stage failing mid-run restarts the whole pipeline from the newest
checkpoint, up to N times, logging why; the metrics go on in one Tracking."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_verl, step_rows
from omegaconf import OmegaConf

import async_rl.pipeline as pipeline_module
from async_rl.pipeline import PipelineError, run_async_pipeline


class FakeTracking:
    finished = 0

    def finish(self):
        FakeTracking.finished += 1


class FakePipeline:
    """Records how the driver builds each run; `outcomes` says what each run does."""

    built: list = []
    outcomes: list = []

    def __init__(self, config, tracking=None, restarts=0):
        self.config, self.restarts = config, restarts
        self.async_cfg = type("A", (), {"max_restarts": int(config.trainer.max_restarts)})()
        self.tracking = tracking or FakeTracking()
        self.checkpoint_cfg = type("C", (), {"root": "/ckpt"})()
        self._training = False
        FakePipeline.built.append(self)

    def run(self):
        outcome = FakePipeline.outcomes.pop(0)
        self._training = outcome != "fail at build"
        if outcome != "ok":
            raise PipelineError(f"pipeline stopped because stage 'actor_train' failed:\n{outcome}")


@pytest.fixture
def fake(monkeypatch):
    FakePipeline.built, FakeTracking.finished = [], 0
    monkeypatch.setattr(pipeline_module, "AsyncPipeline", FakePipeline)
    newest = {"path": "/ckpt/global_step_4"}
    monkeypatch.setattr("verl.utils.checkpoint.checkpoint_manager.find_latest_ckpt_path", lambda root: newest["path"])
    return newest


def config(max_restarts):
    return OmegaConf.create({"trainer": {"max_restarts": max_restarts, "resume_mode": "disable"}})


def test_a_failed_run_restarts_from_the_newest_checkpoint_in_one_tracking(fake, capsys):
    FakePipeline.outcomes = ["rank died", "ok"]
    run_async_pipeline(config(2))
    first, second = FakePipeline.built
    assert first.config.trainer.resume_mode == "disable" and second.config.trainer.resume_mode == "auto"
    assert second.restarts == 1 and second.tracking is first.tracking
    assert FakeTracking.finished == 1  # one Tracking across the runs, finished once, at the end
    assert "restart 1 of 2 (trainer.max_restarts) from /ckpt/global_step_4 after: pipeline stopped because " \
           "stage 'actor_train' failed: rank died" in capsys.readouterr().out


def test_without_a_checkpoint_the_restart_starts_where_the_run_started(fake, capsys):
    fake["path"] = None
    FakePipeline.outcomes = ["rank died", "ok"]
    run_async_pipeline(config(1))
    assert FakePipeline.built[1].config.trainer.resume_mode == "disable"
    assert "from where the run started (no checkpoint written yet)" in capsys.readouterr().out


def test_restarts_used_up_stop_the_run_naming_the_cause_and_the_key(fake):
    FakePipeline.outcomes = ["rank died", "rank died again"]
    with pytest.raises(PipelineError, match=r"(?s)rank died again.*after 1 restarts: trainer.max_restarts=1 used up"):
        run_async_pipeline(config(1))
    assert len(FakePipeline.built) == 2


def test_no_restart_by_default_or_for_a_failure_before_training(fake):
    FakePipeline.outcomes = ["rank died"]
    with pytest.raises(PipelineError, match="rank died$"):
        run_async_pipeline(config(0))
    FakePipeline.outcomes = ["fail at build"]
    with pytest.raises(PipelineError, match="fail at build$"):
        run_async_pipeline(config(3))
    assert len(FakePipeline.built) == 2  # one run each: nothing restarted


@pytest.mark.slow
def test_a_stage_failure_mid_run_costs_one_checkpoint(demo_dir, tmp_path):
    """The reward function raises once, right after step 2's checkpoint is committed; the driver restarts
    the pipeline from it and the run ends at step 6, logging the restart."""
    ckpt = tmp_path / "ckpt"
    raised = tmp_path / "raised_once"
    reward = tmp_path / "reward_raising_once.py"
    reward.write_text(
        "import os\n"
        "from async_rl.demo.reward import compute_score as demo_score\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        f"    if os.path.exists({str(ckpt / 'latest_checkpointed_iteration.txt')!r}) and not os.path.exists({str(raised)!r}):\n"
        f"        open({str(raised)!r}, 'w').close()\n"
        "        raise RuntimeError('injected reward failure')\n"
        "    return demo_score(data_source, solution_str, ground_truth, extra_info)\n"
    )
    extra = {"trainer.total_training_steps": 6, "trainer.save_freq": 2, "trainer.default_local_dir": str(ckpt),
             "trainer.test_freq": -1, "trainer.val_before_train": False, "+trainer.max_restarts": 1,
             "reward.custom_reward_function.path": str(reward)}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900)
    assert code == 0, out[-4000:]
    assert raised.exists()
    assert "async_rl: restart 1 of 1 (trainer.max_restarts) from" in out and "injected reward failure" in out
    restarted_from = int(out.split("async_rl: restart 1 of 1 (trainer.max_restarts) from")[1].split()[0]
                         .rstrip("/").rsplit("global_step_", 1)[1])
    assert restarted_from >= 2
    steps = [r["step"] for r in rows if "training/global_step" in r["data"]]
    assert steps[-1] == 6 and sorted(set(steps)) == list(range(1, 7))
    assert step_rows(rows)[6]["async/faults/pipeline_restarts"] == 1.0  # logged by the restarted run
    assert Path(ckpt / "global_step_6").is_dir()


@pytest.mark.slow
def test_a_train_rank_sigkilled_mid_run_costs_one_checkpoint_and_no_sample(demo_dir, tmp_path):
    """SIGKILL of the train rank (the demo's only verl worker process) after step 3: the run stops naming
    the stage, restarts from the newest checkpoint, and its lineage trains every step's prompts once;
    every step is logged (the ones finished before the kill included)."""
    import signal
    import time

    from conftest import dumped_step_inputs, expected_step_inputs, load_bench, read_jsonl, start_verl

    ckpt, dumps = tmp_path / "ckpt", tmp_path / "dumps"
    steps = 8
    extra = {"trainer.total_training_steps": steps, "trainer.save_freq": 2, "trainer.default_local_dir": str(ckpt),
             "trainer.test_freq": -1, "trainer.val_before_train": False, "+trainer.max_restarts": 1,
             "trainer.rollout_data_dir": str(dumps)}
    proc = start_verl(demo_dir, extra, tmp_path)
    try:
        deadline = time.monotonic() + 400
        while max(step_rows(read_jsonl(tmp_path / "metrics.jsonl")), default=0) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.2)
        ranks = load_bench("faults").titled_processes(proc.pid, "ray::PipelineWorker")
        assert len(ranks) == 1
        ranks[0].send_signal(signal.SIGKILL)
        assert proc.wait(timeout=600) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "metrics.jsonl.log").read_text()
    assert "async_rl: restart 1 of 1 (trainer.max_restarts) from" in out and "stage 'actor_train' failed" in out
    logged = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "training/global_step" in r["data"]]
    assert sorted(set(logged)) == list(range(1, steps + 1))
    assert dumped_step_inputs(dumps) == expected_step_inputs(demo_dir, steps)
