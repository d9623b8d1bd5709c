"""End to end: verl's PPO (gae with a critic) through the pipeline (its checkpoints: test_verl_trainer_on_cpu)."""

from __future__ import annotations

from async_rl.demo.task import GROUP_SIZE, TRAIN_BATCH_SIZE
from conftest import every_step_with, run_verl, val_rows
from state_machines.actor_train import trainable_rows

CRITIC_KEYS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
               "timing_s/update_critic", "timing_s/values", "critic/values/mean", "critic/returns/mean",
               "critic/vf_explained_var", "async/values/busy_ratio", "async/critic_train/busy_ratio")
USER_STAGE = {"+trainer.async_stages.group_filter.cls": "examples.group_filter_stage.GroupFilterStage",
              "+trainer.async_stages.group_filter.after": "reward"}


def test_ppo_with_a_critic_trains_with_values_from_the_critic_of_its_step(demo_dir, tmp_path, ray_address):
    """k = 3: each step's values come from the critic after the previous steps' updates (verl's order),
    the critic trains on every step, with trainer.critic_warmup=2 the actor makes no update at step 1,
    and a user stage inserted from the command line filters what both train."""
    k, steps, warmup = 3, 5, 2
    run = {"trainer.total_training_steps": steps, "trainer.test_freq": steps, "+trainer.generate_ahead_steps": k,
           "trainer.critic_warmup": warmup, **USER_STAGE}
    code, out, rows = run_verl(demo_dir, run, tmp_path, critic=True, ray_address=ray_address)
    assert code == 0, out[-4000:]
    by_step = every_step_with(rows, steps, CRITIC_KEYS)
    for step, metrics in by_step.items():
        assert metrics["async/critic_version"] == step - 1  # the rule: batch j's values from critic version j
        assert metrics["async/staleness/max"] <= k - 1
        assert metrics["critic/vf_clipfrac"] >= 0 and metrics["critic/grad_norm"] > 0
        assert ("actor/pg_loss" in metrics) == (step >= warmup)
        # the user stage (examples/group_filter_stage.py, two config lines) between reward and actor_train
        assert "async/group_filter/busy_ratio" in metrics
        kept_groups = metrics["async/group_filter/kept_groups"]
        assert metrics["async/group_filter/kept_ratio"] == kept_groups / TRAIN_BATCH_SIZE
        # the filter's decision reached the update: only rows of kept groups were trained
        expected = trainable_rows(int(kept_groups) * GROUP_SIZE, TRAIN_BATCH_SIZE * GROUP_SIZE, 1, GROUP_SIZE)
        assert metrics["async/trained_rows"] == expected
    assert max(m["async/staleness/max"] for m in by_step.values()) >= 1
    assert "val-core/async_rl/copy_digits/reward/mean@1" in val_rows(rows)[steps]
