"""Ulysses sequence parallelism under the flag on CPU (verl's `ulysses_sequence_parallel_size` for actor,
ref and critic; verl_patches/ulysses_sdpa.py): verl's `ppo_trainer/run_deepseek7b_llm_sp2.sh` keys (gae, a
critic, actor and critic at 2) plus `use_kl_loss=True`, so that the reference model runs too, on a demo
model with 2 attention heads, every role on 2 ranks that split each packed sequence. At k=1 the
logp stage's log-probs (sequence-parallel) equal the rollout server's (whole sequences), and at step 1
the actor's KL to the reference (both sequence-parallel) is 0."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from async_rl.demo.task import MODEL_KWARGS
from helpers.rows import every_step_with
from helpers.runs import run_verl

FP32_NOISE = 1e-5  # measured 9e-8 at both steps; without verl_patches/ulysses_sdpa.py, 5e-4 at step 2


@pytest.fixture(scope="module")
def two_head_model(demo_dir, tmp_path_factory):
    """The demo's model with 2 heads of 64 (hidden 128): what Ulysses 2 can split, and vLLM can serve."""
    import torch

    path = tmp_path_factory.mktemp("two_heads")
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    config = Qwen2Config(**{**MODEL_KWARGS, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2},
                         vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).float().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_sequence_parallel_ranks_compute_the_rollouts_log_probs(demo_dir, two_head_model, tmp_path, ray_address):
    extra = {
        "actor_rollout_ref.model.path": str(two_head_model), "critic.model.path": str(two_head_model),
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,  # the ref's follows (verl's interpolation)
        "critic.ulysses_sequence_parallel_size": 2,
        "actor_rollout_ref.actor.use_kl_loss": True,
        "trainer.n_gpus_per_node": 4,  # 2 ranks for each role: one data-parallel group of 2
        "trainer.total_training_steps": 2, "trainer.test_freq": -1, "trainer.val_before_train": False,
        "trainer.generate_ahead_steps": 1, "+algorithm.proximal_logp_workers": "logp",
    }
    code, out, rows = run_verl(demo_dir, extra, tmp_path, critic=True, ray_address=ray_address)
    assert code == 0, out[-4000:]
    steps = every_step_with(rows, 2, ["rollout_corr/log_ppl_abs_diff", "actor/kl_loss", "critic/vf_loss"])
    for step, metrics in steps.items():
        assert metrics["rollout_corr/log_ppl_abs_diff"] < FP32_NOISE, (step, metrics["rollout_corr/log_ppl_abs_diff"])
    assert abs(steps[1]["actor/kl_loss"]) < 1e-6, steps[1]["actor/kl_loss"]
