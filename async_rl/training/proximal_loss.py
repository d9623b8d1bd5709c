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


@register_policy_loss(LOGLINEAR_LOSS_MODE)
def loglinear_decoupled_ppo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Decoupled PPO against the log-linear pi_prox; `(loss, metrics)` as verl's policy losses return them."""
    if rollout_is_weights is None or config is None:
        raise ValueError(f"policy loss {LOGLINEAR_LOSS_MODE!r} needs alpha per token in rollout_is_weights and the "
                         "actor config (+algorithm.proximal_logp_method=loglinear sets both)")
    behaviour, alpha = old_log_prob, rollout_is_weights
    with torch.no_grad():
        proximal = approximate_proximal(behaviour, log_prob.detach(), alpha)
    loss, pg_metrics = decoupled_ppo_loss(proximal, behaviour, log_prob, advantages, response_mask, loss_agg_mode,
                                          config)
    masked = response_mask.bool()
    pg_metrics["actor/proximal_interpolation"] = float(alpha[masked].mean()) if masked.any() else 0.0
    return loss, pg_metrics


@register_policy_loss(UPDATE_FORWARD_LOSS_MODE)
def update_forward_decoupled_ppo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Decoupled PPO with pi_prox the update's own forward (`log_prob`, detached): the pre-update policy while the
    actor takes one optimizer step per training step; `(loss, metrics)` as verl's policy losses return them."""
    if config is None:
        raise ValueError(f"policy loss {UPDATE_FORWARD_LOSS_MODE!r} needs the actor config "
                         "(+algorithm.proximal_logp_method=update_forward sets it)")
    return decoupled_ppo_loss(log_prob.detach(), old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                              config)
