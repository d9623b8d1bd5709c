"""Weight buckets: groups of named tensors of a bounded total size, as byte views.

A bucket is a list of `uint8` arrays, one per `TensorSlice` (async_rl/api/weights.py): on the
sender, views of the tensors themselves (packing copies nothing); a transport then copies every
array once (param_update/transports/), and a receiver gets the same arrays back as zero-copy,
read-only views. A tensor larger than the bucket is split across consecutive buckets; small
tensors share one. Bytes travel verbatim, so a receiver rebuilds tensors that are bit-identical
to the sender's.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from async_rl.api.weights import Bucket, TensorSlice
from async_rl.core.config import CONSUME_BUCKET_KEY, MB, PREDUCE_BUCKET_KEY
from async_rl.core.errors import BucketSizeError

MAX_BUCKETS_PER_VERSION = 100_000  # more means per-bucket overhead dominates the sync


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (no copy when it is contiguous), on its own device."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def as_tensor(array: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over an array's bytes, no copy (a tensor: itself). Arrays fetched from Ray's object
    store are read-only and are only ever read from, so torch's warning about that is silenced."""
    if isinstance(array, torch.Tensor):
        return array
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(array))


def tensor_digest(tensor: torch.Tensor) -> str:
    """dtype, shape and a hash of the exact bytes: equal digests mean bit-identical tensors."""
    cpu = tensor.detach().to("cpu")
    raw = tensor_bytes(cpu).numpy().tobytes()
    return f"{cpu.dtype}{tuple(cpu.shape)}:{hashlib.blake2b(raw, digest_size=16).hexdigest()}"


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, version: int,
                 device: str | None = "cpu") -> Iterator[Bucket]:
    """Group `(name, tensor)` pairs, in order, into buckets of at most `bucket_bytes` bytes.

    A tensor that would straddle two buckets but fits in one starts a new bucket; only
    tensors larger than a bucket are split. `device`: where the buckets live, `"cpu"` (arrays: numpy
    views) or None (each tensor's own device; arrays: uint8 tensor views, e.g. on a GPU). Copies nothing
    beyond the move to `device`: the bucket's arrays are views of the tensors, which they keep alive.
    """
    if bucket_bytes < 1:
        raise BucketSizeError(f"bucket size must be at least 1 byte, got {bucket_bytes}")
    index, data, slices, used = 0, [], [], 0
    for name, tensor in named_tensors:
        held = tensor.detach() if device is None else tensor.detach().to(device)
        src = tensor_bytes(held)
        src = src.numpy() if device is not None and src.device.type == "cpu" else src  # None: tensor views
        if len(src) == 0:  # an empty tensor still has to arrive (shape and dtype)
            data.append(src)
            slices.append(TensorSlice(name, held.dtype, tuple(held.shape), 0, 0))
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
            slices.append(TensorSlice(name, held.dtype, tuple(held.shape), start, take))
            used += take
            start += take
    if slices:
        yield Bucket(version, index, data, slices)


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


def check_bucket_sizes(model_bytes: int, preduce_mb: float, consume_mb: float) -> dict[str, int]:
    """The two bucket sizes in bytes; BucketSizeError naming the key when one cannot work: under one
    byte, or so small that a version needs more than MAX_BUCKETS_PER_VERSION buckets."""
    keys = {"preduce": PREDUCE_BUCKET_KEY, "consume": CONSUME_BUCKET_KEY}
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
    return sizes  # any size works for any tensor: large ones are split across buckets
