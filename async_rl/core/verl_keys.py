"""verl 0.9.1 settings the pipeline cannot honour yet: each is refused before Ray starts, naming its
key and why, never ignored (`refuse_unsupported`). A row leaves this table when the pipeline learns
to run it (issue 40: LoRA, reward models, ReMax's greedy baseline)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from async_rl.core.config import select_value
from async_rl.core.errors import AsyncConfigError

OPTIMAL_TOKEN_BASELINES = ("optimal_token_baseline", "tir_optimal_token_baseline")


@dataclass(frozen=True)
class Unsupported:
    """`key` set to a value for which `refuses(value)` is true cannot run under the flag; `allowed`
    says what can, `why` what is missing."""

    key: str
    refuses: Callable[[Any], bool]
    allowed: str
    why: str


UNSUPPORTED = (
    Unsupported("algorithm.adv_estimator", lambda v: v == "remax", "any estimator but remax",
                "ReMax needs one greedy sample per prompt, scored, as its baseline (`reward_baselines`); the "
                "generate stage does not produce it, and verl 0.9.1's own trainer fails the same way on this "
                "config"),
    Unsupported("algorithm.adv_estimator", lambda v: v in OPTIMAL_TOKEN_BASELINES,
                f"any estimator but {' / '.join(OPTIMAL_TOKEN_BASELINES)}",
                "the optimal token baseline needs `sum_pi_squared` from the actor's log-prob pass, which the "
                "pipeline's pass does not return"),
    Unsupported("reward.reward_model.enable", bool, "False",
                "the reward stage scores with the rule reward (reward.custom_reward_function, "
                "reward.reward_manager) only; verl's reward-model servers are not started"),
    Unsupported("actor_rollout_ref.model.lora_rank", lambda v: isinstance(v, int) and v > 0, "0",
                "the weight sync sends full weights, which the rollout servers cannot take under PEFT's names: "
                "LoRA does not run under the flag yet"),
    Unsupported("actor_rollout_ref.model.lora_adapter_path", lambda v: bool(v), "null",
                "LoRA does not run under the flag yet (see actor_rollout_ref.model.lora_rank)"),
)


BYPASS = "algorithm.rollout_correction.bypass_mode"
# applied by verl inside its bypass-mode loss (`compute_policy_loss_bypass_mode`), which the pipeline does
# not run: its bypass mode is the data half (pi_old = pi_behav) under the actor's own loss
BYPASS_LOSS_KEYS = {"algorithm.rollout_correction.rollout_is": None, "algorithm.rollout_correction.rollout_rs": None,
                    "algorithm.rollout_correction.loss_type": "ppo_clip"}


def refuse_unsupported(config) -> None:
    """Raise AsyncConfigError for the first setting of `config` in UNSUPPORTED, or for verl's bypass mode
    with a setting only its bypass-mode loss applies (naming both keys)."""
    for rule in UNSUPPORTED:
        value = select_value(config, rule.key, None)
        if value is not None and rule.refuses(value):
            raise AsyncConfigError(rule.key, value, f"{rule.allowed} (the async pipeline: {rule.why})")
    if select_value(config, BYPASS, False) is True:
        for key, neutral in BYPASS_LOSS_KEYS.items():
            value = select_value(config, key, neutral)
            if value != neutral:
                raise AsyncConfigError(key, value, f"{neutral!r} with {BYPASS}=True (verl applies it in its "
                                                   "bypass-mode loss, which the async pipeline does not run; without "
                                                   "bypass mode it is honoured)")
