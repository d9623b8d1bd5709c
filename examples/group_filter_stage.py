"""A custom stage: drop prompt groups whose rewards all agree (DAPO's dynamic sampling).

A GRPO group whose samples all got the same reward has zero advantage everywhere: it
adds no gradient, only dilutes the token-mean loss. This stage sits between reward and
actor_train and marks those groups to be left out of the update. Two lines of config
put it in the pipeline of any verl command:

    +trainer.async_stages.group_filter.cls=examples.group_filter_stage.GroupFilterStage
    +trainer.async_stages.group_filter.after=reward

and, optionally, `+trainer.async_stages.group_filter.kwargs.min_std=0.05`. verl's own key for
DAPO's dynamic sampling, `algorithm.filter_groups.enable=True`, goes further with the same
rule: state_machines/dynamic_sampling.py draws more prompts until the batch is full.

It logs `async/group_filter/kept_groups` and `async/group_filter/kept_ratio` with each
training step. (DAPO proper also draws more prompts to refill the batch; this stage
only drops: see state_machines/dynamic_sampling.py for that.)
"""

from __future__ import annotations

import dataclasses

from async_rl.core.messages import ScoredBatch
from async_rl.core.scoring import groups_with_distinct_rewards
from state_machines.base import StateMachine


class GroupFilterStage(StateMachine):
    """Marks rows of uniform-reward groups as not trained (ScoredBatch.keep).

    Args:
        config: the verl config (unused here; every user stage receives it).
        name: the stage's name in the config, used in metrics and errors.
        min_std: a group is kept when the std of its rewards exceeds this.
    """

    def __init__(self, config, name: str = "group_filter", min_std: float = 0.0):
        super().__init__(name)
        self.min_std = float(min_std)

    async def process_data(self, scored: ScoredBatch) -> ScoredBatch:
        keep = groups_with_distinct_rewards(scored.uids, scored.scores, self.min_std)
        if scored.keep is not None:  # another filter ran before this one
            keep &= scored.keep
        groups = len(set(scored.uids.tolist()))
        kept_groups = len(set(scored.uids[keep.numpy()].tolist()))
        metrics = {
            **scored.metrics,
            f"async/{self.name}/kept_groups": float(kept_groups),
            f"async/{self.name}/kept_ratio": kept_groups / max(groups, 1),
        }
        return dataclasses.replace(scored, keep=keep, metrics=metrics)
