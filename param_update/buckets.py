"""Weight buckets: groups of named tensors of a bounded total size, as byte views.

A bucket is a list of `uint8` arrays, one per `TensorSlice`: on the sender, views of the
tensors themselves (packing copies nothing); `ray.put` of the bucket then copies every
array once into Ray's shared-memory object store, and a receiver on the node gets the
same arrays back as zero-copy, read-only views. A bucket travels as a few objects
(`split_arrays`), put from several threads at once (see `sender.py`). A tensor larger
than the bucket is split across consecutive buckets; small tensors share one. Bytes
travel verbatim, so a receiver rebuilds tensors that are bit-identical to the sender's.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

MB = 1 << 20
MAX_BUCKETS_PER_VERSION = 100_000  # more means per-bucket overhead dominates the sync


class BucketSizeError(ValueError):
    """A bucket size that cannot work for this model or machine (raised at start)."""


@dataclass(frozen=True)
class TensorSlice:
    """Bytes [start, start + nbytes) of tensor `name` (its dtype and full shape)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset inside the tensor
    nbytes: int

    @property
    def tensor_nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)

    @property
    def whole(self) -> bool:
        """The slice is the whole tensor."""
        return self.start == 0 and self.nbytes == self.tensor_nbytes


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass
class Bucket:
    """One bucket of a version: `data[i]` (uint8, 1-D) holds the bytes of `slices[i]`."""

    version: int
    index: int
    data: list[np.ndarray]
    slices: list[TensorSlice]

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.data))


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (no copy)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over an array's bytes, no copy. Arrays fetched from Ray's object store
    are read-only and are only ever read from, so torch's warning about that is silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(array))


def tensor_digest(tensor: torch.Tensor) -> str:
    """dtype, shape and a hash of the exact bytes: equal digests mean bit-identical tensors."""
    cpu = tensor.detach().to("cpu")
    raw = tensor_bytes(cpu).numpy().tobytes()
    return f"{cpu.dtype}{tuple(cpu.shape)}:{hashlib.blake2b(raw, digest_size=16).hexdigest()}"


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, version: int) -> Iterator[Bucket]:
    """Group `(name, tensor)` pairs, in order, into buckets of at most `bucket_bytes` bytes.

    A tensor that would straddle two buckets but fits in one starts a new bucket; only
    tensors larger than a bucket are split. Copies nothing: the bucket's arrays are views
    of the (CPU) tensors, which they keep alive.
    """
    if bucket_bytes < 1:
        raise BucketSizeError(f"bucket size must be at least 1 byte, got {bucket_bytes}")
    index, data, slices, used = 0, [], [], 0
    for name, tensor in named_tensors:
        cpu = tensor.detach().to("cpu")
        src = tensor_bytes(cpu).numpy()
        if len(src) == 0:  # an empty tensor still has to arrive (shape and dtype)
            data.append(src)
            slices.append(TensorSlice(name, cpu.dtype, tuple(cpu.shape), 0, 0))
        if 0 < len(src) <= bucket_bytes < used + len(src):  # fits a bucket of its own: do not split it
            yield Bucket(version, index, data, slices)
            index, data, slices, used = index + 1, [], [], 0
        start = 0
        while start < len(src):
            if used == bucket_bytes:
                yield Bucket(version, index, data, slices)
                index, data, slices, used = index + 1, [], [], 0
            take = min(len(src) - start, bucket_bytes - used)
            data.append(src[start : start + take])
            slices.append(TensorSlice(name, cpu.dtype, tuple(cpu.shape), start, take))
            used += take
            start += take
    if slices:
        yield Bucket(version, index, data, slices)


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


def slice_tensor(s: TensorSlice, array: np.ndarray) -> torch.Tensor:
    """A whole-tensor slice as the tensor itself: a view of `array`, no copy."""
    flat = as_tensor(array)
    return flat.view(s.dtype).reshape(s.shape) if s.nbytes else torch.empty(s.shape, dtype=s.dtype)


