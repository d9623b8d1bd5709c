"""The two kinds of `WeightReceiver` (async_rl/api/weights.py) the param_update stage syncs.

- `ActorReceiver`: any Ray actor with the `WeightHolder` methods, which the holder bases
  (param_update/holder.py) implement: the CPU rollout servers and the logp stage.
- `VerlReplicaReceiver`: a verl rollout replica (vllm, sglang) whose `CheckpointEngineWorker`s
  stage the buckets through this package's verl checkpoint-engine backend
  (param_update/verl_engine.py) and load them with verl's `update_weights`.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable
from typing import Any, Optional

from async_rl.api.weights import BucketRef, ReceiverSetup
from param_update.verl_engine import load_versions_as_adapter


class ActorReceiver:
    """A receiver behind a Ray actor handle with the `WeightHolder` methods.

    `replica_index`: set on a rollout server that may be restarted when lost
    (async_rl/rollout/supervisor.py). `link` is set by the sync.
    """

    def __init__(self, name: str, handle: Any, serves_generation: bool, replica_index: Optional[int] = None):
        self.name = name
        self.handle = handle
        self.serves_generation = serves_generation
        self.replica_index = replica_index
        self.link: Optional[str] = None

    def restarted(self, handle: Any, replica_actors: Optional[tuple] = None) -> "ActorReceiver":
        """This receiver for a restarted server `handle`."""
        return ActorReceiver(self.name, handle, self.serves_generation, self.replica_index)

    async def configure(self, setup: ReceiverSetup) -> None:
        """Set up its staging for the trainer's layout (a mismatch fails here). Under LoRA versions carry
        the adapter's tensors, which the receiver merges onto its own base weights (param_update/lora.py)."""
        await self.handle.configure_weight_sync.remote(setup.dual_buffer, setup.consume_bytes, setup.layout,
                                                       setup.partial_rollout, setup.adapter)

    async def nodes(self) -> Optional[list]:
        return await self.handle.weight_sync_nodes.remote()

    async def stage(self, bucket: BucketRef) -> dict:
        source = bucket.handle_for(self.link)
        return await self.handle.stage_weight_bucket.remote(bucket.version, bucket.index, source, bucket.slices)

    async def stage_version(self, version: int, buckets: list, num_buckets: int) -> dict:
        sources = [(b.index, b.handle_for(self.link), b.slices) for b in buckets]
        return await self.handle.stage_weight_buckets.remote(version, sources, num_buckets)

    async def check(self, version: int, num_buckets: int) -> None:
        await self.handle.check_weights.remote(version, num_buckets)

    async def commit(self, version: int, num_buckets: int) -> dict:
        return await self.handle.commit_weights.remote(version, num_buckets)

    async def discard(self, version: int) -> None:
        await self.handle.discard_weights.remote(version)


class VerlReplicaReceiver:
    """A verl rollout replica (sglang / vllm) as a weight receiver.

    Staging goes to every `CheckpointEngineWorker` of the replica; the load pauses the replica,
    runs verl's `update_weights` on every worker and resumes generation. With `partial=True` the
    pause is verl's `abort_all_requests` (in-flight requests return their partial output and the
    generate stage resubmits prompt + tokens so far); with `partial=False`, `drain(replica, name)`
    (the backend's) parks new requests and waits for the running ones to finish, so no response
    spans two versions. Its workers read through the object store (`nodes` is unknown).
    """

    def __init__(self, name: str, replica: Any, partial: bool = True, replica_index: Optional[int] = None,
                 drain: Optional[Callable[[Any, str], Awaitable[None]]] = None):
        """`replica_index`: set when a lost replica is restarted (the sync then leaves it out and reports it)."""
        if not partial and drain is None:
            raise ValueError(f"{name}: partial_rollout=False needs a backend that can wait for running requests")
        self.name = name
        self.replica = replica
        self.partial = partial
        self.replica_index = replica_index
        self.drain = drain
        self.serves_generation = True
        self.link: Optional[str] = None

    @property
    def handle(self):
        """The replica's server the generate stage sends requests to (its losses are reported by it)."""
        return self.replica.server_handle

    def restarted(self, handle: Any, replica_actors: tuple) -> "VerlReplicaReceiver":
        """This receiver for the replica restarted on the same devices with new (workers, servers)."""
        workers, servers = replica_actors
        replica = copy.copy(self.replica)
        replica.workers, replica.servers, replica._server_handle = list(workers), list(servers), servers[0]
        return VerlReplicaReceiver(self.name, replica, self.partial, self.replica_index, self.drain)

    def _on_workers(self, method: str, *args) -> list:
        return [w.execute_checkpoint_engine.remote(method, *args) for w in self.replica.workers]

    async def configure(self, setup: ReceiverSetup) -> None:
        """Under LoRA versions carry the adapter's tensors, which the replica serves as an adapter over
        the base it loaded (verl's LoRA path for its servers: param_update/verl_engine.py)."""
        adapter = setup.adapter
        if adapter is not None:
            if adapter.peft_config is None:
                raise ValueError(f"{self.name}: the adapter has no PEFT config to serve it with")
            await asyncio.gather(*(w.__ray_call__.remote(load_versions_as_adapter, adapter.peft_config)
                                   for w in self.replica.workers))
        await asyncio.gather(*self._on_workers("configure", setup.layout, setup.dual_buffer, setup.delta))

    async def nodes(self) -> Optional[list]:
        return None

    async def stage(self, bucket: BucketRef) -> dict:
        source = bucket.handle_for(self.link)
        results = await asyncio.gather(
            *self._on_workers("stage_weight_bucket", bucket.version, bucket.index, source, bucket.slices)
        )
        return {key: max(r[key] for r in results) for key in results[0]}

    async def stage_version(self, version: int, buckets: list, num_buckets: int) -> dict:
        totals = {"recv_s": 0.0, "register_s": 0.0}
        for bucket in buckets:
            for key, seconds in (await self.stage(bucket)).items():
                totals[key] += seconds
        start = time.perf_counter()
        await self.check(version, num_buckets)
        totals["register_s"] += time.perf_counter() - start  # where a delta is put together
        return totals

    async def check(self, version: int, num_buckets: int) -> None:
        await asyncio.gather(*self._on_workers("check_weights", version, num_buckets))

    async def commit(self, version: int, num_buckets: int) -> dict:
        start = time.perf_counter()
        try:  # the gate reopens whatever happens, a drain that timed out included
            if self.partial:
                await self.replica.abort_all_requests()
            else:
                await self.drain(self.replica, self.name)
            await asyncio.gather(*(w.update_weights.remote(global_steps=version) for w in self.replica.workers))
        finally:
            await self.replica.resume_generation()
        load_s = time.perf_counter() - start
        return {"load_s": load_s, "blocked_s": load_s}

    async def discard(self, version: int) -> None:
        await asyncio.gather(*self._on_workers("discard_weights", version))
