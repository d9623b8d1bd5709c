"""verl's own vLLM rollout on vLLM's CPU build (the vllm venv; scripts/test.sh runs these there).

Flag off: verl's synchronous trainer with `rollout.name=vllm` on CPU, through verl's
`vLLMReplica` / `vLLMHttpServer` and its weight sync. With `rollout.dtype=float32` the log-probs
vLLM returns equal the trainer's recomputed ones within fp32 noise at every step, which holds
only if every new version reached vLLM (one step of training moves them by ~1e-3)."""

from __future__ import annotations

import pytest

from conftest import every_step_with, run_verl, val_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM_ON_CPU = {
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.dtype": "float32",  # the trainer's dtype: log-probs comparable to fp32 noise
    "actor_rollout_ref.rollout.enforce_eager": True,
}
FP32_NOISE = 1e-5  # measured: 7e-8 to 8e-8 (bf16 rollout: 4e-4)


def test_verls_sync_trainer_runs_vllm_on_cpu_and_every_version_reaches_it(demo_dir, tmp_path):
    extra = {
        **VLLM_ON_CPU,
        "+actor_rollout_ref.async_pipeline": False,
        # one trainer rank, one vLLM replica, one agent-loop worker: what 2 cores hold
        "trainer.n_gpus_per_node": 1,
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "trainer.total_training_steps": 3,
        "trainer.val_before_train": False,
        "trainer.test_freq": 3,
        "trainer.save_freq": -1,
    }
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900)
    assert code == 0, out[-4000:]
    assert "vLLM on CPU: actor_rollout_ref.rollout.free_cache_engine=False" in out  # the overrides, said
    by_step = every_step_with(rows, 3, ["rollout_corr/log_ppl_abs_diff", "training/rollout_probs_diff_max"])
    for step, metrics in by_step.items():
        assert metrics["rollout_corr/log_ppl_abs_diff"] < FP32_NOISE, (step, metrics["rollout_corr/log_ppl_abs_diff"])
        assert metrics["training/rollout_probs_diff_max"] < FP32_NOISE, step
    assert 3 in val_rows(rows)  # validation through vLLM too


PIPELINE = {
    **VLLM_ON_CPU,
    "trainer.val_before_train": False,
    "trainer.save_freq": -1,
}


def test_pipeline_on_vllm_on_policy_every_version_reaches_vllm(demo_dir, tmp_path):
    """k=1: each step trains on responses of the newest version, and vLLM's log-probs equal the
    trainer's within fp32 noise at every step: every version reached vLLM (through the `async_rl`
    checkpoint-engine backend), version 0 included (verl's servers start on dummy weights)."""
    extra = {**PIPELINE, "+trainer.generate_ahead_steps": 1, "trainer.total_training_steps": 3, "trainer.test_freq": 3}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900)
    assert code == 0, out[-4000:]
    by_step = every_step_with(rows, 3, ["rollout_corr/log_ppl_abs_diff", "async/staleness/max"])
    for step, metrics in by_step.items():
        assert metrics["async/staleness/max"] == 0, step
        assert metrics["rollout_corr/log_ppl_abs_diff"] < FP32_NOISE, (step, metrics["rollout_corr/log_ppl_abs_diff"])
    assert 3 in val_rows(rows)  # validation through vLLM


def test_pipeline_on_vllm_runs_ahead_within_the_bound_and_loads_during_generation(demo_dir, tmp_path):
    """k=3: generation runs up to 2 versions ahead, never more; weights load into vLLM between
    decoding steps (verl's abort + the generate stage's resubmission of prompt + tokens so far), so
    some responses carry tokens of two versions."""
    k, steps = 3, 5
    # generation the bottleneck, so every load lands while vLLM decodes: 256 responses of 32 tokens,
    # 8 at a time (a batch takes several times a training step)
    slow_generation = {"data.max_response_length": 32, "actor_rollout_ref.rollout.ignore_eos": True,
                       "actor_rollout_ref.rollout.max_num_seqs": 8}
    extra = {**PIPELINE, **slow_generation, "+trainer.generate_ahead_steps": k,
             "trainer.total_training_steps": steps, "trainer.test_freq": steps}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900)
    assert code == 0, out[-4000:]
    by_step = every_step_with(rows, steps, ["async/staleness/max", "async/partial/max_versions_spanned",
                                            "async/param_update/blocked_s"])
    for step, metrics in by_step.items():
        assert metrics["async/staleness/max"] <= k - 1, step
        assert 1 <= metrics["async/partial/max_versions_spanned"] <= k, step
    assert max(m["async/staleness/max"] for m in by_step.values()) >= 1  # it really ran ahead
    assert max(m["async/partial/max_versions_spanned"] for m in by_step.values()) >= 2  # loaded mid-response
    assert steps in val_rows(rows)


def test_pipeline_on_vllm_without_partial_rollout_waits_for_running_requests(demo_dir, tmp_path):
    """partial_rollout=False: a load parks new requests and waits for the running ones, so no response
    spans two versions, while generation still runs ahead within the bound."""
    k, steps = 3, 4
    extra = {**PIPELINE, "+trainer.generate_ahead_steps": k, "trainer.total_training_steps": steps,
             "trainer.test_freq": -1, "+actor_rollout_ref.rollout.partial_rollout": False}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900)
    assert code == 0, out[-4000:]
    by_step = every_step_with(rows, steps, ["async/staleness/max", "async/partial/max_versions_spanned"])
    for step, metrics in by_step.items():
        assert metrics["async/partial/max_versions_spanned"] == 1, step
        assert metrics["async/staleness/max"] <= k - 1, step
