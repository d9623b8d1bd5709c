"""Decoupled PPO with pi_prox made inside the loss instead of by a forward of its own
(`+algorithm.proximal_logp_method=loglinear` or `update_forward`), registered in verl's policy-loss table as
the loss modes of `PROXIMAL_IN_LOSS`; importing this module registers them.

Their inputs (async_rl/core/decoupled_ppo.py `set_behaviour_as_old` fills them):
- `old_log_prob`: pi_behav, the rollout's log-probs, each token's from the version that sampled it;
- `rollout_is_weights` (`loglinear` only): alpha per token (`interpolation_weights`).

Per micro-batch each makes pi_prox (detached) from them and the current policy's log-probs, then takes the
same loss as the recomputing path: verl's token-level weights pi_prox / pi_behav with decoupled PPO's
threshold (`config.policy_loss.rollout_correction`, written by `apply_proximal_loss`), and verl's vanilla
PPO loss against pi_prox with those weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, register_policy_loss
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

from async_rl.core.decoupled_ppo import LOGLINEAR_LOSS_MODE, UPDATE_FORWARD_LOSS_MODE, approximate_proximal


def decoupled_ppo_loss(proximal: torch.Tensor, behaviour: torch.Tensor, log_prob: torch.Tensor,
                       advantages: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str,
                       config: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's vanilla PPO loss against `proximal` (log pi_prox, no gradient), each token weighted by
    pi_prox / pi_behav and rejected above decoupled PPO's cap; `(loss, metrics)`."""
    settings = config.policy_loss.rollout_correction
    with torch.no_grad():
        weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=proximal,
            rollout_log_prob=behaviour,
            response_mask=response_mask,
            rollout_is=settings.get("rollout_is"),
            rollout_is_threshold=settings.get("rollout_is_threshold"),
            rollout_is_batch_normalize=settings.get("rollout_is_batch_normalize", False),
        )
    loss, pg_metrics = compute_policy_loss_vanilla(
        old_log_prob=proximal,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=weights.batch["rollout_is_weights"] if weights is not None else None,
    )
    pg_metrics.update(metrics)
    return loss, pg_metrics


def register_proximal_loss(loss_mode: str, proximal_of: Callable) -> Callable:
    """Register in verl's policy-loss table, as `loss_mode`, decoupled PPO against the pi_prox that
    `proximal_of(behaviour, current, rollout_is_weights, response_mask)` makes per micro-batch (`current`: the
    policy's log-probs, detached); it returns `(log pi_prox, metrics)`."""

    @register_policy_loss(loss_mode)
    def loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
             response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Optional[Any] = None,
             rollout_is_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, Any]]:
        if config is None:
            raise ValueError(f"policy loss {loss_mode!r} needs the actor config (+algorithm.proximal_logp_method "
                             "sets it)")
        with torch.no_grad():
            proximal, metrics = proximal_of(old_log_prob, log_prob.detach(), rollout_is_weights, response_mask)
        pg_loss, pg_metrics = decoupled_ppo_loss(proximal, old_log_prob, log_prob, advantages, response_mask,
                                                 loss_agg_mode, config)
        pg_metrics.update(metrics)
        return pg_loss, pg_metrics

    return loss


def loglinear_proximal(behaviour, current, alpha, response_mask) -> tuple[torch.Tensor, dict[str, float]]:
    """AReaL's log-linear pi_prox from alpha per token (in `rollout_is_weights`), and alpha's mean."""
    if alpha is None:
        raise ValueError(f"policy loss {LOGLINEAR_LOSS_MODE!r} needs alpha per token in rollout_is_weights "
                         "(+algorithm.proximal_logp_method=loglinear puts it there)")
    masked = response_mask.bool()
    return approximate_proximal(behaviour, current, alpha), {
        "actor/proximal_interpolation": float(alpha[masked].mean()) if masked.any() else 0.0}


def update_forward_proximal(behaviour, current, alpha, response_mask) -> tuple[torch.Tensor, dict[str, float]]:
    """pi_prox the update's own forward: the pre-update policy while the actor takes one optimizer step per
    training step."""
    return current, {}


loglinear_decoupled_ppo_loss = register_proximal_loss(LOGLINEAR_LOSS_MODE, loglinear_proximal)
update_forward_decoupled_ppo_loss = register_proximal_loss(UPDATE_FORWARD_LOSS_MODE, update_forward_proximal)
