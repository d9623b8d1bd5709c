"""Contracts of the weight sync: what a bucket is, how it travels (`WeightTransport`), who
receives it (`WeightReceiver` on the param_update stage's side, `WeightHolder` on the receiver's
own actor) and what the param_update stage drives (`WeightSync`).

Version v travels in buckets. The trainer's send thread writes each bucket through the
transports the version's route names (`WeightTransport.open` gives it room per version), the
param_update stage announces it (`BucketRef`: one handle per transport) and every receiver stages
it through its own link, the first registered transport (by `rank`) that reaches all its
processes. Transports register by name (`register_transport`); a new one is one module and one
call.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Protocol, runtime_checkable

import numpy as np
import torch


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
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def whole(self) -> bool:
        """The slice is the whole tensor."""
        return self.start == 0 and self.nbytes == self.tensor_nbytes


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


@runtime_checkable
class BucketHandle(Protocol):
    """Where a transport put one bucket; travels to the receivers (picklable)."""

    def read(self, slices: list[TensorSlice]) -> list[np.ndarray]:
        """The bucket's arrays, one per slice, read in the receiver's process (zero-copy where the
        transport allows; read-only)."""


@dataclass
class BucketRef:
    """One announced bucket of a version: its slices and a handle per transport it was written
    through (transport name -> BucketHandle)."""

    version: int
    index: int
    slices: list
    handles: dict[str, Any] = field(default_factory=dict)
    counted: bool = True  # announced on its own: holds a place among the buckets in flight
    fallback: Optional[str] = None  # the table's fallback transport (set by the sync before staging)

    def handle_for(self, link: Optional[str]) -> Any:
        """The handle a receiver on `link` reads through: its link's, else the fallback's."""
        if link in self.handles:
            return self.handles[link]
        if self.fallback in self.handles:
            return self.handles[self.fallback]
        raise KeyError(f"bucket {self.index} of version {self.version} went through {sorted(self.handles)}, "
                       f"not through link {link!r} nor the fallback {self.fallback!r}")


@dataclass(frozen=True)
class ReceiverSetup:
    """How a rollout receiver stages and loads versions (`WeightReceiver.configure`).

    `consume_bytes`: bytes loaded at a time. `layout`: the trainer's name -> (dtype, shape), checked
    against the receiver's model (None: not checked). `partial_rollout`: a load interrupts running
    requests (else waits for them). `adapter` (LoRA, a `param_update.lora.LoraAdapter`): versions carry
    the adapter's tensors only. `delta`: versions after the first may arrive as deltas (param_update/delta.py),
    so a receiver keeps the version it serves as their base."""

    dual_buffer: bool
    consume_bytes: int
    layout: Optional[dict] = None
    partial_rollout: bool = True
    adapter: Any = None
    delta: bool = False


class WeightTransport(ABC):
    """One way weight buckets travel from the trainer's sending process to receivers.

    The same class serves three processes: the driver checks its room at start (`room_bytes`,
    `check_room`), the param_update stage gives each version a place (`open`) and learns who
    holds what (`loaded`, `ended`, `retain`, `drop`: one event loop), and the trainer's send
    thread writes buckets (`write`; `close` at shutdown). A receiver reads through the handle.
    """

    name: ClassVar[str]
    rank: ClassVar[int]  # preference: a receiver's link is the lowest-ranked transport that reaches it
    # True: each bucket is announced and staged as it arrives, at most `max_in_flight` at a time;
    # False: a version's buckets are announced with its end and staged in one call per receiver
    announces_each_bucket: ClassVar[bool] = True

    @classmethod
    @abstractmethod
    def reaches(cls, receiver_nodes: Optional[Sequence], sender_node: Any) -> bool:
        """Whether a receiver whose processes run on `receiver_nodes` (None: unknown) can read what
        the sender on `sender_node` writes (node ids, or node indices in a placement plan)."""

    # ---- the param_update stage ---------------------------------------------------------------
    async def open(self, version: int, timeout_s: float) -> Any:
        """The sender's room for `version` (its ticket for `write`); may wait up to `timeout_s` (s)."""
        return True

    def loaded(self, version: int, names: Sequence[str], keeping: Sequence[str]) -> None:
        """Receivers `names` loaded `version` through this transport; those in `keeping` serve from it."""

    def ended(self, version: int) -> None:
        """The sync of `version` is over (loaded or dropped everywhere)."""

    def retain(self, version: int) -> None:
        """Keep `version` readable (restarted receivers load it later)."""

    def drop(self, name: str) -> None:
        """Receiver `name` is gone: it holds nothing."""

    def members(self, readers: dict[str, int]) -> None:
        """The receivers whose link this is, for the next version on: name -> its processes."""

    def serves(self, name: str, handle: Any) -> bool:
        """Whether receiver `name` can read `handle` through this transport now (one that delivers each
        bucket once, to the members it was sent to, cannot serve a receiver restarted since)."""
        return True

    # ---- the trainer's send thread --------------------------------------------------------------
    @abstractmethod
    def write(self, ticket: Any, bucket: Bucket, pool=None, parts: int = 1) -> BucketHandle:
        """Copy `bucket` once into this transport (in `parts` pieces on `pool`, a thread pool, when
        given); returns its handle."""

    def close(self) -> None:
        """Free what `write` holds (the pipeline's shutdown)."""

    # ---- the table's fallback ---------------------------------------------------------------------
    @classmethod
    def carry(cls, handle: BucketHandle, slices: list, sender_node: Any) -> BucketHandle:
        """The bucket behind `handle` (written through another transport, readable on `sender_node`)
        made readable through this one: how the table's fallback reaches a receiver its version's
        route did not plan for (a server restarted since)."""
        raise NotImplementedError(f"the {cls.name!r} weight transport cannot carry buckets of another")

    # ---- the driver, at start ---------------------------------------------------------------------
    @staticmethod
    def room_bytes() -> Optional[int]:
        """Bytes this transport can hold where the driver runs (None: not known)."""
        return None

    def check_room(self, model_bytes: int, bucket_bytes: int, versions_held: int, room_bytes: Optional[int]) -> None:
        """Raise BucketSizeError (naming the key to change) when `room_bytes` cannot hold what a
        sync keeps in it: `versions_held` versions of `model_bytes` and buckets of `bucket_bytes`."""


