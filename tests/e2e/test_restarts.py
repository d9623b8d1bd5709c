"""`+trainer.max_restarts=N` end to end: a stage failing mid-run (a raising reward, a SIGKILLed train
rank) restarts the whole pipeline from the newest checkpoint; the lineage and the logged steps have
no gap (the restart loop itself: tests/driver/test_pipeline_restarts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import faults
from conftest import run_verl, step_rows


@pytest.mark.slow
def test_a_stage_failure_mid_run_costs_one_checkpoint(demo_dir, tmp_path, ray_address):
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
             "reward.custom_reward_function.path": str(reward), "+trainer.async_trace_path": str(tmp_path / "trace")}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900, ray_address=ray_address)
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
    # each attempt's timeline and report: the failed one's kept beside the restarted run's
    assert sorted(p.name for p in (tmp_path / "trace").iterdir()) == [
        "report.html", "report_attempt0.html", "trace.json", "trace_attempt0.json"]


@pytest.mark.slow
def test_a_train_rank_sigkilled_mid_run_costs_one_checkpoint_and_no_sample(demo_dir, tmp_path):
    """SIGKILL of the train rank (the demo's only verl worker process) after step 3: the run stops naming
    the stage, restarts from the newest checkpoint, and its lineage trains every step's prompts once;
    every step is logged (the ones finished before the kill included)."""
    import signal
    import time

    from conftest import assert_nothing_left, dumped_step_inputs, expected_step_inputs, read_jsonl, start_verl

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
        ranks = faults.titled_processes(proc.pid, "ray::PipelineWorker")
        assert len(ranks) == 1
        ranks[0].send_signal(signal.SIGKILL)
        assert proc.wait(timeout=600) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "metrics.jsonl.log").read_text()
    assert "async_rl: restart 1 of 1 (trainer.max_restarts) from" in out and "stage 'actor_train' failed" in out
    assert_nothing_left(proc, "after a stage crash, a restart and the run's end")
    logged = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "training/global_step" in r["data"]]
    assert sorted(set(logged)) == list(range(1, steps + 1))
    assert dumped_step_inputs(dumps) == expected_step_inputs(demo_dir, steps)
