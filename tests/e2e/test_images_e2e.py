"""Image prompts end to end (verl's `data.image_key` rows, a tiny Qwen2-VL: async_rl/demo/vision.py) on the CPU
backend: under the flag, each row's image goes through verl's dataset and agent loop to the rollout
server, and at k = 1 the trainer's log-probs of every trained token equal the
server's (which they would not if either side missed the image or its multimodal RoPE)."""

from __future__ import annotations

import pytest

from async_rl.demo.task import sample_prompts
from async_rl.demo.vision import image_rows, save_vl_model
from helpers.rows import every_step_with, val_rows
from helpers.runs import run_verl

FP32_NOISE = 1e-4  # the server's vs the trainer's log-probs with the same weights
STEPS = 2


@pytest.fixture(scope="module")
def image_task(tmp_path_factory):
    """(model dir, train file, val file)."""
    import numpy as np

    root = tmp_path_factory.mktemp("images")
    train, val = sample_prompts(np.random.default_rng(0), 64, 8)
    image_rows(train, "train", seed=0).to_parquet(root / "train.parquet")
    image_rows(val, "test", seed=1).to_parquet(root / "val.parquet")
    return save_vl_model(root / "model", seed=3), root / "train.parquet", root / "val.parquet"


def test_image_prompts_train_with_the_servers_log_probs_equal_to_the_trainers(demo_dir, tmp_path, ray_address,
                                                                            image_task):
    model, train, val = image_task
    extra = {"actor_rollout_ref.model.path": str(model), "data.train_files": str(train), "data.val_files": str(val),
             "data.max_prompt_length": 16, "actor_rollout_ref.model.use_remove_padding": False,
             "trainer.total_training_steps": STEPS, "trainer.test_freq": STEPS, "trainer.val_before_train": False,
             "trainer.save_freq": -1, "+trainer.generate_ahead_steps": 1}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900, ray_address=ray_address)
    assert code == 0, out[-4000:]
    by_step = every_step_with(rows, STEPS, ["rollout_corr/log_ppl_abs_diff", "prompt_length/mean"])
    for step, metrics in by_step.items():
        assert metrics["rollout_corr/log_ppl_abs_diff"] < FP32_NOISE, (step, metrics["rollout_corr/log_ppl_abs_diff"])
        # the image's 4 tokens, its 2 markers, 4 digits and "=": the prompt the processor built
        assert metrics["prompt_length/mean"] == 11, step
    assert STEPS in val_rows(rows)