_TRANSPORTS: dict[str, type[WeightTransport]] = {}


def register_transport(cls: type[WeightTransport]) -> type[WeightTransport]:
    """Make `cls` available by its `name` (usable as a class decorator)."""
    _TRANSPORTS[cls.name] = cls
    return cls


def unregister_transport(name: str) -> None:
    _TRANSPORTS.pop(name, None)


def transport_class(name: str) -> type[WeightTransport]:
    if name not in _TRANSPORTS:
        raise KeyError(f"no weight transport {name!r}; registered: {sorted(_TRANSPORTS)}")
    return _TRANSPORTS[name]


def transports_by_rank() -> list[type[WeightTransport]]:
    """Every registered transport, preferred first."""
    return sorted(_TRANSPORTS.values(), key=lambda cls: (cls.rank, cls.name))


class TransportTable:
    """The weight transports a sync chooses from, by link, preferred first.

    A receiver's link is the first transport that reaches all its processes (`link_of`). The
    fallback is the last one that reaches receivers on unknown nodes: a bucket a receiver cannot read
    through its link (its version's route went elsewhere) is carried there (`WeightTransport.carry`).

    Args:
        classes: the transport classes (default: the registered ones, by rank).
        delta: versions after the first go as deltas, the values changed since the version before as
            receivers hold them (param_update/delta.py), on every link.
    """

    def __init__(self, classes: Optional[Sequence[type[WeightTransport]]] = None, delta: bool = False):
        self.delta = delta
        self.classes = list(classes) if classes else transports_by_rank()
        unknown = [cls for cls in self.classes if cls.reaches(None, None)]
        if not unknown:
            raise ValueError(f"no weight transport of {[c.name for c in self.classes]} reaches a receiver on "
                             "unknown nodes: the table has no fallback")
        self.fallback: type[WeightTransport] = unknown[-1]

    @property
    def names(self) -> list[str]:
        return [cls.name for cls in self.classes]

    def link_of(self, receiver_nodes: Optional[Sequence], sender_node: Any) -> str:
        """The name of the first transport that reaches processes on `receiver_nodes` (None or empty:
        unknown) from a sender on `sender_node`."""
        for cls in self.classes:
            if cls.reaches(receiver_nodes, sender_node):
                return cls.name
        raise RuntimeError(f"no weight transport of {self.names} reaches nodes {receiver_nodes} from {sender_node}")


