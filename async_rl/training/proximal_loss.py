"""Decoupled PPO with pi_prox approximated instead of recomputed (`+algorithm.proximal_logp_method=loglinear`),
registered in verl's policy-loss table as `LOGLINEAR_LOSS_MODE`; importing this module registers it.

Its inputs, under that mode (async_rl/core/decoupled_ppo.py `set_behaviour_as_old` fills them):
- `old_log_prob`: pi_behav, the rollout's log-probs, each token's from the version that sampled it;
- `rollout_is_weights`: alpha per token (`interpolation_weights`).

Per micro-batch it makes pi_prox from them and the current policy's log-probs (detached), then takes the
same loss as the recomputing path: verl's token-level weights pi_prox / pi_behav with decoupled PPO's
threshold (`config.policy_loss.rollout_correction`, written by `apply_loglinear_loss`), and verl's vanilla
PPO loss against pi_prox with those weights.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, register_policy_loss
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

from async_rl.core.decoupled_ppo import LOGLINEAR_LOSS_MODE, approximate_proximal


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
    settings = config.policy_loss.rollout_correction
    with torch.no_grad():
        proximal = approximate_proximal(behaviour, log_prob.detach(), alpha)
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
    masked = response_mask.bool()
    pg_metrics["actor/proximal_interpolation"] = float(alpha[masked].mean()) if masked.any() else 0.0
    pg_metrics.update(metrics)
    return loss, pg_metrics
