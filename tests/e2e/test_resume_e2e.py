"""Checkpoints and resume end to end, through verl's command line with the flag.

The demo, killed (SIGKILL of every process of the run, as a lost node) during a checkpoint
write, a weight sync and generation ahead of the trainer, then stopped by SIGTERM to every
process of the run (as a scheduler stops a job), and resumed with `trainer.resume_mode=auto`
each time: every step trains the prompts the uninterrupted run trains at that step, no step is
skipped or trained twice in the checkpointed lineage, staleness stays within the bound, and it
still learns. 16 steps, not the demo's 300: each of the five starts costs ~70 s on 2 cores.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from async_rl.checkpoint_dir import CheckpointDir
from async_rl.core.fault_points import HOLD_AT_ENV, HOLD_DIR_ENV
from helpers.lineage import dumped_step_inputs, expected_step_inputs, read_jsonl
from helpers.processes import assert_nothing_left, kill_session, wait_for_file
from helpers.rows import step_rows, val_rows
from helpers.runs import start_verl

VAL_KEY = "val-core/async_rl/copy_digits/reward/mean@1"
SAVE_FREQ = 2
TOTAL_STEPS = 16
# where each killed segment is held, then SIGKILLed (async_rl/core/fault_points.py)
STOP_DEADLINE_S = 25  # trainer.stop_deadline_s default
KILLS = ["checkpoint_write@4", "weight_sync@5", "generate_ahead@8"]


def segment_steps(workdir, name) -> list[int]:
    return sorted(step_rows(read_jsonl(workdir / name)))


@pytest.mark.slow
def test_demo_learns_across_sigkills_and_a_sigterm(demo_dir, tmp_path):
    ckpt, dumps, holds = tmp_path / "ckpt", tmp_path / "dumps", tmp_path / "holds"
    holds.mkdir()
    extra = {"trainer.save_freq": SAVE_FREQ, "trainer.default_local_dir": str(ckpt), "trainer.max_actor_ckpt_to_keep": 2,
             "trainer.rollout_data_dir": str(dumps), "trainer.resume_mode": "auto",
             "trainer.total_training_steps": TOTAL_STEPS}
    directory = CheckpointDir(str(ckpt))
    resumed_from = 0
    segments = []  # (metrics file, step it resumed from)
    for i, point in enumerate(KILLS):
        name = f"segment{i}.jsonl"
        proc = start_verl(demo_dir, extra, tmp_path, name, env={HOLD_AT_ENV: point, HOLD_DIR_ENV: str(holds)})
        wait_for_file(holds / point, proc, timeout_s=400)
        kill_session(proc)
        segments.append((name, resumed_from))
        saved, held_step = directory.tracked_step(), int(point.split("@")[1])
        # the newest checkpoint committed before the kill: never a later one, never one half written
        assert saved % SAVE_FREQ == 0 and resumed_from <= saved < held_step, (point, saved)
        if point.startswith("checkpoint_write@"):
            assert saved == held_step - SAVE_FREQ and (ckpt / f"global_step_{held_step}.partial").exists()
            assert not (ckpt / f"global_step_{held_step}").exists()
        resumed_from = saved

    # SIGTERM to the run's whole process group, as a scheduler stopping the job: the running step
    # finishes and is saved, within trainer.stop_deadline_s (25 s), and nothing of the run is left
    name = "segment_sigterm.jsonl"
    proc = start_verl(demo_dir, extra, tmp_path, name)
    deadline = time.monotonic() + 400
    while not [s for s in segment_steps(tmp_path, name) if s >= resumed_from + 3]:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"{name}.log").read_text()[-3000:]
        time.sleep(0.2)
    signalled = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=STOP_DEADLINE_S) == 128 + signal.SIGTERM
    stop_s = time.monotonic() - signalled
    log = (tmp_path / f"{name}.log").read_text()
    saved = directory.tracked_step()
    assert f"stopped by SIGTERM: checkpoint of step {saved} saved" in log, log[-3000:]
    assert saved == max(segment_steps(tmp_path, name))  # the last completed step, saved and logged
    assert_nothing_left(proc, f"after SIGTERM to the group (driver exited in {stop_s:.1f} s)")
    segments.append((name, resumed_from))
    resumed_from = saved

    name = "segment_last.jsonl"
    proc = start_verl(demo_dir, extra, tmp_path, name)
    assert proc.wait(timeout=15 * 60) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    segments.append((name, resumed_from))
    total = TOTAL_STEPS

    # each segment trained on from its checkpoint, in order; the lineage covers every step once
    for (name, start), (_, next_start) in zip(segments, segments[1:] + [(None, total)]):
        steps = segment_steps(tmp_path, name)
        if start > 0:
            assert f"resuming from {ckpt}/global_step_{start} (step {start}" in (tmp_path / f"{name}.log").read_text()
        if not steps:  # killed before the driver logged a step (a hold froze a stage it was reading first)
            assert start <= next_start, (name, start, next_start)  # its checkpoints, if any, go on from start
            continue
        assert steps[0] == start + 1 and steps == list(range(start + 1, steps[-1] + 1)), (name, steps[:5])
        assert next_start <= steps[-1] + 1
        for metrics in step_rows(read_jsonl(tmp_path / name)).values():
            assert metrics["async/staleness/max"] <= 1  # default k = 2, across every resume
    # max_actor_ckpt_to_keep=2: the newest two of the SIGTERM's save (any step) and the last run's saves
    sigterm_saved = segments[-1][1]
    kept = sorted({sigterm_saved} | {s for s in range(sigterm_saved + 1, total + 1) if s % SAVE_FREQ == 0})[-2:]
    assert directory.complete_steps() == kept and directory.tracked_step() == total
    # every step trained the uninterrupted run's prompts (verl's rollout dumps against verl's dataloader)
    assert dumped_step_inputs(dumps) == expected_step_inputs(demo_dir, total)

    curve = {}
    for name, _ in segments:
        curve.update({step: m[VAL_KEY] for step, m in val_rows(read_jsonl(tmp_path / name)).items()})
    assert curve[0] <= 0.2 and curve[total] >= curve[0] + 0.1, curve  # the demo's bar, 0.9, needs ~300 steps