@dataclass(frozen=True)
class Route:
    """How the sender sends one version (the param_update stage's answer to `open_version`).

    `transports`: transport name -> (class, ticket), one per link in use. `delta`: the table's delta
    option. `keep_whole`: with deltas, also write the whole version (as receivers hold it) through
    `fallback` (name, class) and announce it with the version's end: restarted receivers load it.
    """

    transports: dict
    delta: bool = False
    keep_whole: bool = False
    fallback: Optional[tuple] = None


def link_of(receiver_nodes: Optional[Sequence], sender_node: Any,
            transports: Optional[list[type[WeightTransport]]] = None) -> str:
    """A receiver's link in the table of `transports` (default: the registered ones, by rank)."""
    return TransportTable(transports).link_of(receiver_nodes, sender_node)


@runtime_checkable
class WeightReceiver(Protocol):
    """A holder of weights the sync delivers each version to, as the param_update stage sees it.

    `link` (a transport name) is set by the sync. `replica_index`: set on a rollout replica that
    may be restarted when lost. Timings are seconds: `stage` and `stage_version` return
    `{recv_s, register_s}`, `commit` `{load_s, blocked_s, keeps_buffer}` (`keeps_buffer`: it serves
    the staged buffer itself, zero copy), and `interrupted` where the receiver knows it (the requests
    decoding when the load swapped the weights under them; the timeline shows it on the load).
    """

    name: str
    serves_generation: bool
    replica_index: Optional[int]
    link: Optional[str]

    async def configure(self, setup: ReceiverSetup) -> None:
        """Set up staging and loading (rollout receivers; a layout mismatch fails here)."""

    async def nodes(self) -> Optional[list]:
        """The Ray node id of each of its processes (None: unknown)."""

    async def stage(self, bucket: BucketRef) -> dict:
        """recv + register-buffer of one bucket, through `link`."""

    async def stage_version(self, version: int, buckets: list[BucketRef], num_buckets: int) -> dict:
        """recv + register-buffer of every bucket of `version`, then `check`, in one call."""

    async def check(self, version: int, num_buckets: int) -> None:
        """Raise unless every bucket and tensor of `version` is staged."""

    async def commit(self, version: int, num_buckets: int) -> dict:
        """load: serve the staged `version` from now on."""

    async def discard(self, version: int) -> None:
        """Drop a staged `version` that will not be loaded; the served one is untouched."""


class WeightHolder(Protocol):
    """The Ray methods of an actor holding weights (a CPU rollout server, the logp stage), which
    `param_update.receivers.ActorReceiver` calls; `param_update.holder.StagedWeights` implements
    all of them over a staging buffer, a holder writes its own load (`load_staged`)."""

    def weight_sync_nodes(self) -> list: ...
    def stage_weight_bucket(self, version: int, index: int, handle: BucketHandle, slices: list) -> dict: ...
    def stage_weight_buckets(self, version: int, buckets: list, num_buckets: int) -> dict: ...
    def check_weights(self, version: int, num_buckets: int) -> None: ...
    def commit_weights(self, version: int, num_buckets: int) -> dict: ...
    def discard_weights(self, version: int) -> None: ...


class WeightSync(ABC):
    """What the param_update stage drives: `sync(version, started_at)` makes `version` the weights
    every receiver serves and returns per-part timings in seconds under verl-style metric names
    (`timing_s/param_update/<part>`, `async/param_update/blocked_s`)."""

    @abstractmethod
    async def sync(self, version: int, started_at: float) -> dict[str, float]:
        """Deliver `version` to every receiver; `started_at` is the wall time (time.time()) its gather began."""
