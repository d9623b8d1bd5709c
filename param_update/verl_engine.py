"""This package's verl checkpoint-engine backend, `async_rl`: the receiving side of the sync for
verl's rollout servers (sglang, vllm), and a send side for verl's own `CheckpointEngineManager`.

verl's standalone GPU replicas load weights through a `CheckpointEngineWorker` next to
each server: `update_weights()` iterates `checkpoint_engine.receive_weights()` and hands
the tensors to the server adapter, which loads them into the engine in buckets of
`checkpoint_engine.update_weights_bucket_megabytes` (CUDA IPC). This backend,
registered as `async_rl`, fills `receive_weights()` from a staging buffer that the
pipeline's param_update stage fills bucket by bucket through the worker's
`execute_checkpoint_engine(...)`: recv and register-buffer happen while the server
generates; only the load pauses it (`param_update.receivers.VerlReplicaReceiver.commit`).

The pipeline selects it by setting, for its rollout replicas only:
`checkpoint_engine.backend=async_rl`, `custom_backend_module=param_update.verl_engine`,
`update_weights_bucket_megabytes=<consume bucket size>`.

It also has a send side, for verl's own `CheckpointEngineManager` (verl's `fully_async_policy`)
on machines where its collective backends (nccl, nixl, ...) cannot run: trainer rank 0 puts
buckets in Ray's object store and a small handoff actor passes each to the receiving workers as
it fills (`checkpoint_engine.backend=async_rl`,
`custom_backend_module=param_update.verl_engine`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Optional

import ray
import torch
from omegaconf import open_dict
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from param_update.holder import StagedWeights

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
class StagedCheckpointEngine(CheckpointEngine, StagedWeights):
    """Checkpoint engine whose buckets travel through Ray's object store, not a collective.

    A weight holder (param_update/holder.py): the param_update stage calls its `WeightHolder`
    methods through the worker's `execute_checkpoint_engine`; its load is verl's own
    `update_weights`, which reads the checked version from `receive_weights`.

    Args:
        bucket_size: verl's bucket size in bytes (the send side's buckets; unused by staging).
        dual_buffer: stage into a second copy of the weights (else hold the buckets).
        is_master: trainer rank 0, the one that sends (verl sets it on the trainer's ranks).
        handoff_timeout_s: a receiver waits this long for the sender's next bucket.
        staging_device: where the staged version lives (`"cuda"`: the register-buffer in the GPU's memory,
            each bucket copied there as it arrives, so the server's load reads device memory); None: host
            memory, views of the node's object store.
    """

    def __init__(self, bucket_size: int = 0, dual_buffer: bool = True, is_master: bool = False,
                 handoff_timeout_s: float = HANDOFF_TIMEOUT_S, staging_device: Optional[str] = None, **kwargs: Any):
        self.staging_device = staging_device
        self.bucket_size = bucket_size
        self.dual_buffer = dual_buffer
        self.is_master = is_master
        self.handoff_timeout_s = handoff_timeout_s
        self.handoff = None  # verl's manager: the WeightHandoff actor trainer rank 0 made
        self.keep_base = False  # the last version loaded stays staged as a delta's base (`configure`)

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
        if not self._checked() and self.handoff is not None:
            return self._handed_over()
        return self._staged_version()

    async def _handed_over(self):
        index = 0
        while (refs := await self.handoff.get.remote(index, self.handoff_timeout_s)) is not None:
            for name, tensor in await refs[0]:
                yield name, tensor
            index += 1

    def _checked(self) -> bool:
        return self._staging is not None and self._staging.stager.checked is not None

    def _staged_version(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The complete staged version, tensor by tensor; the staging buffer is freed for the next one. With
        `keep_base`, a version read to its end stays as the next delta's base: the bytes the server loaded."""
        if not self._checked():
            raise RuntimeError("receive_weights() before a staged version was checked complete")
        stager = self.staging.stager
        version, served = stager.version, {}
        try:
            for name, tensor in stager.named_tensors():
                served[name] = tensor
                yield name, tensor
            if self.keep_base:
                stager.loaded(version, served)
        finally:
            stager.reset()

    # ---- called by the param_update stage (execute_checkpoint_engine) ------------------------------
    def configure(self, expected: dict, dual_buffer: Optional[bool] = None, keep_base: bool = False) -> None:
        """Set up staging for the trainer's layout (name -> (dtype, shape)); the other calls are the
        `WeightHolder` methods of `StagedWeights`. `keep_base`: versions may arrive as deltas, so the version
        the server loaded last stays staged as their base (one more version held, in staging memory).

        A GPU engine always loads by copying (its own weight loader); the staged version's
        buckets stay in the node's object store until then."""
        if dual_buffer is not None:
            self.dual_buffer = dual_buffer
        self.keep_base = keep_base
        self.start_staging(expected, device=self.staging_device)


def load_versions_as_adapter(worker, peft_config: dict) -> None:
    """Inside a replica's `CheckpointEngineWorker` (run through `__ray_call__`): from now on its server
    adapter loads every version as a LoRA adapter over the base the server holds, with verl's own
    arguments for that (`peft_config`: PEFT's config as a dict, `base_sync_done=True`); vLLM's worker
    extension then removes the old adapter and `add_lora`s the new one between two decoding steps.

    verl's `CheckpointEngineWorker.update_weights` passes its server adapter no such arguments (verl's
    trainer calls the adapter itself), so this wraps the adapter's `update_weights` on the instance;
    calling it again replaces the wrap."""
    adapter = worker.server_adapter
    load = type(adapter).update_weights

    async def update_weights(weights, **kwargs):
        return await load(adapter, weights, **kwargs, peft_config=peft_config, base_sync_done=True)

    adapter.update_weights = update_weights


def use_staged_checkpoint_engine(config, consume_bucket_mb: float, dual_buffer: bool,
                                 staging_device: Optional[str] = None) -> None:
    """Point verl's checkpoint-engine config at this backend (GPU rollout backends only), in place.

    The replicas' `CheckpointEngineWorker`s then build a `StagedCheckpointEngine` and their
    server adapters load in buckets of the consume size; `staging_device`: `StagedCheckpointEngine`'s.
    """
    section = config.actor_rollout_ref.rollout.checkpoint_engine
    with open_dict(section):
        section.backend = BACKEND
        section.custom_backend_module = __name__
        section.update_weights_bucket_megabytes = max(1, int(round(consume_bucket_mb)))
        kwargs = {"dual_buffer": dual_buffer, **({"staging_device": staging_device} if staging_device else {})}
        section.engine_kwargs = {**section.get("engine_kwargs", {}), BACKEND: kwargs}
