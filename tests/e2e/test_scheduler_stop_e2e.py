"""A scheduler's stop end to end: the demo under verl's command line with the flag, in its own
session, signalled as a whole process group (Ctrl-C in a terminal; a second SIGTERM while a
checkpoint is being written). Group SIGTERM followed by a resume is in test_resume_e2e.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from async_rl.checkpoint_dir import CheckpointDir
from async_rl.core.fault_points import HOLD_AT_ENV, HOLD_DIR_ENV
from helpers.lineage import read_jsonl
from helpers.processes import assert_nothing_left, wait_for_file, wait_until
from helpers.rows import step_rows
from helpers.runs import start_verl

STOP_DEADLINE_S = 25  # trainer.stop_deadline_s default
SAVE_FREQ = 2
WORKERS = "data.dataloader_num_workers"


def logged_steps(path) -> list[int]:
    return sorted(step_rows(read_jsonl(path))) if path.exists() else []


@pytest.mark.slow
def test_ctrl_c_to_the_group_saves_and_a_second_sigterm_stops_at_once_keeping_the_previous_checkpoint(
        demo_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    directory = CheckpointDir(str(ckpt))
    extra = {"trainer.save_freq": SAVE_FREQ, "trainer.default_local_dir": str(ckpt), "trainer.resume_mode": "auto",
             "trainer.total_training_steps": 40, "trainer.val_before_train": False, "trainer.test_freq": -1}

    # Ctrl-C in a terminal: SIGINT to the foreground process group, every process of the run. The command
    # leaves data.dataloader_num_workers at verl's default: the pipeline sizes it (no forked workers)
    proc = start_verl(demo_dir, extra, tmp_path, "ctrl_c.jsonl", drop=(WORKERS,))
    wait_until(lambda: len(logged_steps(tmp_path / "ctrl_c.jsonl")) >= 3, proc, "3 training steps")
    signalled = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=STOP_DEADLINE_S) == 128 + signal.SIGINT
    log = (tmp_path / "ctrl_c.jsonl.log").read_text()
    saved = directory.tracked_step()
    assert f"stopped by SIGINT: checkpoint of step {saved} saved" in log, log[-3000:]
    assert saved == max(logged_steps(tmp_path / "ctrl_c.jsonl"))
    assert "data.dataloader_num_workers: the dataloader stage reads its batches itself (0 workers" in log
    assert_nothing_left(proc, f"after SIGINT to the group (driver exited in {time.monotonic() - signalled:.1f} s)")

    # resumed, then stopped while its next periodic checkpoint is being written (held there), and
    # signalled again 2 s later: it stops at once; the checkpoint in progress never becomes the newest
    held = saved + SAVE_FREQ - saved % SAVE_FREQ
    holds = tmp_path / "holds"
    holds.mkdir()
    proc = start_verl(demo_dir, extra, tmp_path, "twice.jsonl", drop=(WORKERS,),
                      env={HOLD_AT_ENV: f"checkpoint_write@{held}", HOLD_DIR_ENV: str(holds)})
    wait_for_file(holds / f"checkpoint_write@{held}", proc, timeout_s=400)
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(2)
    assert proc.poll() is None, "the first SIGTERM stopped the run before its checkpoint was written"
    signalled = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=15) == 128 + signal.SIGTERM
    stop_s = time.monotonic() - signalled
    log = (tmp_path / "twice.jsonl.log").read_text()
    assert "stopped by SIGTERM: no new checkpoint; a second signal stopped it at once" in log, log[-3000:]
    assert f"a resume starts after {ckpt}/global_step_{saved}" in log
    assert directory.tracked_step() == saved and not (ckpt / f"global_step_{held}").exists()
    assert_nothing_left(proc, f"after a second SIGTERM (driver exited in {stop_s:.1f} s)")
