"""register-buffer: where a receiver keeps a version while its buckets arrive.

A receiver (rollout engine, logp worker, GPU checkpoint-engine worker) stages version v
bucket by bucket while it keeps serving v - 1; v becomes loadable only once every bucket
(0 .. num_buckets - 1) and every byte of every expected tensor has arrived. A staged
bucket is not copied: the receiver keeps zero-copy views of what its transport hands out
(the sender's shared buffer on the sender's node, what the gloo group delivered on other nodes,
Ray's object store as the table's fallback: param_update/transports/), so a node's shared memory
holds each version once for all its receivers. `WeightStaging` is the receiving actor's side of
the sync, the one implementation every weight holder (CPU rollout server, logp worker, verl
checkpoint-engine worker) uses, through the holder bases of param_update/holder.py.

The load then either
- swaps (`swap_into`, the dual buffer, `enable_dual_buffer=True`): the staged tensors
  become the weights, zero copy, and their buckets stay pinned while they serve. The
  shared memory holds two versions (serving and arriving); generation is blocked only
  for the swap. Used by the CPU rollout engine.
- or copies (`copy_into`, `enable_dual_buffer=False`, and every load into FSDP shards
  or a GPU engine): the bytes go into the live weights, and the buckets are released.
  Shared memory holds one version; generation is blocked for the whole copy.

Either way nothing touches the serving weights before the version is complete, so a
failed sync leaves the previous version serving.

A version sent as a delta (param_update/delta.py: the values changed since the version the
receiver serves, its base) is put together over that base at the check: the base's tensor copied,
the changed values written in. Under the dual buffer the copy goes into the memory of the tensors the
last swap replaced (a version put together here and no longer served: memory already mapped), else
into a new tensor; the load then swaps or copies it like any other.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from async_rl.api.weights import Bucket, BucketHandle
from param_update.buckets import as_tensor, slice_tensor, tensor_bytes, write_slices
from param_update.delta import BASE, INDEX, VALUE, DeltaVersion, wire_name

PUT_TOGETHER_THREADS = 2  # a delta's tensors put together at once (copies and writes release the GIL)


class StagingError(RuntimeError):
    """A version could not be staged (wrong order, unknown tensor, missing bucket or bytes)."""


def canonical_names(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> the first name sharing its storage (tied weights, e.g. lm_head and embed_tokens)."""
    first: dict[int, str] = {}
    out = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tensor.nbytes) if tensor.numel() else id(tensor)
        out[name] = first.setdefault(key, name)
    return out


def weight_layout(state: dict[str, torch.Tensor]):
    """(expected, aliases, tensors) of a state dict: canonical name -> (dtype, shape), alias -> canonical,
    and canonical name -> the live tensor (what a load writes or swaps into)."""
    canon = canonical_names(state)
    tensors = {name: t for name, t in state.items() if canon[name] == name}
    expected = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    aliases = {name: c for name, c in canon.items() if name != c}
    return expected, aliases, tensors


def layout_mismatches(sent: dict, expected: dict, aliases: dict) -> list[str]:
    """How a sender's layout (name -> (dtype, shape)) differs from what a receiver expects; [] if it fits."""
    problems, covered = [], set()
    for name, (dtype, shape) in sent.items():
        canonical = aliases.get(name, name)
        if canonical not in expected:
            problems.append(f"{name!r} is sent but the receiver has no such tensor")
        elif (dtype, tuple(shape)) != (expected[canonical][0], tuple(expected[canonical][1])):
            want = expected[canonical]
            problems.append(f"{name!r} is sent as {dtype} {tuple(shape)}, the receiver holds {want[0]} {tuple(want[1])}")
        else:
            covered.add(canonical)
    problems += [f"{name!r} is never sent" for name in sorted(set(expected) - covered)]
    return problems


