"""logp stage: log-probs of the responses under the newest synced policy (verl's actor engine).

It is also a weight receiver (param_update/overlapped.py): buckets of the next version
are staged on its workers while they compute with the current one; the load waits for
the forward in progress and the next forward waits for the load, so a forward never
sees two versions.
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


def _slowest(per_rank: list[dict]) -> dict:
    return {key: max(r[key] for r in per_rank) for key in per_rank[0]}


class LogpStage(StateMachine):
    """Recomputes response log-probs with the newest synced weights (verl `compute_log_prob`).

    Args:
        config: the verl config.
        world_size: logp worker processes (FSDP2 ranks).
        consume_bucket_bytes: bytes loaded into the shards at a time.
    """

    def __init__(self, config, world_size: int, consume_bucket_bytes: int = 128 << 20):
        super().__init__("logp")
        self.config = config
        self.world_size = world_size
        self.consume_bucket_bytes = consume_bucket_bytes
        self.temperature = float(config.actor_rollout_ref.rollout.temperature)
        self.worker_group = None
        self.version = 0
        self._weights_in_use = asyncio.Lock()  # a forward or a load, never both

    def setup(self) -> int:
        """Start the worker group and its staging buffers (blocking; the driver calls it with a timeout)."""
        self.worker_group = make_worker_group(self.config, "actor", self.world_size, "logp")
        self.worker_group.configure_weight_sync()
        return self.world_size

    def weight_digests(self) -> dict[str, str]:
        """name -> digest of the full weights this stage's workers hold (bit-identity checks)."""
        return self.worker_group.weight_digests()[0]

    # ---- weight receiver ---------------------------------------------------------------
    async def stage_weight_bucket(self, version: int, index: int, refs: list, slices: list) -> dict:
        per_rank = await asyncio.to_thread(self.worker_group.stage_weight_bucket, version, index, refs, slices)
        return _slowest(per_rank)

    async def check_weights(self, version: int, num_buckets: int) -> None:
        await asyncio.to_thread(self.worker_group.check_weights, version, num_buckets)

    async def discard_weights(self, version: int) -> None:
        await asyncio.to_thread(self.worker_group.discard_weights, version)

    async def commit_weights(self, version: int, num_buckets: int) -> dict:
        """load: waits for the forward in progress, then loads `version` into every rank."""
        loop = asyncio.get_running_loop()
        async with self._weights_in_use:
            start = loop.time()
            await asyncio.to_thread(self.worker_group.commit_weights, version, num_buckets, self.consume_bucket_bytes)
            self.version = version
            load_s = loop.time() - start
        return {"load_s": load_s, "blocked_s": load_s}

    # ---- the state machine -----------------------------------------------------------------
    async def get_input_data(self):
        return await self.next_from_inbox()

    async def process_data(self, data: RolloutBatch) -> LogpResult:
        batch = await data.get()
        async with self._weights_in_use:
            version = self.version
            log_probs = await asyncio.to_thread(
                engine_calls.compute_log_prob, self.worker_group, batch, self.temperature
            )
        return LogpResult(index=data.index, batch_ref=data.batch_ref, old_log_probs=log_probs, logp_version=version)

    async def send_output_data(self, data: LogpResult) -> bool:
        return await self.send_downstream(data)
