"""actor_train builds verl's training batch as verl's trainer does: the KL penalty in the reward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.core.messages import LogpResult, RefLogpResult, ScoredBatch
from async_rl.core.policy_clock import ClockRef
from async_rl.core.staleness import StalenessGate
from helpers.lineage import compose_ppo
from state_machines.actor_train import ActorTrainStage

ROWS, RESPONSE_LEN, GROUP = 4, 5, 2
KL_COEF = 0.1


def stage(*overrides: str) -> ActorTrainStage:
    config = compose_ppo(
        ["algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={GROUP}",
         f"algorithm.kl_ctrl.kl_coef={KL_COEF}", *overrides]
    )
    return ActorTrainStage(config=config, devices=1, clock=ClockRef.in_process(StalenessGate(1)),
                           parts=("reward", "logp", "ref_logp"))


def batch_and_parts(seed: int = 0):
    """A scored step: responses of 5, 3, 4 and 1 tokens, log-probs of three policies."""
    from verl import DataProto

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 4, 1])
    mask = (torch.arange(RESPONSE_LEN)[None, :] < lengths[:, None]).float()
    ref, behav = (-torch.rand(ROWS, RESPONSE_LEN, generator=gen) for _ in range(2))
    old = ref + 0.5 * torch.rand(ROWS, RESPONSE_LEN, generator=gen)  # log pi_old - log pi_ref in [0, 0.5)
    scores = torch.tensor([1.0, 0.25, 0.5, 0.0])
    uids = np.array(["a", "a", "b", "b"], dtype=object)
    attention = torch.cat([torch.ones(ROWS, 2), mask], dim=1).long()  # 2 prompt tokens, then the response
    batch = DataProto.from_dict(tensors={"response_mask": mask, "rollout_log_probs": behav, "attention_mask": attention,
                                         "responses": torch.ones(ROWS, RESPONSE_LEN, dtype=torch.long)},
                                non_tensors={"uid": uids})
    parts = {
        "reward": ScoredBatch(index=0, scores=scores, uids=uids),
        "logp": LogpResult(index=0, batch_ref=None, old_log_probs=old, logp_version=0),
        "ref_logp": RefLogpResult(index=0, ref_log_prob=ref),
    }
    last_token_scores = torch.zeros(ROWS, RESPONSE_LEN)
    last_token_scores[torch.arange(ROWS), lengths - 1] = scores
    return batch, parts, last_token_scores, (old, ref, behav, mask)


def test_kl_in_reward_subtracts_beta_times_kl_on_every_response_token():
    batch, parts, last_token_scores, (old, ref, _, mask) = batch_and_parts()
    trained, metrics = stage("algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=fixed",
                             "algorithm.kl_penalty=kl")._training_batch(batch, parts)
    want = last_token_scores - KL_COEF * (old - ref) * mask
    torch.testing.assert_close(trained.batch["token_level_rewards"], want)
    torch.testing.assert_close(trained.batch["token_level_scores"], last_token_scores)
    per_row_kl = ((old - ref) * mask).sum(-1) / mask.sum(-1)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(per_row_kl.mean().item(), rel=1e-6)
    assert metrics["actor/reward_kl_penalty_coeff"] == KL_COEF
    assert "advantages" in trained.batch.keys()  # the advantages were computed from these rewards


def test_adaptive_kl_coefficient_carries_over_from_step_to_step():
    train = stage("algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive",
                  "algorithm.kl_ctrl.target_kl=0.01", "algorithm.kl_ctrl.horizon=10")
    coefficients = []
    for step in range(3):
        batch, parts, *_ = batch_and_parts(seed=step)
        coefficients.append(train._training_batch(batch, parts)[1]["actor/reward_kl_penalty_coeff"])
    assert coefficients[0] == KL_COEF
    # KL here (~0.25) is far above the 0.01 target: verl's controller raises beta after every step
    assert coefficients[0] < coefficients[1] < coefficients[2]


def test_in_bypass_mode_the_kl_is_taken_from_the_behaviour_policy():
    """verl's trainer sets pi_old = pi_behav before it applies the KL penalty."""
    batch, parts, last_token_scores, (_, ref, behav, mask) = batch_and_parts()
    parts["logp"] = LogpResult(index=0, batch_ref=None, old_log_probs=None, logp_version=-1)
    trained, _ = stage("algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=fixed",
                       "algorithm.rollout_correction.bypass_mode=True")._training_batch(batch, parts)
    torch.testing.assert_close(trained.batch["token_level_rewards"], last_token_scores - KL_COEF * (behav - ref) * mask)
    assert torch.equal(trained.batch["old_log_probs"], behav)


