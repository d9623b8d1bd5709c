"""The transport that reaches every node ("store"): Ray's object store.

A bucket is put as up to `parts` objects at once from the sender's thread pool (`split_arrays`;
Ray's serializer copies every array over 1 MB on six threads, bench/store_floor.py), announced
to the param_update stage as it is put, and fetched by each receiver: zero-copy, read-only views
on the receiver's node. Buckets in flight are bounded by the stage (`BucketStream`), so the store
holds at most a few beside the versions staged there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np
import ray

from async_rl.api.weights import Bucket, WeightTransport, register_transport
from async_rl.core.config import MB, PREDUCE_BUCKET_KEY
from async_rl.core.errors import BucketSizeError

FETCH_TIMEOUT_S = 300.0  # one bucket's fetch from Ray's object store may take this long


def split_arrays(data: list[np.ndarray], parts: int) -> list[list[np.ndarray]]:
    """`data`, in order, as at most `parts` consecutive runs of about equal bytes (one object each)."""
    total = sum(a.nbytes for a in data)
    runs: list[list[np.ndarray]] = [[]]
    done = 0
    for array in data:
        if runs[-1] and len(runs) < parts and done >= total * len(runs) / parts:
            runs.append([])
        runs[-1].append(array)
        done += array.nbytes
    return runs


def join_arrays(runs: Iterable[list[np.ndarray]]) -> list[np.ndarray]:
    """A bucket's arrays from the runs `split_arrays` made, as a receiver fetched them."""
    return [array for run in runs for array in run]


@dataclass(frozen=True)
class StoredBucket:
    """A bucket in Ray's object store: the refs of its runs of arrays (`split_arrays`). The refs
    travel inside this object, so Ray passes them on instead of resolving them."""

    refs: list

    def read(self, slices: list) -> list[np.ndarray]:
        return join_arrays(ray.get(self.refs, timeout=FETCH_TIMEOUT_S))


@ray.remote(num_cpus=0)
def _copy_into_store(handle, slices: list) -> list[np.ndarray]:
    """Run on the sender's node: a bucket read through another transport's `handle` and returned, so
    into Ray's object store."""
    return handle.read(slices)


@register_transport
class ObjectStore(WeightTransport):
    name: ClassVar[str] = "store"
    rank: ClassVar[int] = 100
    announces_each_bucket: ClassVar[bool] = True

    @classmethod
    def reaches(cls, receiver_nodes: Optional[Sequence], sender_node: Any) -> bool:
        return True

    def write(self, ticket: Any, bucket: Bucket, pool=None, parts: int = 1) -> StoredBucket:
        runs = split_arrays(bucket.data, parts)
        if pool is None:
            return StoredBucket([ray.put(run) for run in runs])
        futures = [pool.submit(ray.put, run) for run in runs]
        return StoredBucket([future.result() for future in futures])

    @classmethod
    def carry(cls, handle, slices: list, sender_node: str) -> StoredBucket:
        """A bucket written through another transport, copied into the store from `sender_node`: for a
        receiver its version's route did not plan for (a server restarted on another node)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        on_sender = NodeAffinitySchedulingStrategy(sender_node, soft=False)
        return StoredBucket([_copy_into_store.options(scheduling_strategy=on_sender).remote(handle, slices)])

    @staticmethod
    def room_bytes() -> Optional[int]:
        store = ray.cluster_resources().get("object_store_memory") if ray.is_initialized() else None
        return int(store) if store else None

    def check_room(self, model_bytes: int, bucket_bytes: int, versions_held: int, room_bytes: Optional[int]) -> None:
        """Staged versions live in the node's object store, shared by its receivers (two with the dual
        buffer or restartable servers: the serving one and the arriving one), plus two buckets in flight."""
        needed = versions_held * model_bytes + 2 * min(bucket_bytes, max(model_bytes, 1))
        if room_bytes is not None and needed > room_bytes:
            raise BucketSizeError(
                f"{PREDUCE_BUCKET_KEY}={bucket_bytes / MB:g}: {versions_held} versions of the {model_bytes / MB:.0f} MB model "
                f"and two buckets in flight need {needed / MB:.0f} MB, Ray's object store holds "
                f"{room_bytes / MB:.0f} MB; raise ray_kwargs.ray_init.object_store_memory"
                + (" or set actor_rollout_ref.rollout.enable_dual_buffer=False" if versions_held > 1 else "")
            )