class VersionStager:
    """Collects one version's buckets; tells when it is complete; loads it.

    Args:
        expected: canonical name -> (dtype, shape) of every tensor a version must carry.
        aliases: incoming name -> canonical name (tied weights); names not listed are canonical.
        device: where the staged bytes live: None keeps zero-copy views of what the transport handed
            out; a device (`"cuda"`: the register-buffer in GPU memory, so the load is a device-to-device
            copy) copies each bucket there as it is staged.
    """

    def __init__(self, expected: dict[str, tuple[torch.dtype, tuple[int, ...]]], aliases: Optional[dict] = None,
                 device: Optional[str] = None):
        self.expected = dict(expected)
        self.aliases = dict(aliases or {})
        self.device = device
        self.version: Optional[int] = None
        self.checked: Optional[int] = None  # the version `check_complete` found complete (until reset)
        self.base: dict[str, torch.Tensor] = {}  # canonical name -> the tensor a delta applies to
        self.base_version: Optional[int] = None  # the version `base` holds (the one loaded last)
        self._put_together: set[str] = set()  # names of the staged version a delta put together (its memory)
        self._base_put_together: set[str] = set()  # names of `base` put together by this stager
        self._spare: dict[str, torch.Tensor] = {}  # tensors put together here that no longer serve: reused
        self._sizes: dict[str, int] = {}  # incoming name -> its tensor's bytes
        self._full: Optional[dict[str, torch.Tensor]] = None  # a checked delta's tensors, put together
        self._held: dict[int, Bucket] = {}  # bucket index -> bucket, of the version being staged
        self._serving: list[Bucket] = []  # buckets the swapped-in weights live in (kept pinned)
        self._registering: set[int] = set()  # buckets being registered right now (other threads)
        self._received: dict[str, int] = {}  # incoming name -> bytes
        self._assembled: dict[str, torch.Tensor] = {}  # name -> full tensor (a view, or split pieces put together)
        self._changed = threading.Condition()

    def _check_slices(self, version: int, bucket: Bucket) -> None:
        for s in bucket.slices:
            if s.name == BASE:
                if s.dtype != torch.int64 or tuple(s.shape) != (1,):
                    raise StagingError(f"version {version}: its delta base is {s.dtype} {tuple(s.shape)}")
                continue
            sent, part = wire_name(s.name)
            name = self.aliases.get(sent, sent)
            if name not in self.expected:
                raise StagingError(f"version {version}: unknown tensor {s.name!r}")
            dtype, shape = self.expected[name]
            if part is not None:  # a delta's changed values: uint16 gaps (int16 bits), values of the held dtype
                want = torch.int16 if part == INDEX else dtype
                if s.dtype != want or len(s.shape) != 1 or s.shape[0] > math.prod(shape):
                    raise StagingError(f"version {version}: delta {s.name!r} is {s.dtype} {tuple(s.shape)}, "
                                       f"expected {want} of at most {math.prod(shape)} values")
            elif s.dtype != dtype or tuple(s.shape) != tuple(shape):
                raise StagingError(
                    f"version {version}: tensor {s.name!r} is {s.dtype} {tuple(s.shape)}, "
                    f"expected {dtype} {tuple(shape)}"
                )

    def stage(self, version: int, bucket: Bucket) -> int:
        """Register one bucket of `version` (kept, not copied); returns its bytes.

        A tensor split across buckets is put together (copied once) when its last piece
        arrives, so that the load itself copies nothing. Starts the version if none is
        being staged. Thread-safe.
        """
        with self._changed:
            if self.version is None:
                self.version = version
            if version != self.version:
                raise StagingError(f"bucket of version {version} arrived while staging version {self.version}")
            if bucket.index in self._held or bucket.index in self._registering:
                raise StagingError(f"version {version}: bucket {bucket.index} arrived twice")
            self._check_slices(version, bucket)
            self._registering.add(bucket.index)
        if self.device is not None:  # register-buffer on the device: one copy, the transport's memory released
            bucket = Bucket(bucket.version, bucket.index,
                            [as_tensor(a).to(self.device, copy=True) for a in bucket.data], bucket.slices)
        # the tensors over its whole slices, built now so that the load only swaps them in
        views = {s.name: slice_tensor(s, array) for s, array in zip(bucket.slices, bucket.data) if s.whole}
        with self._changed:
            self._registering.discard(bucket.index)
            if self.version != version:  # reset meanwhile (a dropped version)
                raise StagingError(f"version {version} was dropped while bucket {bucket.index} was staged")
            self._held[bucket.index] = bucket
            self._assembled.update(views)
            completed = []
            for s in bucket.slices:
                self._received[s.name] = self._received.get(s.name, 0) + s.nbytes
                self._sizes[s.name] = s.tensor_nbytes
                if not s.whole and self._received[s.name] == s.tensor_nbytes:
                    completed.append(s.name)
            pieces = {name: self._pieces(name) for name in completed}
        for name, parts in pieces.items():  # the copy runs outside the lock
            assembled = _assemble(parts, self.device)
            with self._changed:
                if self.version == version:
                    self._assembled[name] = assembled
        return bucket.nbytes

    def _pieces(self, name: str) -> list:
        return [(s, array) for b in self._held.values() for s, array in zip(b.slices, b.data) if s.name == name]

    def check_complete(self, version: int, num_buckets: int) -> None:
        """Raise StagingError unless every bucket and every expected tensor of `version` arrived."""
        with self._changed:
            if self.version != version:
                raise StagingError(f"version {version} was never staged (staging {self.version})")
            if self.checked == version:  # nothing arrives after a check
                return
            missing_buckets = sorted(set(range(num_buckets)) - set(self._held))
            if missing_buckets:
                raise StagingError(f"version {version}: buckets {missing_buckets[:10]} of {num_buckets} never arrived")
            done = {name for name, got in self._received.items() if got == self._sizes[name]}
            complete = {self.aliases.get(name, name) for name in done
                        if wire_name(name)[1] is None and name != BASE
                        and self._sizes[name] == _nbytes(*self.expected[self.aliases.get(name, name)])}
            complete |= {self.aliases.get(wire_name(name)[0], wire_name(name)[0]) for name in done
                         if wire_name(name)[1] == INDEX and wire_name(name)[0] + VALUE in done}
            missing = sorted(set(self.expected) - complete)
            if missing:
                raise StagingError(f"version {version}: tensors {missing[:10]} incomplete after {num_buckets} buckets")
            wire = dict(self._assembled) if BASE in self._assembled else None
        if wire is not None:  # a delta: its tensors put together now, while the base still serves
            try:
                delta = DeltaVersion(wire, self.base, self.base_version, self.aliases)
            except ValueError as exc:
                raise StagingError(f"version {version}: {exc}") from None
            spare, names = self._spare, list(self.expected)
            try:
                with ThreadPoolExecutor(PUT_TOGETHER_THREADS, thread_name_prefix="delta-put-together") as pool:
                    full = dict(zip(names, pool.map(lambda name: delta.tensor(name, into=spare.get(name)), names)))
            except ValueError as exc:
                raise StagingError(f"version {version}: {exc}") from None
            with self._changed:
                if self.version != version:
                    raise StagingError(f"version {version} was dropped while its delta was applied")
                self._full = full
                self._put_together = {name for name in full if not delta.sent_whole(name)}
        with self._changed:
            self.checked = version

    def reset(self) -> None:
        """Forget the staged version (after a load, or to drop a failed one); its buckets are released."""
        with self._changed:
            self.version = None
            self.checked = None
            self._held = {}
            self._received = {}
            self._sizes = {}
            self._full = None
            self._put_together = set()
            self._assembled = {}

    def _ordered(self) -> list[Bucket]:
        return [self._held[i] for i in sorted(self._held)]

    @property
    def is_delta(self) -> bool:
        """The staged version was sent as a delta (its tensors are put together at the check)."""
        return BASE in self._assembled

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The complete staged version as (canonical name, full tensor), each canonical name once.

        Tensors inside one bucket are views of it (no copy); tensors split across buckets are assembled;
        a delta's are those `check_complete` put together over the base.
        """
        if self._full is not None:
            yield from self._full.items()
            return
        seen = set()
        for bucket in self._ordered():
            for s, array in zip(bucket.slices, bucket.data):
                canonical = self.aliases.get(s.name, s.name)
                if canonical in seen:
                    continue
                seen.add(canonical)
                yield canonical, self._assembled[s.name]

    def loaded(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """`version` now serves as `tensors` (canonical name -> tensor, kept unchanged while it serves):
        the base of the next delta. Tensors this stager put together and no longer serving are not reused."""
        self._spare, self._base_put_together = {}, set()  # before `tensors` serve: none of them is spare
        self.base, self.base_version = tensors, version

    def swap_into(self, params: dict[str, torch.Tensor]) -> None:
        """load (dual buffer): the staged tensors become `params` (`param.data = staged`), zero copy.

        Their buckets stay pinned while they serve; the previous version's are released.
        Tied parameters are one object, set once.
        """
        staged = dict(self.named_tensors())
        replaced = {name: self.base[name] for name in self._base_put_together if name in self.base}
        put_together = self._put_together
        self._spare = {}  # the staged tensors may have been put together in spare memory: it serves now
        for name, param in params.items():
            param.data = staged[name]
        self._serving = self._ordered()
        self.loaded(self.version, staged)
        self._spare, self._base_put_together = replaced, put_together  # the next delta is put together there
        self.reset()

    def release_serving(self) -> None:
        """The swapped-in weights were replaced by other means: unpin their buckets (no delta base left)."""
        self._serving = []
        self.base, self.base_version = {}, None
        self._spare, self._base_put_together = {}, set()

    def copy_into(self, params: dict[str, torch.Tensor], consume_bytes: int) -> int:
        """load (single buffer): copy the staged bytes into the live `params`, `consume_bytes` at a
        time; the buckets are released. Returns bytes copied."""
        views = {name: tensor_bytes(p.data) for name, p in params.items()}
        version, copied = self.version, 0
        if self.is_delta:  # whole tensors, put together over the base
            for name, tensor in self.named_tensors():
                views[name].copy_(tensor_bytes(tensor))
                copied += tensor.nbytes
            self.loaded(version, {name: p.data for name, p in params.items()})
            self.reset()
            return copied
        for bucket in self._ordered():
            destinations = {s.name: views[self.aliases.get(s.name, s.name)] for s in bucket.slices}
            group, size = [], 0
            for i, s in enumerate(bucket.slices):
                if group and size + s.nbytes > consume_bytes:
                    copied += write_slices(bucket, destinations, group)
                    group, size = [], 0
                group.append(i)
                size += s.nbytes
            copied += write_slices(bucket, destinations, group)
        self.loaded(version, {name: p.data for name, p in params.items()})
        self.reset()
        return copied


class WeightStaging:
    """A `VersionStager` for the trainer's layout and the calls that fill it (the holder bases of
    param_update/holder.py expose them as `WeightHolder` methods). Timings in seconds,
    `{recv_s, register_s}`.

    Args:
        expected: canonical name -> (dtype, shape) of every tensor a version carries.
        aliases: incoming name -> canonical name (tied weights).
        device: where staged versions live (`VersionStager`).
    """

    def __init__(self, expected: dict, aliases: Optional[dict] = None, device: Optional[str] = None):
        self.stager = VersionStager(expected, aliases, device)

    def stage_bucket(self, version: int, index: int, source: BucketHandle, slices: list) -> dict[str, float]:
        """recv (bucket `index` of `version`, read through its transport's handle: zero-copy views
        where the transport allows) + register-buffer (stage it)."""
        start = time.perf_counter()
        data = source.read(slices)
        fetched = time.perf_counter()
        self.stager.stage(version, Bucket(version, index, data, slices))
        return {"recv_s": fetched - start, "register_s": time.perf_counter() - fetched}

    def stage_version(self, version: int, buckets: list, num_buckets: int) -> dict[str, float]:
        """`stage_bucket` of each (index, source, slices) in `buckets`, then `check`; the seconds summed, the
        check's in register_s (where a delta is put together)."""
        totals = {"recv_s": 0.0, "register_s": 0.0}
        for index, source, slices in buckets:
            for part, seconds in self.stage_bucket(version, index, source, slices).items():
                totals[part] += seconds
        start = time.perf_counter()
        self.check(version, num_buckets)
        totals["register_s"] += time.perf_counter() - start
        return totals

    def check(self, version: int, num_buckets: int) -> None:
        """StagingError unless every bucket and tensor of `version` is staged."""
        self.stager.check_complete(version, num_buckets)

    def discard(self, version: int) -> None:
        """Drop `version` if it is the one being staged; the served weights are untouched."""
        if self.stager.version == version:
            self.stager.reset()


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def _assemble(pieces, device: Optional[str] = None) -> torch.Tensor:
    """One tensor (on `device`, default the CPU) from its (TensorSlice, uint8 array or tensor) pieces."""
    first = pieces[0][0]
    flat = torch.empty(first.tensor_nbytes, dtype=torch.uint8, device=device)
    for s, array in pieces:
        flat[s.start : s.start + s.nbytes].copy_(as_tensor(array))
    return flat.view(first.dtype).reshape(first.shape)
