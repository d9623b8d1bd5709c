"""The receiving side of the sync for verl's GPU rollout servers (sglang, vllm), as a verl
checkpoint-engine backend.

verl's standalone GPU replicas load weights through a `CheckpointEngineWorker` next to
each server: `update_weights()` iterates `checkpoint_engine.receive_weights()` and hands
the tensors to the server adapter, which loads them into the engine in buckets of
`checkpoint_engine.update_weights_bucket_megabytes` (CUDA IPC). This backend,
registered as `async_rl`, fills `receive_weights()` from a staging buffer that the
pipeline's param_update stage fills bucket by bucket through the worker's
`execute_checkpoint_engine(...)`: recv and register-buffer happen while the server
generates; only the load pauses it (`GPUReplicaReceiver.commit`).

The pipeline selects it by setting, for its rollout replicas only:
`checkpoint_engine.backend=async_rl`, `custom_backend_module=param_update.checkpoint_engine`,
`update_weights_bucket_megabytes=<consume bucket size>`.

It also has a send side, for verl's own `CheckpointEngineManager` (verl's `fully_async_policy`)
on machines where its collective backends (nccl, nixl, ...) cannot run: trainer rank 0 puts
buckets in Ray's object store and a small handoff actor passes each to the receiving workers as
it fills (`checkpoint_engine.backend=async_rl`,
`custom_backend_module=param_update.checkpoint_engine`).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator
from typing import Any, Optional

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from param_update.staging import VersionStager, receive_bucket

BACKEND = "async_rl"


HANDOFF_TIMEOUT_S = 300.0  # a receiver waits this long for the sender's next bucket


class WeightHandoff:
    """One weight update's buckets (ObjectRefs), from trainer rank 0 to every receiving worker, in order."""

    def __init__(self):
        self._buckets: list = []
        self._ended = False
        self._error: Optional[str] = None
        self._changed = asyncio.Condition()

    async def push(self, refs: Optional[list] = None, error: Optional[str] = None) -> None:
        """The next bucket's refs; none: the last was sent; `error`: the send failed."""
        async with self._changed:
            if error is not None:
                self._error = error
            elif refs is None:
                self._ended = True
            else:
                self._buckets.append(refs)
            self._changed.notify_all()

    def reset(self) -> None:
        self._buckets, self._ended, self._error = [], False, None

    async def get(self, index: int, timeout_s: float) -> Optional[list]:
        """Bucket `index`'s refs once sent; None after the last one. Raises on the sender's failure or
        when nothing comes for `timeout_s`."""
        async with self._changed:
            ready = lambda: self._error or index < len(self._buckets) or self._ended  # noqa: E731
            try:
                await asyncio.wait_for(self._changed.wait_for(ready), timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no weight bucket {index} from the trainer within {timeout_s:g} s") from None
            if self._error:
                raise RuntimeError(f"the trainer's weight send failed: {self._error}")
            return self._buckets[index] if index < len(self._buckets) else None


@CheckpointEngineRegistry.register(BACKEND)
class StagedCheckpointEngine(CheckpointEngine):
    """Checkpoint engine whose buckets travel through Ray's object store, not a collective.

    Args:
        bucket_size: verl's bucket size in bytes (the send side's buckets; unused by staging).
        dual_buffer: stage into a second copy of the weights (else hold the buckets).
        is_master: trainer rank 0, the one that sends (verl sets it on the trainer's ranks).
        handoff_timeout_s: a receiver waits this long for the sender's next bucket.
    """

    def __init__(self, bucket_size: int = 0, dual_buffer: bool = True, is_master: bool = False,
                 handoff_timeout_s: float = HANDOFF_TIMEOUT_S, **kwargs: Any):
        self.bucket_size = bucket_size
        self.dual_buffer = dual_buffer
        self.is_master = is_master
        self.handoff_timeout_s = handoff_timeout_s
        self.stager: Optional[VersionStager] = None
        self.handoff = None  # verl's manager: the WeightHandoff actor trainer rank 0 made
        self._ready: Optional[tuple[int, int]] = None  # (version, num_buckets) checked complete

    # ---- verl's CheckpointEngine interface --------------------------------------------------
    def prepare(self) -> dict:
        """Trainer rank 0 makes the handoff (once) and clears what a failed update left in it; no
        process group is built."""
        if not self.is_master:
            return {}
        if self.handoff is None:
            self.handoff = ray.remote(WeightHandoff).options(num_cpus=0).remote()
        else:
            ray.get(self.handoff.reset.remote(), timeout=self.handoff_timeout_s)
        return {"handoff": self.handoff}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        handoff = metadata[0].get("handoff")  # trainer rank 0's
        return {"handoff": [handoff] * actor_wg_world_size}, {"handoff": [handoff] * rollout_world_size}

    def init_process_group(self, handoff=None, **kwargs: Any) -> None:
        self.handoff = handoff

    def finalize(self) -> None:
        if self.is_master and self.handoff is not None:
            ray.get(self.handoff.reset.remote(), timeout=self.handoff_timeout_s)

    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        """Trainer rank 0 hands over buckets of about `bucket_size` bytes as each fills; the other ranks
        only iterate `weights` (gathering them is collective)."""
        from verl.workers.rollout.utils import ensure_async_iterator

        bucket, size = [], 0
        try:
            async for name, tensor in ensure_async_iterator(weights):
                if self.is_master:
                    bucket.append((name, tensor.detach().cpu()))
                    size += tensor.nbytes
                if bucket and (size >= self.bucket_size):
                    await self.handoff.push.remote([ray.put(bucket)])
                    bucket, size = [], 0
            if self.is_master:
                if bucket:
                    await self.handoff.push.remote([ray.put(bucket)])
                await self.handoff.push.remote()
        except BaseException as exc:
            if self.is_master and self.handoff is not None:
                await self.handoff.push.remote(error=f"{type(exc).__name__}: {exc}")
            raise
        return {}

    def receive_weights(self, global_steps: int | None = None):
        """The complete staged version (the pipeline's param_update), else, under verl's manager, the
        buckets trainer rank 0 sends now (an async iterator); (name, tensor) pairs."""
        if self._ready is None and self.handoff is not None:
            return self._handed_over()
        return self._staged_version()

    async def _handed_over(self):
        index = 0
        while (refs := await self.handoff.get.remote(index, self.handoff_timeout_s)) is not None:
            for name, tensor in await refs[0]:
                yield name, tensor
            index += 1

    def _staged_version(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The complete staged version, tensor by tensor; the staging buffer is freed for the next one."""
        if self._ready is None:
            raise RuntimeError("receive_weights() before a staged version was checked complete")
        try:
            yield from self.stager.named_tensors()
        finally:
            self._ready = None
            self.stager.reset()

    # ---- called by the param_update stage (execute_checkpoint_engine) ------------------------------
    def configure(self, expected: dict, dual_buffer: Optional[bool] = None) -> None:
        """Set up staging for the trainer's layout (name -> (dtype, shape)).

        A GPU engine always loads by copying (its own weight loader); the staged version's
        buckets stay in the node's object store until then."""
        if dual_buffer is not None:
            self.dual_buffer = dual_buffer
        self.stager = VersionStager(expected)

    def stage_bucket(self, version: int, index: int, refs: list, slices: list) -> dict[str, float]:
        return receive_bucket(self.stager, version, index, refs, slices)

    def check(self, version: int, num_buckets: int) -> None:
        self.stager.check_complete(version, num_buckets)
        self._ready = (version, num_buckets)

    def discard(self, version: int) -> None:
        if self.stager is not None and self.stager.version == version:
            self._ready = None
            self.stager.reset()


DRAIN_TIMEOUT_S = 300.0  # partial_rollout=False: how long a load may wait for running requests


def close_submission_gate(server) -> None:
    """Inside verl 0.9.1's `vLLMHttpServer` actor: park new requests without aborting running ones
    (the gate `abort_all_requests` closes; `resume_generation` opens it)."""
    server._submission_paused = True
    server._rejecting = False
    server._resume_event.clear()


def live_requests(server) -> int:
    """Inside verl's `vLLMHttpServer` actor: requests admitted or running on its engine."""
    engine = getattr(server, "engine", None)  # only node rank 0 of a replica owns the engine
    running = len(engine.output_processor.request_states) if engine is not None else 0
    return server._admitting + running


class GPUReplicaReceiver:
    """A verl GPU rollout replica (sglang / vllm) as a weight receiver of `OverlappedWeightSync`.

    Staging goes to every `CheckpointEngineWorker` of the replica; the load pauses the
    replica, runs verl's `update_weights` on every worker and resumes generation. With
    `partial=True` the pause is verl's `abort_all_requests` (in-flight requests return their
    partial output and the generate stage resubmits prompt + tokens so far); with
    `partial=False` (vLLM only) new requests are parked and the load waits for the running
    ones to finish, so no response spans two versions.
    """

    def __init__(self, name: str, replica: Any, partial: bool = True, replica_index: Optional[int] = None):
        """`replica_index`: set when a lost replica is restarted (the sync then leaves it out and reports it)."""
        self.name = name
        self.replica = replica
        self.partial = partial
        self.replica_index = replica_index
        self.serves_generation = True

    @property
    def handle(self):
        """The replica's server the generate stage sends requests to (its losses are reported by it)."""
        return self.replica.server_handle

    def restarted(self, workers: list, servers: list) -> "GPUReplicaReceiver":
        """This receiver for the replica restarted on the same devices with new `workers` and `servers`."""
        replica = copy.copy(self.replica)
        replica.workers, replica.servers, replica._server_handle = list(workers), list(servers), servers[0]
        return GPUReplicaReceiver(self.name, replica, self.partial, self.replica_index)

    def _on_workers(self, method: str, *args) -> list:
        return [w.execute_checkpoint_engine.remote(method, *args) for w in self.replica.workers]

    async def configure(self, expected: dict, dual_buffer: bool) -> None:
        await asyncio.gather(*self._on_workers("configure", expected, dual_buffer))

    async def stage(self, bucket) -> dict:
        results = await asyncio.gather(
            *self._on_workers("stage_bucket", bucket.version, bucket.index, bucket.refs, bucket.slices)
        )
        return {key: max(r[key] for r in results) for key in results[0]}

    async def check(self, version: int, num_buckets: int) -> None:
        await asyncio.gather(*self._on_workers("check", version, num_buckets))

    async def commit(self, version: int, num_buckets: int) -> dict:
        start = time.perf_counter()
        try:  # the gate reopens whatever happens, a drain that timed out included
            if self.partial:
                await self.replica.abort_all_requests()
            else:
                await self._drain()
            await asyncio.gather(*(w.update_weights.remote(global_steps=version) for w in self.replica.workers))
        finally:
            await self.replica.resume_generation()
        load_s = time.perf_counter() - start
        return {"load_s": load_s, "blocked_s": load_s}

    async def discard(self, version: int) -> None:
        await asyncio.gather(*self._on_workers("discard", version))

    async def _drain(self) -> None:
        """Park new requests on every server of the replica and wait for the running ones to finish."""
        servers = list(self.replica.servers)
        await asyncio.gather(*(s.__ray_call__.remote(close_submission_gate) for s in servers))
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while sum(await asyncio.gather(*(s.__ray_call__.remote(live_requests) for s in servers))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: running requests did not finish within {DRAIN_TIMEOUT_S:g} s "
                                   f"before a weight load (actor_rollout_ref.rollout.partial_rollout=False)")
            await asyncio.sleep(0.01)


def use_staged_checkpoint_engine(config, consume_bucket_mb: float, dual_buffer: bool) -> None:
    """Point verl's checkpoint-engine config at this backend (GPU rollout backends only), in place.

    The replicas' `CheckpointEngineWorker`s then build a `StagedCheckpointEngine` and their
    server adapters load in buckets of the consume size.
    """
    from omegaconf import open_dict

    section = config.actor_rollout_ref.rollout.checkpoint_engine
    with open_dict(section):
        section.backend = BACKEND
        section.custom_backend_module = __name__
        section.update_weights_bucket_megabytes = max(1, int(round(consume_bucket_mb)))
        section.engine_kwargs = {**section.get("engine_kwargs", {}), BACKEND: {"dual_buffer": dual_buffer}}
