"""logp stage: log-probs of the responses under the newest synced policy (verl's actor engine).

Its weights arrive from param_update (`load_weights`); worker calls are serialized
by the worker actors, so a forward never sees a half-loaded version.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from async_rl import engine_calls
from async_rl.resources import make_worker_group
from state_machines.base import StateMachine
from state_machines.rollout import RolloutBatch


@dataclass
class LogpResult:
    index: int
    batch_ref: Any  # the step's DataProto, by reference (from RolloutBatch)
    old_log_probs: torch.Tensor  # (bs, response_len)
    logp_version: int  # policy version of the weights that computed them


class LogpStage(StateMachine):
    """Recomputes response log-probs with the newest synced weights (verl `compute_log_prob`)."""

    def __init__(self, config, world_size: int):
        super().__init__("logp")
        self.config = config
        self.world_size = world_size
        self.temperature = float(config.actor_rollout_ref.rollout.temperature)
        self.worker_group = None
        self.version = 0

    def setup(self) -> int:
        """Start the worker group (blocking; the driver calls it with a timeout)."""
        self.worker_group = make_worker_group(self.config, "actor", self.world_size, "logp")
        return self.world_size

    async def load_weights(self, version: int, named_tensors) -> int:
        """Load a complete version of full tensors; returns the version now served."""
        await asyncio.to_thread(self.worker_group.load_full_weights, named_tensors)
        self.version = version
        return version

    async def get_input_data(self):
        return await self.next_from_inbox()

    async def process_data(self, data: RolloutBatch) -> LogpResult:
        batch = await data.get()
        version = self.version
        log_probs = await asyncio.to_thread(engine_calls.compute_log_prob, self.worker_group, batch, self.temperature)
        return LogpResult(index=data.index, batch_ref=data.batch_ref, old_log_probs=log_probs, logp_version=version)

    async def send_output_data(self, data: LogpResult) -> bool:
        return await self.send_downstream(data)
