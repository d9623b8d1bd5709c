"""Decoupled PPO (AReaL, eq. 5) through verl's rollout-correction machinery.

    J(theta) = E[ w * min(u * A, clip(u, 1 - eps_low, 1 + eps_high) * A) ]
    u = pi_theta / pi_prox,   w = pi_prox / pi_behav  (token level, 0 where w > cap)

pi_behav produced the tokens (the rollout's log-probs, possibly several versions per
response); pi_prox is the policy just before the update (its log-probs are recomputed with
the trainer's pre-update weights, on the train ranks or on the logp stage's:
`algorithm.proximal_logp_workers`). verl computes exactly this when
`algorithm.rollout_correction` asks for token-level importance weights with an upper
rejection bound (verl's "IcePop" form: weights outside [lower, upper] are zeroed, the
token-mean denominator is unchanged, as AReaL's `behav_imp_weight_cap` does) and its
vanilla PPO loss multiplies them in. The lower bound 1e-30 is never reached: verl clamps
the log-weight at -20.

Under `async_pipeline=True` this is the default. Keys:

- `+algorithm.decoupled_ppo` (default True): fill `algorithm.rollout_correction` as above.
  False leaves verl's `algorithm.rollout_correction` as the user set it: verl's default
  (no weights) is PPO against the recomputed pi_prox; `bypass_mode=True` is PPO against
  pi_behav (AReaL's "naive PPO"); `bypass_mode=True` with `rollout_is`, `rollout_rs` or
  `loss_type=reinforce` is verl's bypass-mode loss (`compute_policy_loss_bypass_mode`) on the
  train ranks, its weights and rejections from the current policy against pi_behav, per token.
- `+algorithm.behav_imp_weight_cap` (default 5.0, > 1): AReaL's cap.
- `+algorithm.proximal_logp_workers` (default train): where pi_prox is computed.
- `+algorithm.proximal_logp_method` (default recompute): the other two run no pi_prox forward and make pi_prox
  per token inside the loss (async_rl/training/proximal_loss.py). `loglinear`: AReaL's log-linear approximation,

      log pi_prox = log pi_behav + alpha * (log pi_theta - log pi_behav),
      alpha = (j - v) / (j + 1 - v), clamped to [0, 1]

  with j the trainer's version before the update (pi_prox's) and v the version that sampled the token:
  a token of version j gets pi_behav itself, one of version j - 1 the midpoint. `update_forward`: pi_prox is
  the update's own forward (log pi_theta, detached), which is exactly the pre-update policy where the actor
  takes one optimizer step per training step (one PPO epoch, one mini-batch): the recomputed value, free.
"""

from __future__ import annotations

from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from async_rl.core.errors import AsyncConfigError

LOWER_BOUND = "1e-30"  # below exp(-20), verl's clamp: never rejects a token


def rollout_correction_settings(cap: float) -> dict:
    """The `algorithm.rollout_correction` values that make verl's loss AReaL's decoupled PPO."""
    return {
        "rollout_is": "token",
        # a string verl parses as "lower_upper"; written with a decimal point so Hydra keeps it a string
        "rollout_is_threshold": f"{LOWER_BOUND}_{float(cap)!r}",
        "rollout_is_batch_normalize": False,
        "rollout_rs": None,
        "bypass_mode": False,
    }


def conflicting_settings(rollout_correction: Optional[DictConfig]) -> dict:
    """User settings of `algorithm.rollout_correction` that decoupled PPO would overwrite."""
    if rollout_correction is None:
        return {}
    return {
        key: rollout_correction.get(key)
        for key in ("rollout_is", "rollout_rs", "bypass_mode")
        if rollout_correction.get(key) not in (None, False)
    }


def apply_to_config(config: DictConfig, cap: float) -> None:
    """Write decoupled PPO's settings into `config.algorithm.rollout_correction` (in place)."""
    with open_dict(config.algorithm):
        if config.algorithm.get("rollout_correction") is None:
            config.algorithm.rollout_correction = {}
        with open_dict(config.algorithm.rollout_correction):
            for key, value in rollout_correction_settings(cap).items():
                config.algorithm.rollout_correction[key] = value


# what only verl's bypass-mode loss applies, and each key's neutral value (verl's defaults)
BYPASS_LOSS_SETTINGS = {"rollout_is": None, "rollout_rs": None, "loss_type": "ppo_clip"}
BYPASS_LOSS_MODE = "bypass_mode"  # verl's registered policy loss `compute_policy_loss_bypass_mode`
LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode"


