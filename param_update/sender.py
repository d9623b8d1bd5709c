"""gather + send, on the training side.

gather: every train rank walks verl's per-tensor generator (`get_per_tensor_param`:
FSDP2 shards -> full tensors, a collective), rank 0 groups the tensors into buckets of
`param_update_preduce_bucket_size_mb` (views, no copy). That is all training waits for,
with one exception: a tensor that is the live weight itself (one rank, no gather copy)
is sent (copied) before training may change it.

send: a background thread of rank 0 copies each bucket once per transport its route names
(the sink's `open_version`, asked at the start of each gather; param_update/transports/): into a
region of its shared buffer for receivers on its Ray node, into a gloo group for those on other
nodes, into Ray's object store for receivers whose nodes are unknown, and announces it to the
sink (the param_update stage), so the next training step runs while the buckets travel. A bucket
written through a transport that announces each bucket (the collective, the store) is announced
at once (`put_bucket`, which returns only when the sink has room: that bounds the buckets in
flight); one only in shared
memory is announced with the version's end (`end_version`), one call for all of them, so no
round trip competes with the copy.

Every write of a bucket is split into `put_threads` pieces written at once from a thread pool
(`PUT_THREADS`; why four, measured: bench/README.md#param_updatepy-the-weight-sync).

Deltas (the table's `delta` option, learnt from the first version's route): each version after the
first is packed as the values changed since the one before, as receivers hold them
(param_update/delta.py); the sender keeps the previous version for that, and casts the next one into
the memory of the version before it once the send thread has copied that out. With restartable
receivers (`Route.keep_whole`) the whole version is also written through the table's fallback,
announced with its end, for a restarted receiver to load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, Union

import ray
import torch

from async_rl.api.weights import Bucket, BucketRef, Route, WeightTransport
from param_update.buckets import pack_buckets
from param_update.delta import DeltaEncoder, as_held

logger = logging.getLogger(__name__)

SINK_TIMEOUT_S = 600.0  # one announce may wait this long for room at the sink
ROUTE_TIMEOUT_S = 1800.0  # the route of a version may wait this long (the sink bounds its wait for a region)
PUT_THREADS = 4  # objects per bucket, put at once


@dataclass
class QueuedBucket:
    """A packed bucket waiting for the send thread. `route`: the ObjectRef of the sink's route for its
    version; `sent`: its handles when the gather already sent it (it aliases the live weights)."""

    bucket: Bucket
    sink: Any
    route: Any
    sent: Optional[dict] = None

    @property
    def version(self) -> int:
        return self.bucket.version


@dataclass
class VersionDone:
    """The end of a version's buckets: `count` buckets, gathered in `gather_s` seconds. `whole`: with
    deltas, the version as receivers hold it (name -> tensor), written for restarts when the route asks;
    `bucket_bytes`: the size of its buckets."""

    version: int
    count: int
    gather_s: float
    sink: Any
    route: Any = None
    whole: Optional[dict] = None
    bucket_bytes: int = 0


_Queued = Union[QueuedBucket, VersionDone]


class BucketSender:
    """Owns the send thread of one trainer process; buckets leave in order, version by version.

    Args:
        max_queued: packed buckets waiting for the thread before gather waits (memory bound).
        put_threads: a bucket is written in this many pieces, from this many threads at once.
        transports: name -> the transport to write through (default: one of each class a route names,
            made at its first use; senders used in turn may share them).
        held_dtypes: tensor name -> the dtype receivers hold it in (a bf16 rollout of a float32 trainer):
            tensors are cast to it before they are packed (default: sent as the trainer holds them).
    """

    def __init__(self, max_queued: int = 2, put_threads: int = PUT_THREADS,
                 transports: Optional[dict[str, WeightTransport]] = None,
                 held_dtypes: Optional[dict[str, torch.dtype]] = None):
        if put_threads < 1:
            raise ValueError(f"put_threads must be at least 1, got {put_threads}")
        self._put_threads = put_threads
        self._put_pool = ThreadPoolExecutor(put_threads, thread_name_prefix="weight-bucket-put")
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._transports: dict[str, WeightTransport] = dict(transports or {})
        self._error: Optional[BaseException] = None
        self._held_dtypes = dict(held_dtypes or {})
        self._encoder = DeltaEncoder(self._held_dtypes)
        self._delta: Optional[bool] = None  # the table's delta option, from the first route
        self._sent_through: Optional[int] = None  # the last version every transport has copied out (the thread's)
        self._thread = threading.Thread(target=self._run, name="weight-bucket-sender", daemon=True)
        self._thread.start()

    def gather_and_send(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int, sink: Any,
        is_sender: bool, live_storages: frozenset[int] = frozenset(),
    ) -> dict[str, float]:
        """Walk the tensors (every rank: the gather is collective); rank 0 queues them as buckets.

        `live_storages`: storage addresses of the live weights; a bucket holding one of them
        is sent here, before returning (so the gather waits for its route). Returns
        `{"gather_s": seconds}`; sending goes on in the thread.
        """
        self.raise_if_failed()
        start = time.perf_counter()
        if not is_sender:
            for _ in named_tensors:
                pass
            return {"gather_s": time.perf_counter() - start}
        live_names = set()

        def note_live(pairs):
            for name, tensor in pairs:
                if tensor.untyped_storage().data_ptr() in live_storages:
                    live_names.add(name)
                yield name, tensor

        route = sink.open_version.remote(version, ray.get_runtime_context().get_node_id())  # resolved when needed
        if self._delta is None:  # the first version: whether the table sends deltas (its route, waited for once)
            self._delta = ray.get(route, timeout=ROUTE_TIMEOUT_S).delta
        if self._delta:
            spare, sent = self._encoder.spare_version, self._sent_through
            tensors = self._encoder.encode(named_tensors, version, self._encoder.version,
                                           reuse_spare=spare is not None and sent is not None and sent >= spare)
        elif self._held_dtypes:
            tensors = ((name, as_held(t, self._held_dtypes.get(name))) for name, t in named_tensors)
        else:
            tensors = named_tensors
        count = 0
        for bucket in pack_buckets(note_live(tensors), bucket_bytes, version):
            aliases_live = any(s.name in live_names for s in bucket.slices)
            sent = self.send(bucket, route) if aliases_live else None
            self._queue.put(QueuedBucket(bucket, sink, route, sent))
            count += 1
        gather_s = time.perf_counter() - start
        whole = self._encoder.previous if self._delta else None
        self._queue.put(VersionDone(version, count, gather_s, sink, route, whole, bucket_bytes))
        return {"gather_s": gather_s}

    def _transport(self, name: str, cls: type[WeightTransport]) -> WeightTransport:
        if name not in self._transports:
            self._transports[name] = cls()
        return self._transports[name]

    def send(self, bucket: Bucket, route) -> dict:
        """Copy `bucket` once through each transport of `route` (an ObjectRef of the sink's `Route`).
        Returns transport name -> the bucket's handle there."""
        plan: Route = ray.get(route, timeout=ROUTE_TIMEOUT_S)
        return {name: self._transport(name, cls).write(ticket, bucket, self._put_pool, self._put_threads)
                for name, (cls, ticket) in plan.transports.items()}

    def _whole_for_restarts(self, done: VersionDone) -> list[BucketRef]:
        """With deltas and restartable receivers, the version as receivers hold it written through the
        table's fallback (its ticket: none asked), as BucketRefs."""
        plan: Route = ray.get(done.route, timeout=ROUTE_TIMEOUT_S)
        if not (plan.keep_whole and done.whole is not None and plan.fallback is not None):
            return []
        name, cls = plan.fallback
        fallback = self._transport(name, cls)
        return [BucketRef(b.version, b.index, b.slices,
                          {name: fallback.write(True, b, self._put_pool, self._put_threads)}, counted=False)
                for b in pack_buckets(done.whole.items(), done.bucket_bytes, done.version)]

    def close(self) -> None:
        """Free what the transports hold (the pipeline's shutdown: shared-memory files are unlinked,
        receivers' views stay valid)."""
        for transport in self._transports.values():
            transport.close()
        self._encoder.close()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the weight send thread failed: {type(self._error).__name__}: {self._error}")

    def _run(self) -> None:
        send_s = 0.0
        at_end: list[BucketRef] = []  # this version's buckets announced with its end
        while True:
            item: _Queued = self._queue.get()
            try:
                if isinstance(item, VersionDone):
                    whole = self._whole_for_restarts(item)
                    ray.get(item.sink.end_version.remote(item.version, item.count,
                                                         {"gather": item.gather_s, "send": send_s}, at_end, whole),
                            timeout=SINK_TIMEOUT_S)
                    send_s, at_end = 0.0, []
                    self._sent_through = item.version  # its buckets (and whole) are copied out: memory reusable
                    continue
                bucket = item.bucket
                start = time.perf_counter()
                handles = self.send(bucket, item.route) if item.sent is None else item.sent
                if any(self._transports[name].announces_each_bucket for name in handles):
                    ray.get(item.sink.put_bucket.remote(bucket.version, bucket.index, handles, bucket.slices),
                            timeout=SINK_TIMEOUT_S)
                else:  # nothing in flight to bound: announced with the version's end
                    at_end.append(BucketRef(bucket.version, bucket.index, bucket.slices, handles, counted=False))
                send_s += time.perf_counter() - start
            except BaseException as exc:  # noqa: BLE001 - reported to the sink and to the next gather
                self._error = exc
                logger.exception("weight send failed")
                try:
                    item.sink.sender_failed.remote(item.version, f"{type(exc).__name__}: {exc}")
                except Exception:  # noqa: BLE001 - the sink may be gone too
                    pass


def live_storage_addresses(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """Storage addresses of live weights (DTensors: their local shards), for `gather_and_send`."""
    out = set()
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        out.add(local.untyped_storage().data_ptr())
    return frozenset(out)