def test_without_kl_in_reward_the_rewards_are_the_scores():
    batch, parts, last_token_scores, _ = batch_and_parts()
    trained, metrics = stage("algorithm.use_kl_in_reward=False")._training_batch(batch, parts)
    torch.testing.assert_close(trained.batch["token_level_rewards"], last_token_scores)
    assert not any(key.startswith("actor/reward_kl") for key in metrics)


def test_gae_advantages_and_returns_equal_verls_compute_advantage_with_the_values_stages_values():
    """With a critic, the values stage's values enter the batch and verl's compute_advantage (gae,
    gamma, lam from the config) makes advantages and returns from them, as in verl's trainer."""
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from async_rl.core.messages import ValuesResult

    batch, parts, last_token_scores, (_, _, _, mask) = batch_and_parts()
    values = torch.randn(ROWS, RESPONSE_LEN, generator=torch.Generator().manual_seed(3))
    parts["values"] = ValuesResult(index=0, values=values, critic_version=0, seconds=0.0)
    train = stage("algorithm.adv_estimator=gae", "algorithm.gamma=0.9", "algorithm.lam=0.8",
                  "algorithm.use_kl_in_reward=False", "algorithm.rollout_correction.bypass_mode=True")
    trained, _ = train._training_batch(batch, parts)

    expected = DataProto.from_dict(tensors={"response_mask": mask, "values": values,
                                            "token_level_rewards": last_token_scores})
    expected = compute_advantage(expected, adv_estimator="gae", gamma=0.9, lam=0.8, config=train.config.algorithm)
    torch.testing.assert_close(trained.batch["advantages"], expected.batch["advantages"])
    torch.testing.assert_close(trained.batch["returns"], expected.batch["returns"])
    torch.testing.assert_close(trained.batch["values"], values)
    # not the GRPO advantages of the same scores, nor gae with verl's default gamma = lam = 1
    default = compute_advantage(DataProto.from_dict(tensors={"response_mask": mask, "values": values,
                                                             "token_level_rewards": last_token_scores}),
                                adv_estimator="gae", gamma=1.0, lam=1.0, config=train.config.algorithm)
    assert not torch.allclose(trained.batch["advantages"], default.batch["advantages"])


def test_remax_advantage_is_the_score_less_the_prompts_greedy_score_on_every_token():
    """ReMax: the reward stage's `baselines` (each row's prompt's greedy-sample score) reach verl's
    `compute_remax_outcome_advantage` as `reward_baselines`."""
    batch, parts, _, (*_, mask) = batch_and_parts()
    parts["reward"].baselines = torch.tensor([0.5, 0.5, 1.0, 1.0])  # prompt a's greedy sample 0.5, b's 1.0
    trained, _ = stage("algorithm.adv_estimator=remax")._training_batch(batch, parts)
    want = (parts["reward"].scores - parts["reward"].baselines)[:, None] * mask
    torch.testing.assert_close(trained.batch["advantages"], want)
    # without baselines verl's estimator cannot run at all (what verl 0.9.1's own trainer hits)
    batch, parts, *_ = batch_and_parts()
    with pytest.raises(TypeError, match="reward_baselines"):
        stage("algorithm.adv_estimator=remax")._training_batch(batch, parts)