def bypass_loss_settings(config: DictConfig) -> dict:
    """The `algorithm.rollout_correction` settings only verl's bypass-mode loss applies, where the
    command set them away from neutral under `bypass_mode=True` (empty otherwise)."""
    if not uses_behaviour_as_old(config):
        return {}
    rollout_correction = config.algorithm.rollout_correction
    return {key: rollout_correction.get(key, neutral) for key, neutral in BYPASS_LOSS_SETTINGS.items()
            if rollout_correction.get(key, neutral) != neutral}


def apply_bypass_loss(config: DictConfig) -> bool:
    """verl's bypass mode with IS, RS or REINFORCE (`bypass_loss_settings`): the actor's loss becomes
    verl's `compute_policy_loss_bypass_mode` with `algorithm.rollout_correction` as its settings, the
    config half of verl's `apply_bypass_mode` (in place, before the workers are built: they read their
    loss from `actor_rollout_ref.actor.policy_loss`). Returns whether it did."""
    if not bypass_loss_settings(config):
        return False
    _use_policy_loss(config, BYPASS_LOSS_MODE)
    return True


def _use_policy_loss(config: DictConfig, loss_mode: str) -> None:
    """The actor's loss becomes `loss_mode`, with `algorithm.rollout_correction` copied beside it as its settings
    (in place, before the workers are built: they read their loss from `actor_rollout_ref.actor.policy_loss`)."""
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    with open_dict(policy_loss):
        policy_loss.rollout_correction = OmegaConf.to_container(config.algorithm.rollout_correction, resolve=True)
        policy_loss.loss_mode = loss_mode


# pi_prox by a forward pass of the pre-update weights, interpolated, or the update's own forward
RECOMPUTE, LOGLINEAR, UPDATE_FORWARD = "recompute", "loglinear", "update_forward"
PROXIMAL_LOGP_METHODS = (RECOMPUTE, LOGLINEAR, UPDATE_FORWARD)
LOGLINEAR_LOSS_MODE = "decoupled_loglinear"
UPDATE_FORWARD_LOSS_MODE = "decoupled_update_forward"
# the methods that make pi_prox inside the loss, and the policy loss async_rl/training/proximal_loss.py registers for each
PROXIMAL_IN_LOSS = {LOGLINEAR: LOGLINEAR_LOSS_MODE, UPDATE_FORWARD: UPDATE_FORWARD_LOSS_MODE}
PROXIMAL_METHOD_KEY = "algorithm.proximal_logp_method"


def apply_proximal_loss(config: DictConfig, method: str) -> None:
    """A `method` of `PROXIMAL_IN_LOSS`: the actor's loss becomes its loss mode, with decoupled PPO's
    `algorithm.rollout_correction` settings (its cap) beside it, as verl's bypass mode passes its own (in place,
    before the workers are built)."""
    _use_policy_loss(config, PROXIMAL_IN_LOSS[method])


def check_proximal_method(config: DictConfig, method: str, decoupled_ppo: bool) -> None:
    """`algorithm.proximal_logp_method` against the rest of `config` (before `apply_proximal_loss`): a pi_prox made
    in the loss is decoupled PPO's, taken in its own loss, with no forward to place; `update_forward`'s is exact
    only while the update's forward runs on the pre-update weights (one optimizer step per training step).
    AsyncConfigError names the key that cannot go with it."""
    if method not in PROXIMAL_IN_LOSS:
        return
    key = PROXIMAL_METHOD_KEY
    if not decoupled_ppo:
        raise AsyncConfigError(key, method, "recompute without decoupled PPO (algorithm.decoupled_ppo is off, or "
                                            "algorithm.rollout_correction is set by the command): it makes "
                                            "decoupled PPO's pi_prox")
    loss_mode = OmegaConf.select(config, LOSS_MODE, default="vanilla")
    if loss_mode != "vanilla":
        raise AsyncConfigError(LOSS_MODE, loss_mode, f"vanilla with +{key}={method} (its loss is decoupled PPO's "
                                                     "against the pi_prox it makes)")
    workers = OmegaConf.select(config, "algorithm.proximal_logp_workers")
    if workers is not None:
        raise AsyncConfigError("algorithm.proximal_logp_workers", workers,
                               f"unset with +{key}={method} (no pi_prox forward runs to place)")
    if method == UPDATE_FORWARD:
        check_one_optimizer_step(config)


