"""The CPU backend inside verl's own trainers: the worker-side rollout adapter (hybrid mode).

verl's synchronous trainer fuses actor and rollout: every `ActorRolloutRefWorker` builds
`get_rollout_class(rollout.name, "async")(config, model_config, device_mesh)` and, after each
update, calls `resume(["weights"])`, `update_weights(<per-tensor generator>, global_steps=...)`,
`resume(["kv_cache"])` on it (verl 0.9.1 `workers/engine_workers.py`, the naive sync). This
adapter hands the weights to its replica's `CPURolloutServer` actor, found by name as verl's
sglang adapter finds its server. The server is its own process (no accelerator to share), so
sleep / wake-up have nothing to free.
"""

from __future__ import annotations

import os
from typing import Any

import ray
from verl.workers.rollout.base import BaseRollout


def server_actor_name(replica_rank: int) -> str:
    """Ray name of a replica's server (`CPURolloutReplica._server_name` for a policy replica)."""
    return f"cpu_rollout_server_{replica_rank}"


class CPUServerAdapter(BaseRollout):
    """Forwards a trainer rank's weights to its replica's CPU rollout server."""

    def __init__(self, config, model_config, device_mesh=None, replica_rank: int = -1, **kwargs: Any):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        ranks_per_replica = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // ranks_per_replica if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % ranks_per_replica == 0
        self._server = None

    async def resume(self, tags: list[str]) -> None:
        """Nothing was released: weights and KV cache stay in the server's host memory."""

    async def release(self) -> None:
        """Nothing to release on CPU (see `resume`)."""

    async def update_weights(
        self, weights, wire_format: str = "named_tensors", global_steps: int | None = None,
        peft_config=None, base_sync_done: bool = True, **kwargs: Any,
    ) -> None:
        """Drain the per-tensor generator (every rank: each item is a collective); the replica's
        leader rank sends the full tensors to the server, which loads them between decoding steps.

        LoRA (`peft_config` set), as verl's engine worker sends it: with `base_sync_done=False` the base
        weights (PEFT's `.base_layer.` names mapped to the model's), else the adapter's tensors, which
        the server merges onto its base (param_update/lora.py)."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the cpu rollout takes full named tensors, got wire_format={wire_format!r}")
        named = []
        async for name, tensor in _iterate(weights):
            if self.is_leader_rank:
                named.append((name, tensor.detach().to("cpu", copy=True)))
        if not self.is_leader_rank:
            return
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        version = int(global_steps or 0)
        if peft_config is not None and base_sync_done:
            await self._server.update_adapter.remote(named, dict(peft_config), version)
        else:
            base = [(name.replace(".base_layer.", "."), tensor) for name, tensor in named]
            await self._server.update_weights.remote(base, version)


async def _iterate(items):
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
