"""The receiving side of the weight sync, written once: every `WeightHolder` method
(async_rl/api/weights.py) over one staging buffer (param_update/staging.py).

A weight holder subclasses the base that fits its process and writes one method, its engine's
own load (`load_staged`), calling `start_staging(expected, aliases)` when it learns its layout:

- `StagedWeights`: a plain object or Ray actor (verl's checkpoint-engine worker's engine, whose
  load is verl's own `update_weights`);
- `AsyncStagedWeights`: an async Ray actor (the CPU rollout server): recv and register-buffer run
  off its event loop, the load is a coroutine;
- `RankStagedWeights`: a rank of a verl worker group (the logp ranks): every method dispatched to
  every rank, staging in its own Ray concurrency group (`WEIGHTS_GROUP`) beside compute;
- `RelayedWeights`: an actor whose weights live on such a worker group (the logp stage): each
  call goes to every rank, the slowest rank's seconds come back.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import ray
from verl.single_controller.base.decorator import Dispatch, register

from async_rl.api.weights import BucketHandle
from param_update.staging import VersionStager, WeightStaging

WEIGHTS_GROUP = "weights"  # a worker rank's Ray concurrency group for the staging calls


class StagedWeights:
    """The `WeightHolder` methods over a `WeightStaging`; a subclass writes `load_staged`. Timings in
    seconds, `{recv_s, register_s}`."""

    _staging: Optional[WeightStaging] = None

    def start_staging(self, expected: dict, aliases: Optional[dict] = None, device: Optional[str] = None) -> None:
        """Stage versions of this layout from now on (canonical name -> (dtype, shape); alias -> canonical), in
        `device` memory when given (else as the transport hands them out)."""
        self._staging = WeightStaging(expected, aliases, device)

    @property
    def staging(self) -> WeightStaging:
        if self._staging is None:
            raise RuntimeError(f"{type(self).__name__}: a weight-sync call before its staging was set up "
                               "(configure_weight_sync)")
        return self._staging

    def weight_sync_nodes(self) -> list[str]:
        """This process's Ray node (on the sender's, buckets arrive through shared memory)."""
        return [ray.get_runtime_context().get_node_id()]

    def stage_weight_bucket(self, version: int, index: int, source: BucketHandle, slices: list) -> dict[str, float]:
        """recv + register-buffer of bucket `index` of `version`, read through `source`."""
        return self.staging.stage_bucket(version, index, source, slices)

    def stage_weight_buckets(self, version: int, buckets: list, num_buckets: int) -> dict[str, float]:
        """recv + register-buffer of every (index, source, slices) of `version`, then its check."""
        return self.staging.stage_version(version, buckets, num_buckets)

    def check_weights(self, version: int, num_buckets: int) -> None:
        """StagingError unless every bucket and tensor of `version` is staged."""
        self.staging.check(version, num_buckets)

    def discard_weights(self, version: int) -> None:
        """Drop `version` if it is being staged; the served weights are untouched."""
        if self._staging is not None:
            self._staging.discard(version)

    def commit_weights(self, version: int, num_buckets: int, *args: Any) -> Any:
        """load: check `version` complete, then the holder's own `load_staged`."""
        self.staging.check(version, num_buckets)
        return self.load_staged(version, self.staging.stager, *args)

    def load_staged(self, version: int, staged: VersionStager, *args: Any) -> Any:
        """The holder's load: serve the complete `staged` version as `version` from now on."""
        raise NotImplementedError(f"{type(self).__name__} does not load staged weights itself")


class AsyncStagedWeights(StagedWeights):
    """`StagedWeights` for an async Ray actor: recv and register-buffer run in a thread, so the actor's
    event loop keeps serving; `load_staged` is a coroutine."""

    async def stage_weight_bucket(self, version: int, index: int, source: BucketHandle, slices: list) -> dict:
        return await asyncio.to_thread(StagedWeights.stage_weight_bucket, self, version, index, source, slices)

    async def stage_weight_buckets(self, version: int, buckets: list, num_buckets: int) -> dict:
        return await asyncio.to_thread(StagedWeights.stage_weight_buckets, self, version, buckets, num_buckets)

    async def check_weights(self, version: int, num_buckets: int) -> None:
        """(A delta is put together here: a thread, while generation goes on.)"""
        await asyncio.to_thread(StagedWeights.check_weights, self, version, num_buckets)

    async def commit_weights(self, version: int, num_buckets: int, *args: Any) -> Any:
        self.staging.check(version, num_buckets)
        return await self.load_staged(version, self.staging.stager, *args)

    async def load_staged(self, version: int, staged: VersionStager, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not load staged weights itself")


class RankStagedWeights(StagedWeights):
    """`StagedWeights` on each rank of a verl worker group: every call dispatched to every rank
    (the group returns a list, one entry per rank); staging runs in `WEIGHTS_GROUP` (the actor must
    declare it), so a rank stages version v while it computes with v - 1; the load runs in the
    default group, never beside a forward."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def weight_sync_nodes(self) -> list[str]:
        return StagedWeights.weight_sync_nodes(self)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def stage_weight_bucket(self, version: int, index: int, source: BucketHandle, slices: list) -> dict:
        return StagedWeights.stage_weight_bucket(self, version, index, source, slices)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def stage_weight_buckets(self, version: int, buckets: list, num_buckets: int) -> dict:
        return StagedWeights.stage_weight_buckets(self, version, buckets, num_buckets)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def check_weights(self, version: int, num_buckets: int) -> None:
        StagedWeights.check_weights(self, version, num_buckets)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def discard_weights(self, version: int) -> None:
        StagedWeights.discard_weights(self, version)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def commit_weights(self, version: int, num_buckets: int, *args: Any) -> Any:
        return StagedWeights.commit_weights(self, version, num_buckets, *args)


def _slowest(per_rank: list[dict]) -> dict:
    return {key: max(r[key] for r in per_rank) for key in per_rank[0]}


class RelayedWeights:
    """The `WeightHolder` methods of an async actor whose weights live on the ranks of `worker_group`
    (`RankStagedWeights`): each call runs on every rank, off the event loop; the slowest rank's
    seconds come back. The holder writes `commit_weights`, its load (`worker_group.commit_weights`
    with what its ranks' `load_staged` takes)."""

    worker_group: Any

    async def _on_ranks(self, method: str, *args: Any) -> list:
        return await asyncio.to_thread(getattr(self.worker_group, method), *args)

    async def weight_sync_nodes(self) -> list[str]:
        """The Ray node of each rank."""
        return [node for nodes in await self._on_ranks("weight_sync_nodes") for node in nodes]

    async def stage_weight_bucket(self, version: int, index: int, source: BucketHandle, slices: list) -> dict:
        return _slowest(await self._on_ranks("stage_weight_bucket", version, index, source, slices))

    async def stage_weight_buckets(self, version: int, buckets: list, num_buckets: int) -> dict:
        return _slowest(await self._on_ranks("stage_weight_buckets", version, buckets, num_buckets))

    async def check_weights(self, version: int, num_buckets: int) -> None:
        await self._on_ranks("check_weights", version, num_buckets)

    async def discard_weights(self, version: int) -> None:
        await self._on_ranks("discard_weights", version)

    async def commit_weights(self, version: int, num_buckets: int) -> dict:
        raise NotImplementedError(f"{type(self).__name__} does not load weights itself")
