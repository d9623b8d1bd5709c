"""verl's example scripts under the flag: each trains 2 steps with the verl keys its script sets
(verl's `examples/` at commit b178a3cd5, verl 0.9.1; what each sets that changes training or what is logged is
copied in bench/verl_examples.py, which also runs verl's own trainer on them as a control), adapted only in
model, data, hardware and sizes to the demo (the demo's tiny model, data and CPU keys; 8 prompts a step). Two
of them run in the e2e test of their feature instead, with the same keys: `run_with_rollout_corr.sh`
(test_pipeline_e2e.py, the k = 1 run) and `run_qwen2-7b_rm_seq_balance.sh` (test_reward_model_e2e.py, its
legacy reward-model keys). The rest of verl's example zoo is tested where its feature is: ReMax
(test_pipeline_e2e.py), LoRA (test_lora_e2e.py, test_vllm_cpu_e2e.py), a critic (test_critic_e2e.py); the
table: docs/using_with_verl.md."""

from __future__ import annotations

import pytest

from async_rl.demo.task import GROUP_SIZE
from bench.verl_examples import ACTOR, EXAMPLES, run_keys, with_critic
from helpers.rows import every_step_with, val_rows
from helpers.runs import run_verl

ELSEWHERE = {"rollout_correction/run_with_rollout_corr.sh": "tests/e2e/test_pipeline_e2e.py",
             "ppo_trainer/run_qwen2-7b_rm_seq_balance.sh": "tests/e2e/test_reward_model_e2e.py"}


@pytest.mark.parametrize("script", [s for s in EXAMPLES if s not in ELSEWHERE])
def test_verls_example_trains_under_the_flag(demo_dir, tmp_path, ray_address, script):
    keys = run_keys(script, demo_dir)
    code, out, rows = run_verl(demo_dir, keys, tmp_path, ray_address=ray_address, critic=with_critic(keys))
    assert code == 0, out[-4000:]
    steps = every_step_with(rows, 2, ["actor/pg_loss", "critic/advantages/mean"])
    group = int(keys.get("actor_rollout_ref.rollout.n", GROUP_SIZE))  # the script's, else the demo's
    for metrics in steps.values():
        assert metrics["async/trained_rows"] == 8 * group  # the script's group size, the demo's prompts
        if keys.get("algorithm.use_kl_in_reward"):  # verl's KL penalty in the reward, at the script's coefficient
            assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(keys.get("algorithm.kl_ctrl.kl_coef", 0.001))
        if keys.get(f"{ACTOR}.use_kl_loss"):  # verl's KL loss against the reference
            assert "actor/kl_loss" in metrics
        else:
            assert "actor/kl_loss" not in metrics
    if "reward_model.reward_manager" in keys:  # the script's legacy reward keys, read as verl maps them
        assert "reward_model.reward_manager='dapo'" in out and "reward.reward_manager.name='dapo'" in out
    if keys.get("trainer.log_val_generations"):  # validated at the last step, its generations to the logger
        assert 2 in val_rows(rows)
