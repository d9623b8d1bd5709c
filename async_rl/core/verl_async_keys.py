"""verl's async-trainer settings read as the pipeline's own: its standalone rollout nodes
(`actor_rollout_ref.rollout.nnodes`, the placement) and its V1 sampler's `max_off_policy_threshold` (the bound
on the policy versions a trajectory spans). Each takes the `AsyncPipelineConfig` read so far and returns it
with the setting applied, or raises AsyncConfigError naming the key."""

from __future__ import annotations

import dataclasses
import logging

from omegaconf import DictConfig, OmegaConf

from async_rl.core.config import AsyncPipelineConfig, role_ratios, select_value
from async_rl.core.errors import AsyncConfigError
from async_rl.core.placement import RATIOS_KEY, standalone_rollout_ratios
from async_rl.core.verl_keys import raw_default

logger = logging.getLogger(__name__)


ROLLOUT_NODES_KEY = "actor_rollout_ref.rollout.nnodes"


def job_nodes(config: DictConfig) -> int:
    """The job's nodes: `trainer.nnodes`, and verl's standalone rollout nodes (`rollout.nnodes`) after them."""
    return int(config.trainer.nnodes) + max(0, int(config.actor_rollout_ref.rollout.get("nnodes") or 0))


def standalone_rollout(config: DictConfig, async_cfg: AsyncPipelineConfig) -> AsyncPipelineConfig:
    """`async_cfg` placing generation on verl's standalone rollout nodes when `rollout.nnodes` > 0 (its ratios:
    placement.standalone_rollout_ratios); AsyncConfigError where they cannot be: nodes of another size than
    the trainer's, or `+trainer.use_nodes_ratios` set too."""
    rollout = config.actor_rollout_ref.rollout
    extra = int(rollout.get("nnodes") or 0)
    if extra <= 0:
        return async_cfg
    per_node = int(config.trainer.n_gpus_per_node)
    if int(rollout.get("n_gpus_per_node") or 0) != per_node:
        raise AsyncConfigError("actor_rollout_ref.rollout.n_gpus_per_node", rollout.get("n_gpus_per_node"),
                               f"trainer.n_gpus_per_node's {per_node} with {ROLLOUT_NODES_KEY}={extra} (the pipeline's "
                               "nodes each hold the same number of devices)")
    if OmegaConf.select(config, RATIOS_KEY) is not None:
        raise AsyncConfigError(ROLLOUT_NODES_KEY, extra, f"0 with +{RATIOS_KEY}: both place generation, set one")
    ratios = standalone_rollout_ratios(int(config.trainer.nnodes), extra)
    return dataclasses.replace(async_cfg, use_nodes_ratios=ratios, ratios_by_role=role_ratios(ratios))


OFF_POLICY_KEY = "trainer.v1.sampler.max_off_policy_threshold"
AHEAD_KEY = "trainer.generate_ahead_steps"


def versions_spanned_bound(config: DictConfig, async_cfg: AsyncPipelineConfig) -> AsyncPipelineConfig:
    """verl's V1 `max_off_policy_threshold` (the most policy versions a trajectory may span; null: no bound of
    verl's), set away from verl's default (which binds only verl's V1 async modes), as the pipeline's: with
    k = `+trainer.generate_ahead_steps` a trajectory spans at most k versions, so k is lowered to it.
    AsyncConfigError for a threshold verl refuses, or one below a k the command sets."""
    threshold = select_value(config, OFF_POLICY_KEY, None)
    if threshold is None or threshold == raw_default(OFF_POLICY_KEY):
        return async_cfg
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise AsyncConfigError(OFF_POLICY_KEY, threshold, "null or an int >= 1 (the most versions a trajectory spans)")
    ahead = async_cfg.generate_ahead_steps
    if threshold >= ahead:
        return async_cfg
    if OmegaConf.select(config, AHEAD_KEY) is not None:
        raise AsyncConfigError(f"+{AHEAD_KEY}", ahead, f"at most {OFF_POLICY_KEY}={threshold}: a trajectory spans up "
                               f"to {AHEAD_KEY} policy versions (set one of them)")
    logger.warning("%s=%d: +%s=%d (a trajectory spans at most that many policy versions)", OFF_POLICY_KEY, threshold,
                   AHEAD_KEY, threshold)
    return dataclasses.replace(async_cfg, generate_ahead_steps=threshold)
