"""verl's `skip.rollout` through verl's command with the flag: a run dumps step 1's rollouts, a second run with
another sampling temperature replays them and trains step 1 on exactly what the first run generated."""

from __future__ import annotations

from collections import Counter

import pytest

from helpers.lineage import read_jsonl
from helpers.runs import run_verl

pytestmark = pytest.mark.slow


def test_a_second_run_trains_step_1_on_the_rollouts_the_first_dumped(demo_dir, tmp_path, ray_address):
    def run(name: str, temperature: float):
        extra = {"skip.rollout.enable": True, "skip.rollout.dump_dir": str(tmp_path / "rollout_dump"),
                 "skip.rollout.steps": [1], "actor_rollout_ref.rollout.temperature": temperature,
                 "trainer.rollout_data_dir": str(tmp_path / name / "trained"), "trainer.total_training_steps": 1,
                 "trainer.val_before_train": False, "trainer.test_freq": -1, "trainer.save_freq": -1}
        code, out, rows = run_verl(demo_dir, extra, tmp_path / name, timeout_s=600, ray_address=ray_address)
        assert code == 0, out[-4000:]
        return out, read_jsonl(tmp_path / name / "trained" / "1.jsonl")

    out, first = run("first", 1.0)
    assert "Dump generate result at step 1" in out  # verl's RolloutSkip, in the generate stage
    out, second = run("second", 0.3)
    assert "Load generate result at step 1" in out and "Dump generate result" not in out
    # step 1 trained on the first run's prompts and responses, scored again by the second run's reward
    assert Counter((r["input"], r["output"]) for r in second) == Counter((r["input"], r["output"]) for r in first)
    assert [r["score"] for r in second] == [r["score"] for r in first]