def write_slices(bucket: Bucket, destinations: dict[str, torch.Tensor], slices: Iterable[int] | None = None) -> int:
    """Copy the bucket's slices (all, or the indices given) into `destinations[name]` (flat uint8
    tensors); returns bytes copied."""
    copied = 0
    for i in range(len(bucket.slices)) if slices is None else slices:
        s = bucket.slices[i]
        destinations[s.name][s.start : s.start + s.nbytes].copy_(as_tensor(bucket.data[i]))
        copied += s.nbytes
    return copied


def tensors_from_buckets(buckets: Iterable[Bucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """Full `(name, tensor)` pairs, in order, from a version's buckets: whole tensors are views
    of the buckets' arrays (no copy); tensors split across buckets are assembled (copied)."""
    pending: dict[str, tuple[torch.Tensor, TensorSlice, int]] = {}
    for bucket in buckets:
        for s, array in zip(bucket.slices, bucket.data):
            if s.whole and s.name not in pending:
                yield s.name, slice_tensor(s, array)
                continue
            if s.name not in pending:
                pending[s.name] = (torch.empty(s.tensor_nbytes, dtype=torch.uint8), s, 0)
            flat, first, received = pending[s.name]
            flat[s.start : s.start + s.nbytes].copy_(as_tensor(array))
            received += s.nbytes
            if received == s.tensor_nbytes:
                del pending[s.name]
                yield s.name, flat.view(first.dtype).reshape(first.shape)
            else:
                pending[s.name] = (flat, first, received)
    if pending:
        raise ValueError(f"buckets ended with incomplete tensors: {sorted(pending)}")


def check_bucket_sizes(
    model_bytes: int, preduce_mb: float, consume_mb: float, object_store_bytes: int | None, versions_held: int = 2
) -> dict[str, int]:
    """Validate the two bucket sizes against the model and the object store; returns them in bytes.

    Raises BucketSizeError naming the key when a size cannot work: so small that a
    version needs more than MAX_BUCKETS_PER_VERSION buckets, or an object store that
    cannot hold `versions_held` versions (the dual buffer: serving and arriving) plus two
    buckets in flight.
    """
    keys = {
        "preduce": "actor_rollout_ref.rollout.param_update_preduce_bucket_size_mb",
        "consume": "actor_rollout_ref.rollout.param_update_consume_bucket_size_mb",
    }
    given = {"preduce": preduce_mb, "consume": consume_mb}
    sizes = {part: int(mb * MB) for part, mb in given.items()}
    for part, size in sizes.items():
        if size < 1:
            raise BucketSizeError(f"{keys[part]}={given[part]:g} is under one byte")
        count = -(-model_bytes // size)
        if count > MAX_BUCKETS_PER_VERSION:
            raise BucketSizeError(
                f"{keys[part]}={given[part]:g} splits the {model_bytes / MB:.1f} MB model into {count} buckets "
                f"(at most {MAX_BUCKETS_PER_VERSION}); use at least {model_bytes / MAX_BUCKETS_PER_VERSION / MB:.3g} MB"
            )
    needed = versions_held * model_bytes + 2 * min(sizes["preduce"], max(model_bytes, 1))
    if object_store_bytes is not None and needed > object_store_bytes:
        raise BucketSizeError(
            f"{keys['preduce']}={preduce_mb:g}: {versions_held} versions of the {model_bytes / MB:.0f} MB model "
            f"and two buckets in flight need {needed / MB:.0f} MB, Ray's object store holds "
            f"{object_store_bytes / MB:.0f} MB; raise ray_kwargs.ray_init.object_store_memory"
            + (" or set actor_rollout_ref.rollout.enable_dual_buffer=False" if versions_held > 1 else "")
        )
    return sizes  # any size works for any tensor: large ones are split across buckets
