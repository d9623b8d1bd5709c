"""verl's example scripts under the flag: each trains 2 steps with the verl keys its script sets
(verl's `examples/` at commit b178a3cd5; what each sets that changes training is copied below), adapted
only in model, data, hardware and sizes to the demo (the demo's tiny model, data and CPU keys; 8
prompts a step). The rest of verl's example zoo is tested where its feature is: ReMax
(test_pipeline_e2e.py), LoRA (test_lora_e2e.py), a reward model (test_reward_model_e2e.py), a critic
(test_critic_e2e.py), rollout correction (test_pipeline_e2e.py); the table: docs/using_with_verl.md."""

from __future__ import annotations

import pytest

from conftest import every_step_with, run_verl

ACTOR = "actor_rollout_ref.actor"
EXAMPLES = {
    "rloo_trainer/run_qwen2-7b.sh": {
        "algorithm.adv_estimator": "rloo", f"{ACTOR}.use_kl_loss": False, "actor_rollout_ref.rollout.n": 5,
        "algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": "kl", "algorithm.kl_ctrl.kl_coef": 0.001,
    },
    "reinforce_plus_plus_trainer/run_qwen2-7b_math_rf.sh": {
        "algorithm.adv_estimator": "reinforce_plus_plus", f"{ACTOR}.use_kl_loss": False,
        f"{ACTOR}.kl_loss_coef": 0.001, f"{ACTOR}.kl_loss_type": "mse", f"{ACTOR}.entropy_coeff": 0,
        "actor_rollout_ref.rollout.n": 8, "algorithm.use_kl_in_reward": True,
    },
    "gpg_trainer/run_qwen2-7b_math.sh": {
        "algorithm.adv_estimator": "gpg", f"{ACTOR}.use_kl_loss": False, f"{ACTOR}.policy_loss.loss_mode": "gpg",
        f"{ACTOR}.kl_loss_coef": 0.001, f"{ACTOR}.kl_loss_type": "low_var_kl", f"{ACTOR}.entropy_coeff": 0,
        "actor_rollout_ref.rollout.n": 5, "algorithm.use_kl_in_reward": False,
    },
    "gspo_trainer/test_gspo_3b_math.sh": {
        "algorithm.adv_estimator": "grpo", f"{ACTOR}.policy_loss.loss_mode": "gspo",
        f"{ACTOR}.loss_agg_mode": "seq-mean-token-mean", "reward.reward_manager.name": "dapo",
        "algorithm.use_kl_in_reward": False, "algorithm.kl_ctrl.kl_coef": 0.0, f"{ACTOR}.use_kl_loss": False,
        f"{ACTOR}.kl_loss_coef": 0.0, f"{ACTOR}.clip_ratio_low": 0.0003, f"{ACTOR}.clip_ratio_high": 0.0004,
        "actor_rollout_ref.rollout.n": 16, f"{ACTOR}.entropy_coeff": 0,
    },
    "cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh": {
        "algorithm.adv_estimator": "grpo", f"{ACTOR}.policy_loss.loss_mode": "cispo",
        f"{ACTOR}.clip_ratio_low": 10, f"{ACTOR}.clip_ratio_high": 0.2, f"{ACTOR}.use_kl_loss": True,
        f"{ACTOR}.kl_loss_coef": 0.001, f"{ACTOR}.kl_loss_type": "low_var_kl", f"{ACTOR}.entropy_coeff": 0,
        "actor_rollout_ref.rollout.n": 5, "algorithm.use_kl_in_reward": False,
    },
}
DEMO_SIZES = {"data.train_batch_size": 8, f"{ACTOR}.ppo_mini_batch_size": 8, "trainer.total_training_steps": 2,
              "trainer.test_freq": -1, "trainer.val_before_train": False}


@pytest.mark.parametrize("script", list(EXAMPLES))
def test_verls_example_trains_under_the_flag(demo_dir, tmp_path, ray_address, script):
    keys = EXAMPLES[script]
    code, out, rows = run_verl(demo_dir, {**keys, **DEMO_SIZES}, tmp_path, ray_address=ray_address)
    assert code == 0, out[-4000:]
    steps = every_step_with(rows, 2, ["actor/pg_loss", "critic/advantages/mean"])
    group = int(keys["actor_rollout_ref.rollout.n"])
    for metrics in steps.values():
        assert metrics["async/trained_rows"] == 8 * group  # the script's group size, the demo's prompts
        if keys.get("algorithm.use_kl_in_reward"):  # verl's KL penalty in the reward, at the script's coefficient
            assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(keys.get("algorithm.kl_ctrl.kl_coef", 0.001))
        if keys.get(f"{ACTOR}.use_kl_loss"):  # verl's KL loss against the reference
            assert "actor/kl_loss" in metrics
        else:
            assert "actor/kl_loss" not in metrics
