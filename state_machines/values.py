"""values stage: the critic's values of each batch, beside logp and ref_logp (PPO with GAE).

It hands each batch to critic_train, which owns the critic's workers and computes the values
with critic version j for batch j (state_machines/critic_train.py states the rule), and sends
them on to actor_train, where verl's `compute_advantage` turns them into GAE's advantages.
"""

from __future__ import annotations

from typing import Any

from async_rl.core.messages import RolloutBatch, ValuesResult
from state_machines.base import StateMachine


class ValuesStage(StateMachine):
    """verl's `_compute_values` for every batch, in batch order, on the critic's workers."""

    def __init__(self, *, critic_train: Any):
        super().__init__("values")
        self.critic_train = critic_train

    async def process_data(self, data: RolloutBatch) -> ValuesResult:
        with self.waiting():  # the critic's previous update, then its forward, on critic_train's workers
            values, version, seconds = await self.critic_train.compute_values.remote(data.index, data.batch_ref)
        return ValuesResult(index=data.index, values=values, critic_version=version, seconds=seconds)
