"""`+trainer.max_restarts=N` end to end: a stage failing mid-run (a raising reward, a SIGKILLed train
rank) restarts the whole pipeline from the newest checkpoint; the lineage and the logged steps have
no gap (the restart loop itself: tests/driver/test_pipeline_restarts.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from bench import faults
from helpers.lineage import dumped_step_inputs, expected_step_inputs, read_jsonl
from helpers.processes import assert_nothing_left, wait_until
from helpers.rows import step_rows
from helpers.runs import start_verl


def restarted_from(out: str, n: int, of: int) -> int:
    """The step of the checkpoint that restart `n` of `of` started from, read from its log line."""
    head = f"async_rl: restart {n} of {of} (trainer.max_restarts) from"
    assert head in out, f"no {head!r} in the log"
    return int(out.split(head, 1)[1].split()[0].rstrip("/").rsplit("global_step_", 1)[1])


@pytest.mark.slow
def test_a_raising_reward_then_a_sigkilled_train_rank_each_cost_one_checkpoint_and_no_sample(demo_dir, tmp_path):
    """Two stage failures in one run with `trainer.max_restarts=2`: the reward function raises once right
    after the first checkpoint, then, once the restarted run has trained a step, the train rank (the demo's
    only verl worker process) is SIGKILLed. Each restarts the pipeline from the newest checkpoint, logged
    with its cause; the run ends at its last step with every step logged, each step's prompts trained once
    in the final lineage, each failed attempt's timeline and report kept, and nothing of the run left."""
    ckpt, dumps, trace = tmp_path / "ckpt", tmp_path / "dumps", tmp_path / "trace"
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
    steps = 8
    extra = {"trainer.total_training_steps": steps, "trainer.save_freq": 2, "trainer.default_local_dir": str(ckpt),
             "trainer.test_freq": -1, "trainer.val_before_train": False, "+trainer.max_restarts": 2,
             "reward.custom_reward_function.path": str(reward), "+trainer.async_trace_path": str(trace),
             "trainer.rollout_data_dir": str(dumps)}
    log, metrics = tmp_path / "metrics.jsonl.log", tmp_path / "metrics.jsonl"
    proc = start_verl(demo_dir, extra, tmp_path)
    try:
        # the first fault: the reward raises once the first checkpoint is committed
        wait_until(lambda: "async_rl: restart 1 of 2 (trainer.max_restarts) from" in log.read_text(), proc,
                   "the first restart (the raising reward)", timeout_s=600)
        # the second: once the restarted run has logged a step, SIGKILL of the train rank
        wait_until(lambda: any(r["data"].get("async/faults/pipeline_restarts") == 1.0
                               for r in read_jsonl(metrics) if "training/global_step" in r["data"]), proc,
                   "a step of the restarted run", timeout_s=400)
        ranks = faults.titled_processes(proc.pid, "ray::PipelineWorker")
        assert len(ranks) == 1
        ranks[0].send_signal(signal.SIGKILL)
        assert proc.wait(timeout=600) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert_nothing_left(proc, "after a raising reward, a stage crash, two restarts and the run's end")
    assert raised.exists()
    # the first restart: the reward's failure, from the first checkpoint or a later one
    first_from = restarted_from(out, 1, 2)
    assert first_from >= 2 and "injected reward failure" in out
    # the second: the train rank's, named, from a checkpoint no older than the first restart's
    second_from = restarted_from(out, 2, 2)
    after_first = out.split("async_rl: restart 1 of 2 (trainer.max_restarts) from", 1)[1]
    assert "stage 'actor_train' failed" in after_first
    assert second_from >= first_from
    rows = read_jsonl(metrics)
    logged = [r["step"] for r in rows if "training/global_step" in r["data"]]
    assert logged[-1] == steps and sorted(set(logged)) == list(range(1, steps + 1))
    restarts_logged = [r["data"].get("async/faults/pipeline_restarts") for r in rows if "training/global_step" in r["data"]]
    assert 1.0 in restarts_logged  # logged by the run restarted once
    assert step_rows(rows)[steps]["async/faults/pipeline_restarts"] == 2.0  # by the run restarted twice
    assert Path(ckpt / f"global_step_{steps}").is_dir()
    assert dumped_step_inputs(dumps) == expected_step_inputs(demo_dir, steps)
    # each attempt's timeline and report: the two failed ones' kept beside the last run's
    assert sorted(p.name for p in trace.iterdir()) == [
        "report.html", "report_attempt0.html", "report_attempt1.html",
        "trace.json", "trace_attempt0.json", "trace_attempt1.json"]
