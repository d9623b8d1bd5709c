"""Decoupled PPO: verl's loss with the settings of async_rl/core/decoupled_ppo.py equals AReaL's
equation (paper eq. 5, with AReaL's `behav_imp_weight_cap`: tokens over the cap get weight 0
and still count in the token-mean denominator), written out here by hand."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from async_rl.core.decoupled_ppo import (
    add_correction,
    apply_to_config,
    conflicting_settings,
    rollout_correction_settings,
    set_behaviour_as_old,
)

EPS_LOW, EPS_HIGH, CAP = 0.2, 0.28, 5.0


def areal_loss(logp, prox, behav, adv, mask, cap=CAP, c_clip=None):
    """-(1/|mask|) sum_t w_t min(u_t A_t, clip(u_t, 1-eps_low, 1+eps_high) A_t), u = pi/pi_prox,
    w = pi_prox/pi_behav, w := 0 where w > cap; dual clip (AReaL's c_clip) caps the loss at c|A|."""
    mask = mask.bool()
    u = torch.exp(logp - prox)
    loss = torch.maximum(-adv * u, -adv * u.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
    if c_clip is not None:
        loss = torch.minimum(loss, c_clip * adv.abs())
    w = torch.exp(prox - behav)
    w = torch.where(mask & (w <= cap), w, torch.zeros_like(w))
    return (loss * w).masked_fill(~mask, 0.0).sum() / mask.sum().clamp(min=1)


def plain_ppo_loss(logp, old, adv, mask):
    """Standard PPO clip, token mean: what the decoupled loss must reduce to when behaviour == proximal."""
    u = torch.exp(logp - old)
    loss = torch.maximum(-adv * u, -adv * u.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
    return loss.masked_fill(~mask.bool(), 0.0).sum() / mask.sum().clamp(min=1)


def actor_config(clip_ratio_c=1e9, **fields):
    from verl.workers.config.actor import FSDPActorConfig

    return FSDPActorConfig(
        strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=clip_ratio_c, loss_agg_mode="token-mean",
        **fields,
    )


def verl_config(cap=CAP):
    config = OmegaConf.create({"algorithm": {"rollout_correction": {"rollout_is": None, "rollout_is_threshold": 2.0}}})
    apply_to_config(config, cap)
    return config


def verl_loss(logp, prox, behav, adv, mask, cap=CAP, clip_ratio_c=1e9):
    """The pipeline's path: verl's rollout correction on the batch, then verl's vanilla PPO loss."""
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    batch = DataProto.from_dict(
        tensors={"old_log_probs": prox, "rollout_log_probs": behav, "response_mask": mask.long()}
    )
    batch, metrics = add_correction(batch, verl_config(cap))
    assert any(k.startswith("rollout_corr/") for k in metrics)
    weights = batch.batch["rollout_is_weights"] if "rollout_is_weights" in batch.batch.keys() else None
    loss, _ = compute_policy_loss_vanilla(
        old_log_prob=prox, log_prob=logp, advantages=adv, response_mask=batch.batch["response_mask"].bool(),
        loss_agg_mode="token-mean", config=actor_config(clip_ratio_c), rollout_is_weights=weights,
    )
    return loss


def random_batch(seed, rows=8, length=16, behav_spread=0.8):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    prox = -torch.rand(rows, length, generator=gen, dtype=torch.float64) * 3 - 0.05
    logp = prox + torch.randn(rows, length, generator=gen, dtype=torch.float64) * 0.3
    behav = prox - torch.randn(rows, length, generator=gen, dtype=torch.float64) * behav_spread
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, length).clone()
    return logp, prox, behav, adv, mask


def loss_and_grad(fn, logp):
    x = logp.detach().clone().requires_grad_(True)
    loss = fn(x)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def assert_same(logp, prox, behav, adv, mask, **kwargs):
    want, want_grad = loss_and_grad(lambda x: areal_loss(x, prox, behav, adv, mask, **kwargs), logp)
    got, got_grad = loss_and_grad(lambda x: verl_loss(x, prox, behav, adv, mask), logp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    return got


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_the_papers_equation_on_random_tensors(seed):
    assert_same(*random_batch(seed))


def test_a_fully_masked_row_contributes_nothing():
    logp, prox, behav, adv, mask = random_batch(3)
    mask[2] = 0
    with_row = assert_same(logp, prox, behav, adv, mask)
    keep = [i for i in range(len(mask)) if i != 2]
    without_row = verl_loss(logp[keep], prox[keep], behav[keep], adv[keep], mask[keep])
    torch.testing.assert_close(with_row, without_row)


def test_tool_tokens_inside_a_response_get_no_gradient_and_no_say_in_the_loss():
    """A multi-turn trajectory: the environment's tokens sit between the model's turns with
    response_mask 0. Whatever their log-probs (current, proximal, behaviour), the loss is the same
    and their gradient is 0."""
    logp, prox, behav, adv, mask = random_batch(4)
    mask[:, 5:9] = 0  # an environment reply in the middle of every response
    mask[:, :5] = 1
    loss, grad = loss_and_grad(lambda x: verl_loss(x, prox, behav, adv, mask), logp)
    assert torch.all(grad[:, 5:9] == 0) and torch.any(grad[:, :5] != 0)
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 5
    tool = torch.zeros_like(mask, dtype=torch.bool)
    tool[:, 5:9] = True
    changed = [torch.where(tool, t + noise, t) for t in (logp, prox, behav)]
    torch.testing.assert_close(verl_loss(*changed, adv, mask), loss, rtol=0, atol=0)
    assert_same(logp, prox, behav, adv, mask)


def test_extreme_log_ratios_stay_finite_and_match():
    logp, prox, behav, adv, mask = random_batch(4)
    mask[:2] = 1
    logp[0, :4] = prox[0, :4] + torch.tensor([15.0, -15.0, 12.0, -12.0], dtype=torch.float64)  # u far outside the clip
    behav[1, :4] = prox[1, :4] - torch.tensor([18.0, -18.0, 1.5, 1.7], dtype=torch.float64)  # w = e^18 ... e^-18
    loss = assert_same(logp, prox, behav, adv, mask)
    assert torch.isfinite(loss)


def test_tokens_over_the_cap_are_dropped_not_truncated():
    logp, prox, behav, adv, mask = random_batch(5)
    behav = prox - torch.rand_like(prox) * 4  # w in [1, e^4]: about 60% over the cap of 5
    over = (torch.exp(prox - behav) > CAP) & mask.bool()
    assert over.sum() > 10
    assert_same(logp, prox, behav, adv, mask)
    # truncating at the cap (verl's plain threshold 5.0) would be a different loss
    truncated_w = torch.exp(prox - behav).clamp(max=CAP)
    u = torch.exp(logp - prox)
    per_token = torch.maximum(-adv * u, -adv * u.clamp(1 - EPS_LOW, 1 + EPS_HIGH)) * truncated_w
    truncated = per_token.masked_fill(~mask.bool(), 0).sum() / mask.sum()
    assert not torch.allclose(truncated, areal_loss(logp, prox, behav, adv, mask))


def test_dual_clip_matches_arealss_c_clip():
    logp, prox, behav, adv, mask = random_batch(6)
    logp = prox + 2.0  # u = e^2 > clip_ratio_c = 3 wherever A < 0
    want = areal_loss(logp, prox, behav, adv, mask, c_clip=3.0)
    got = verl_loss(logp, prox, behav, adv, mask, clip_ratio_c=3.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_reduces_to_standard_ppo_when_behaviour_equals_proximal():
    logp, prox, _, adv, mask = random_batch(7)
    got = verl_loss(logp, prox, prox.clone(), adv, mask)
    torch.testing.assert_close(got, plain_ppo_loss(logp, prox, adv, mask), rtol=1e-12, atol=1e-12)


def test_bypass_mode_trains_against_the_behaviour_policy():
    from verl import DataProto

    logp, prox, behav, _, mask = random_batch(8)
    config = OmegaConf.create({"algorithm": {"rollout_correction": {"bypass_mode": True}}})
    batch = DataProto.from_dict(tensors={"old_log_probs": prox, "rollout_log_probs": behav, "response_mask": mask})
    set_behaviour_as_old(batch, config)
    assert torch.equal(batch.batch["old_log_probs"], behav)
    batch, metrics = add_correction(batch, config)
    assert torch.equal(batch.batch["old_log_probs"], behav)
    assert "rollout_is_weights" not in batch.batch.keys() and metrics == {}


def test_settings_survive_verls_config_and_dataclass():
    """The threshold stays the string "1e-30_5.0" through Hydra and verl's RolloutCorrectionConfig."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.utils.config import omega_conf_to_dataclass

    from helpers.lineage import compose_ppo

    config = compose_ppo([])
    assert conflicting_settings(config.algorithm.rollout_correction) == {}
    apply_to_config(config, 7.5)
    parsed = omega_conf_to_dataclass(config.algorithm.rollout_correction, RolloutCorrectionConfig)
    assert parsed.rollout_is == "token" and parsed.rollout_is_threshold == "1e-30_7.5"
    assert rollout_correction_settings(2)["rollout_is_threshold"] == "1e-30_2.0"
    user = compose_ppo(["algorithm.rollout_correction.rollout_is=sequence"])
    assert conflicting_settings(user.algorithm.rollout_correction) == {"rollout_is": "sequence"}


# ---- pi_prox by AReaL's log-linear approximation (+algorithm.proximal_logp_method=loglinear)


def test_the_interpolation_weight_is_0_for_the_trainers_own_version_and_half_one_version_back():
    from async_rl.core.decoupled_ppo import interpolation_weights

    versions = torch.tensor([[7, 6, 5, 3, -1], [7, 7, -1, -1, -1]])
    alpha = interpolation_weights(versions, trainer_version=7)
    want = torch.tensor([[0.0, 1 / 2, 2 / 3, 4 / 5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(alpha, want)


def loglinear_actor_config(cap=CAP):
    from verl.workers.config.actor import PolicyLossConfig

    from async_rl.core.decoupled_ppo import LOGLINEAR_LOSS_MODE

    return actor_config(policy_loss=PolicyLossConfig(loss_mode=LOGLINEAR_LOSS_MODE,
                                                     rollout_correction=verl_config(cap).algorithm.rollout_correction))


def loglinear_loss(logp, behav, alpha, adv, mask):
    """The registered loss, looked up as verl's ppo_loss looks it up."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import async_rl.training.proximal_loss  # noqa: F401 (registers it)
    from async_rl.core.decoupled_ppo import LOGLINEAR_LOSS_MODE

    loss, metrics = get_policy_loss_fn(LOGLINEAR_LOSS_MODE)(
        old_log_prob=behav, log_prob=logp, advantages=adv, response_mask=mask.bool(), loss_agg_mode="token-mean",
        config=loglinear_actor_config(), rollout_is_weights=alpha)
    assert 0 <= metrics["actor/proximal_interpolation"] <= 1
    return loss


@pytest.mark.parametrize("seed", [0, 1])
def test_the_loglinear_loss_is_the_papers_equation_against_the_interpolated_proximal_policy(seed):
    """Loss and gradient equal AReaL's eq. 5 with pi_prox = pi_behav + alpha (pi_theta - pi_behav) in log space,
    pi_prox taken as a constant (no gradient through it), and the cap applied to pi_prox / pi_behav."""
    from async_rl.core.decoupled_ppo import interpolation_weights

    logp, _, behav, adv, mask = random_batch(seed, behav_spread=1.5)
    versions = torch.randint(0, 4, mask.shape, generator=torch.Generator().manual_seed(seed)) + 3
    alpha = interpolation_weights(versions, trainer_version=6)
    assert 0 < alpha.mean() < 1
    prox = behav + alpha.double() * (logp - behav)
    over = (torch.exp(prox - behav) > CAP) & mask.bool()
    assert over.any()  # the cap is exercised
    want, want_grad = loss_and_grad(lambda x: areal_loss(x, prox, behav, adv, mask), logp)
    got, got_grad = loss_and_grad(lambda x: loglinear_loss(x, behav, alpha, adv, mask), logp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


def test_the_loglinear_loss_is_ppo_against_the_behaviour_policy_for_fresh_tokens():
    logp, _, behav, adv, mask = random_batch(9)
    got = loglinear_loss(logp, behav, torch.zeros_like(mask, dtype=torch.float32), adv, mask)
    torch.testing.assert_close(got, plain_ppo_loss(logp, behav, adv, mask), rtol=1e-12, atol=1e-12)


def test_under_loglinear_the_batch_carries_behaviour_and_alpha_and_verls_weights_stay_out():
    from verl import DataProto

    from async_rl.core.decoupled_ppo import LOGLINEAR, apply_proximal_loss, interpolation_weights, recomputes_proximal

    _, prox, behav, _, mask = random_batch(10)
    versions = torch.full(mask.shape, 4, dtype=torch.long).masked_fill(~mask.bool(), -1)
    config = OmegaConf.create({"algorithm": verl_config().algorithm,
                               "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "vanilla"}}}})
    assert recomputes_proximal(config)
    apply_proximal_loss(config, LOGLINEAR)
    assert not recomputes_proximal(config)
    assert config.actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold == f"1e-30_{CAP!r}"
    batch = DataProto.from_dict(tensors={"old_log_probs": prox, "rollout_log_probs": behav, "response_mask": mask,
                                         "token_versions": versions})
    with pytest.raises(ValueError, match="trainer's version"):
        set_behaviour_as_old(batch, config)
    set_behaviour_as_old(batch, config, trainer_version=5)
    assert torch.equal(batch.batch["old_log_probs"], behav)
    torch.testing.assert_close(batch.batch["rollout_is_weights"], interpolation_weights(versions, 5))
    batch, metrics = add_correction(batch, config)
    assert metrics == {} and torch.equal(batch.batch["rollout_is_weights"], interpolation_weights(versions, 5))


# ---- pi_prox the update's own forward (+algorithm.proximal_logp_method=update_forward)


def update_forward_loss(logp, behav, adv, mask):
    """The registered loss, looked up as verl's ppo_loss looks it up (no alpha: it takes none)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config.actor import PolicyLossConfig

    import async_rl.training.proximal_loss  # noqa: F401 (registers it)
    from async_rl.core.decoupled_ppo import UPDATE_FORWARD_LOSS_MODE

    config = actor_config(policy_loss=PolicyLossConfig(loss_mode=UPDATE_FORWARD_LOSS_MODE,
                                                       rollout_correction=verl_config().algorithm.rollout_correction))
    loss, _ = get_policy_loss_fn(UPDATE_FORWARD_LOSS_MODE)(
        old_log_prob=behav, log_prob=logp, advantages=adv, response_mask=mask.bool(), loss_agg_mode="token-mean",
        config=config)
    return loss


@pytest.mark.parametrize("seed", [0, 1])
def test_the_update_forward_loss_is_the_papers_equation_with_the_pre_update_policy_as_pi_prox(seed):
    """With pi_prox the forward's own log-probs (the pre-update policy, as a constant), loss and gradient equal
    AReaL's eq. 5 against a recomputed pi_prox of the same values: u = 1, w = pi_prox / pi_behav under the cap."""
    logp, _, behav, adv, mask = random_batch(seed, behav_spread=1.5)
    prox = logp.detach().clone()  # what a recompute with the same weights gives
    assert ((torch.exp(prox - behav) > CAP) & mask.bool()).any()  # the cap is exercised
    want, want_grad = loss_and_grad(lambda x: areal_loss(x, prox, behav, adv, mask), logp)
    got, got_grad = loss_and_grad(lambda x: update_forward_loss(x, behav, adv, mask), logp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    # not plain PPO against the behaviour policy: the weights pi_prox / pi_behav are in it
    assert not torch.allclose(got, plain_ppo_loss(logp, behav, adv, mask))


def test_under_update_forward_the_batch_carries_the_behaviour_policy_and_no_interpolation_weights():
    from verl import DataProto

    from async_rl.core.decoupled_ppo import UPDATE_FORWARD, apply_proximal_loss, recomputes_proximal

    _, prox, behav, _, mask = random_batch(11)
    config = OmegaConf.create({"algorithm": verl_config().algorithm,
                               "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "vanilla"}}}})
    apply_proximal_loss(config, UPDATE_FORWARD)
    assert not recomputes_proximal(config)
    batch = DataProto.from_dict(tensors={"old_log_probs": prox, "rollout_log_probs": behav, "response_mask": mask})
    set_behaviour_as_old(batch, config)  # no trainer version needed: no alpha
    assert torch.equal(batch.batch["old_log_probs"], behav) and "rollout_is_weights" not in batch.batch.keys()
    batch, metrics = add_correction(batch, config)
    assert metrics == {} and "rollout_is_weights" not in batch.batch.keys()