def check_one_optimizer_step(config: DictConfig) -> None:
    """The actor takes one optimizer step per training step: one PPO epoch over one mini-batch (its
    `ppo_mini_batch_size` at least `data.train_batch_size`, both in prompts), so every micro-batch's forward runs
    on the pre-update weights; AsyncConfigError names the key otherwise."""
    why = f"with +{PROXIMAL_METHOD_KEY}={UPDATE_FORWARD}: its pi_prox is the update's forward, the pre-update policy " \
          "only until the first optimizer step"
    epochs = OmegaConf.select(config, "actor_rollout_ref.actor.ppo_epochs", default=1)
    if int(epochs) != 1:
        raise AsyncConfigError("actor_rollout_ref.actor.ppo_epochs", epochs, f"1 {why}")
    mini = OmegaConf.select(config, "actor_rollout_ref.actor.ppo_mini_batch_size")
    batch = OmegaConf.select(config, "data.train_batch_size")
    if mini is not None and batch is not None and int(mini) < int(batch):
        raise AsyncConfigError("actor_rollout_ref.actor.ppo_mini_batch_size", mini,
                               f"at least data.train_batch_size ({batch}) {why}")


def proximal_in_loss(config: DictConfig) -> bool:
    """pi_prox is made inside the loss, with no forward of its own (`apply_proximal_loss` ran)."""
    return OmegaConf.select(config, LOSS_MODE) in PROXIMAL_IN_LOSS.values()


def recomputes_proximal(config: DictConfig) -> bool:
    """A forward pass of the pre-update weights gives pi_prox (neither bypass mode nor a pi_prox made in the loss)."""
    return not uses_behaviour_as_old(config) and not proximal_in_loss(config)


def interpolation_weights(token_versions: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """alpha per token (float32, the shape of `token_versions`): (j - v) / (j + 1 - v) in [0, 1] for a token
    sampled by version v >= 0 trained at version j; 0 where v < 0 (padding)."""
    v = token_versions.to(torch.float32)
    j = float(trainer_version)
    alpha = ((j - v) / (j + 1 - v).clamp(min=1.0)).clamp(0.0, 1.0)
    return torch.where(token_versions >= 0, alpha, torch.zeros_like(alpha))


def approximate_proximal(behaviour: torch.Tensor, current: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """AReaL's log-linear pi_prox: log pi_behav + alpha * (log pi_theta - log pi_behav), from `current` as given
    (the loss passes it detached: pi_prox carries no gradient)."""
    return behaviour + alpha.to(behaviour.dtype) * (current - behaviour)


def uses_behaviour_as_old(config: DictConfig) -> bool:
    """verl's bypass mode: PPO's pi_old is the behaviour policy (no recomputed log-probs)."""
    rollout_correction = config.algorithm.get("rollout_correction")
    return bool(rollout_correction is not None and rollout_correction.get("bypass_mode", False))


def set_behaviour_as_old(batch, config: DictConfig, trainer_version: Optional[int] = None) -> None:
    """Bypass mode: old_log_probs become the behaviour log-probs, the rollout's own per token (each
    token's from the version that sampled it): the data half of verl's apply_bypass_mode, which verl's
    trainer runs before the KL penalty and the advantages. A pi_prox made in the loss likewise; the log-linear
    approximation's alpha per token (`interpolation_weights` at `trainer_version`) rides in `rollout_is_weights`,
    the loss's one per-token input beside them (`LOGLINEAR_LOSS_MODE` turns both into pi_prox and its weights)."""
    if recomputes_proximal(config) or "rollout_log_probs" not in batch.batch.keys():
        return
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    if OmegaConf.select(config, LOSS_MODE) == LOGLINEAR_LOSS_MODE:
        if trainer_version is None:
            raise ValueError("the log-linear pi_prox needs the trainer's version")
        batch.batch["rollout_is_weights"] = interpolation_weights(batch.batch["token_versions"], trainer_version)


def add_correction(batch, config: DictConfig):
    """As verl's trainer does before advantages; returns `(batch, metrics)`.

    verl's importance weights (`rollout_is_weights`) and `rollout_corr/*` metrics from the
    proximal (`old_log_probs`) and behaviour (`rollout_log_probs`) log-probs; nothing in
    bypass mode or with pi_prox made in the loss (`set_behaviour_as_old` is all they need).
    """
    rollout_correction = config.algorithm.get("rollout_correction")
    if rollout_correction is None or "rollout_log_probs" not in batch.batch.keys() or not recomputes_proximal(config):
        return batch, {}
    if not bool(batch.batch["response_mask"].any()):  # verl refuses a batch with no valid token
        return batch, {}
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    batch, metrics = compute_rollout_correction_and_add_to_batch(batch, rollout_correction)
    return batch, {k: float(v) for k, v in metrics.items()}
