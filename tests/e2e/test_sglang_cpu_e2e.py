"""verl's own SGLang rollout on SGLang's CPU build (.venv-sglang; `bash scripts/test.sh --sglang`, not CI:
docs/sglang_cpu.md).

Flag off: verl's synchronous trainer with `rollout.name=sglang` on CPU, through verl's `SGLangReplica` /
`SGLangHttpServer` and its weight path into SGLang (`verl_patches/sglang_cpu.py`). Flag on: the pipeline
with SGLang as its rollout, weights sent by the `async_rl` checkpoint-engine backend. With
`rollout.dtype=float32` the log-probs SGLang returns equal the trainer's recomputed ones within fp32 noise
at every on-policy step, which holds only if every new version reached SGLang (one step of training moves
them by about 1e-3; verl's servers start on dummy weights)."""

from __future__ import annotations

import pytest

from helpers.rows import every_step_with, val_rows
from helpers.runs import run_verl

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SGLANG_ON_CPU = {"actor_rollout_ref.rollout.name": "sglang", "actor_rollout_ref.rollout.dtype": "float32",
                 "actor_rollout_ref.rollout.enforce_eager": True}
FP32_NOISE = 1e-5
LOG_PPL_GAP = "rollout_corr/log_ppl_abs_diff"


def test_verls_sync_trainer_runs_sglang_on_cpu_and_every_version_reaches_it(demo_dir, tmp_path, ray_address):
    extra = {
        **SGLANG_ON_CPU,
        "+actor_rollout_ref.async_pipeline": False,
        # one trainer rank, one SGLang server, one agent-loop worker: what 2 cores hold
        "trainer.n_gpus_per_node": 1,
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "trainer.total_training_steps": 2,
        "trainer.val_before_train": False,
        "trainer.test_freq": 2,
        "trainer.save_freq": -1,
    }
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900, ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert "SGLang on CPU: actor_rollout_ref.rollout.free_cache_engine=False" in out  # the overrides, said
    by_step = every_step_with(rows, 2, [LOG_PPL_GAP, "training/rollout_probs_diff_max"])
    for step, metrics in by_step.items():
        assert metrics[LOG_PPL_GAP] < FP32_NOISE, (step, metrics[LOG_PPL_GAP])
        assert metrics["training/rollout_probs_diff_max"] < FP32_NOISE, step
    assert 2 in val_rows(rows)  # validation through SGLang too


PIPELINE = {**SGLANG_ON_CPU, "trainer.val_before_train": False, "trainer.save_freq": -1}


@pytest.mark.parametrize("k", [1, 2])
def test_pipeline_on_sglang_trains_within_the_bound_and_every_version_reaches_it(demo_dir, tmp_path, ray_address, k):
    """k=1: every step trains on the newest version and SGLang's log-probs equal the trainer's within fp32
    noise (each version went through the five-part sync into SGLang). k=2: generation runs one version ahead
    at most."""
    steps = 3
    extra = {**PIPELINE, "+trainer.generate_ahead_steps": k, "trainer.total_training_steps": steps,
             "trainer.test_freq": steps}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900, ray_address=ray_address)
    assert code == 0, out[-4000:]
    by_step = every_step_with(rows, steps, [LOG_PPL_GAP, "async/staleness/max", "async/param_update/bytes"])
    for step, metrics in by_step.items():
        assert metrics["async/staleness/max"] <= k - 1, step
        assert metrics["async/param_update/bytes"] > 0, step
        if k == 1:
            assert metrics[LOG_PPL_GAP] < FP32_NOISE, (step, metrics[LOG_PPL_GAP])
    assert steps in val_rows(rows)  # validation through SGLang
