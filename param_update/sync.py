"""recv + register-buffer + load: the receiving half of the five-part weight sync.

Buckets of version v arrive from the trainer's send thread (`BucketStream`). Each receiver
reads through its link, the first transport of the table that reaches it (async_rl/api/weights.py
`TransportTable`: shared memory on the sender's Ray node, a gloo group on other nodes), or through
the table's fallback (Ray's object store) when its link did not get the bucket for it (a receiver
whose nodes are unknown, or one restarted since). A bucket written through a transport that
announces each bucket (the collective, the object store) is handed to its receivers as soon as it
arrives; they fetch it (recv) and register it in their staging buffer (register-buffer) while
generation and logp go on with v - 1, then check that v is complete. A receiver whose link
announces whole versions (shared memory) gets the whole version in one call once the last bucket
is written (recv is a mapping, register-buffer builds views: no copy), which registers and checks
it; a call per bucket would only take CPU from the copy still running. When v is staged and
checked everywhere (phase 1), each receiver loads it (phase 2, between decoding steps), and
the policy clock is told that v is served. A failure before phase 2 drops the staged copy everywhere and
leaves v - 1 serving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Optional

import param_update.transports  # noqa: F401 - registers the built-in transports: the default table
from async_rl.api.weights import BucketRef, Route, TransportTable, WeightReceiver, WeightSync, WeightTransport
from async_rl.core.errors import WeightSyncError, is_lost_server_error
from async_rl.core.fault_points import hold_at
from async_rl.core.trace import TraceRecorder
from param_update.delta import BASE


STAGE_BUCKET = "recv + register-buffer"  # a receiver call (its name in errors and in the timeline)
STAGE_VERSION = "recv + register-buffer + check"


@dataclass
class VersionEnd:
    version: int
    num_buckets: int
    trainer_timings: dict  # seconds: gather, send
    whole: tuple = ()  # with deltas and restarts: the whole version's BucketRefs, for restarted receivers


class BucketStream:
    """The buckets of every version, as the send thread announces them (in order).

    `max_in_flight` bounds buckets announced but not yet staged by every receiver: the
    sender's `put_bucket` waits for room, so Ray's object store holds at most that many
    (a transport that announces whole versions holds them itself).
    """

    def __init__(self, max_in_flight: int = 4):
        self._queues: dict[int, asyncio.Queue] = {}
        self._room = asyncio.BoundedSemaphore(max_in_flight)  # a release without an acquire raises

    def _queue(self, version: int) -> asyncio.Queue:
        return self._queues.setdefault(version, asyncio.Queue())

    async def put_bucket(self, bucket: BucketRef) -> None:
        await self._room.acquire()
        self._queue(bucket.version).put_nowait(bucket)

    def end_version(self, end: VersionEnd, buckets: tuple = ()) -> None:
        """The version's last announcement, after `buckets` (not counted in flight: announced with the end)."""
        for bucket in buckets:
            self._queue(end.version).put_nowait(bucket)
        self._queue(end.version).put_nowait(end)

    def fail(self, version: int, message: str) -> None:
        self._queue(version).put_nowait(WeightSyncError(f"the trainer's send of version {version} failed: {message}"))

    async def next(self, version: int, timeout_s: float):
        """The next BucketRef or VersionEnd of `version`; raises WeightSyncError on a send failure or timeout."""
        try:
            item = await asyncio.wait_for(self._queue(version).get(), timeout=timeout_s)
        except asyncio.TimeoutError as exc:
            raise WeightSyncError(f"no bucket of version {version} arrived for {timeout_s:g} s") from exc
        if isinstance(item, Exception):
            raise item
        if isinstance(item, VersionEnd):
            del self._queues[version]
        return item

    def release(self) -> None:
        """A bucket is staged everywhere: room for the next one."""
        self._room.release()


class OverlappedWeightSync(WeightSync):
    """Stages each bucket on every receiver as it arrives, then a two-phase load.

    Args:
        receivers: WeightReceivers (async_rl/api/weights.py; param_update/receivers.py).
        clock: the policy clock's handle (async_rl/core/policy_clock.py), told `set_served_version(version)`
            once every receiver serves it.
        stream: where the trainer's buckets arrive.
        timeout_s: any one wait (a bucket, a receiver call) may take this long.
        on_lost: `on_lost(receiver, cause, hung)`; when given, a receiver with a `replica_index` whose
            process is gone, or that does not answer within `lost_after_s` (`hung`), is left out of
            the sync and reported there instead of failing it, and the newest version's buckets are
            kept (each transport keeps it readable: `WeightTransport.retain`) so that `replace` can
            load them into its restarted server.
        lost_after_s: the wait for such a receiver (default `timeout_s`).
        transports: the table to choose links from (`TransportTable`, or its transport classes, preferred
            first; default: the registered ones); they travel to the sender with each version's route.
    """

    def __init__(self, receivers: list[WeightReceiver], clock: Any, stream: BucketStream, timeout_s: float = 300.0,
                 on_lost: Optional[Callable[[Any, str, bool], None]] = None, lost_after_s: Optional[float] = None,
                 transports: TransportTable | list[type[WeightTransport]] | None = None,
                 trace: Optional[TraceRecorder] = None):
        if not receivers:
            raise ValueError("weight sync needs at least one receiver")
        self.receivers = list(receivers)
        self.clock = clock
        self.stream = stream
        self.timeout_s = timeout_s
        self.on_lost = on_lost
        self.lost_after_s = timeout_s if lost_after_s is None else lost_after_s
        self.lock = asyncio.Lock()  # one sync or one replacement at a time
        self.retained: Optional[tuple[int, list[BucketRef], int]] = None  # (version, buckets, num_buckets)
        self._lost: set[str] = set()
        self.table = transports if isinstance(transports, TransportTable) else TransportTable(transports)
        self.transports = {cls.name: cls() for cls in self.table.classes}  # this stage's side of each
        self.sender_node: Optional[str] = None  # Ray node id of the trainer's sending process
        self._processes: dict[str, int] = {}  # receiver name -> its processes (as located)
        self.trace = trace or TraceRecorder("weight sync")  # each receiver call as a span on the receiver's track

    def _live(self) -> list:
        return [r for r in self.receivers if r.name not in self._lost]

    def _restartable(self, receiver) -> bool:
        return self.on_lost is not None and receiver.replica_index is not None

    def _survivable(self, receiver, error: BaseException) -> bool:
        return self._restartable(receiver) and (isinstance(error, asyncio.TimeoutError) or is_lost_server_error(error))

    async def _on_all(self, what: str, version: int, call: Callable[[Any], Awaitable], receivers=None) -> dict:
        """Await `call(receiver)` on every live receiver; a failure or timeout names the receiver (a lost
        restartable one is reported to `on_lost` and left out instead)."""
        receivers = self._live() if receivers is None else receivers

        async def timed(receiver):
            started, shown, result = time.time(), {}, None
            try:
                result = await asyncio.wait_for(call(receiver), timeout=self.lost_after_s if self._restartable(receiver)
                                                else self.timeout_s)
                if isinstance(result, dict) and "interrupted" in result:  # a load's requests in flight
                    shown["interrupted"] = result["interrupted"]
                return result
            finally:
                self._trace_call(f"receiver {receiver.name}", what, version, started, time.time(), result, shown)

        results = await asyncio.gather(*(timed(r) for r in receivers), return_exceptions=True)
        out = {}
        for receiver, result in zip(receivers, results):
            name = receiver.name
            if isinstance(result, BaseException) and self._survivable(receiver, result):
                hung = isinstance(result, asyncio.TimeoutError)
                cause = (f"no answer to {what} of version {version} within {self.lost_after_s:g} s" if hung
                         else f"{type(result).__name__} during {what}")
                if name not in self._lost:  # buckets staged at once each see the loss: report it once
                    self._lost.add(name)
                    for transport in self.transports.values():
                        transport.drop(name)
                    self.on_lost(receiver, cause, hung)
                continue
            if isinstance(result, asyncio.TimeoutError):
                raise WeightSyncError(f"{what} of version {version} on receiver {name!r} took over {self.timeout_s:g} s")
            if isinstance(result, BaseException):
                raise WeightSyncError(
                    f"{what} of version {version} failed on receiver {name!r}: {type(result).__name__}: {result}"
                ) from result
            out[name] = result
        return out

    def _trace_call(self, track: str, what: str, version: int, started: float, ended: float, result, shown: dict):
        """The receiver call as a span; a staging call's recv and register-buffer (the seconds the receiver
        measured, `{recv_s, register_s}`) as its last two parts, inside it."""
        self.trace.add(track, what, started, ended, version=version, **shown)
        if isinstance(result, dict) and "recv_s" in result and "register_s" in result:
            registered = max(started, ended - result["register_s"])
            self.trace.add(track, "recv", max(started, registered - result["recv_s"]), registered, version=version)
            self.trace.add(track, "register-buffer", registered, ended, version=version)

    async def open_version(self, version: int, sender_node: str) -> Route:
        """The sender's first question about `version`: its `Route`, transport name -> (transport class,
        ticket) for the links of the live receivers (a transport may wait for room:
        `WeightTransport.open`) and the table's delta option. Receivers are located once, at the first
        version (each restarted one at its `replace`); each transport learns who reads through it first
        (`WeightTransport.members`)."""
        if self.sender_node is None:
            self.sender_node = sender_node
            await self._locate(self.receivers, version)
        route = {}
        for name, transport in self.transports.items():
            readers = {r.name: self._processes.get(r.name, 1) for r in self._live() if r.link == name}
            transport.members(readers)
            if readers:
                route[name] = (type(transport), await transport.open(version, 3 * self.timeout_s))
        fallback = self.table.fallback
        return Route(route, delta=self.table.delta, keep_whole=self.table.delta and self.on_lost is not None,
                     fallback=(fallback.name, fallback))

    async def _locate(self, receivers: list, version: int) -> None:
        """Each receiver's link: the first transport of the table that reaches every process of it."""
        found = await self._on_all("locate", version, lambda r: r.nodes(), receivers)
        for r in receivers:
            r.link = self.table.link_of(found.get(r.name), self.sender_node)
            self._processes[r.name] = len(found.get(r.name) or ()) or 1

    def _at_end(self, receiver, bucket: BucketRef) -> bool:
        """`receiver` stages `bucket` with the whole version at its end (its link announces whole
        versions and the bucket went through it), else as the bucket arrives."""
        return receiver.link in bucket.handles and not self.transports[receiver.link].announces_each_bucket

    def _reads_link(self, receiver, bucket: BucketRef) -> bool:
        """`receiver` reads `bucket` through its link: the bucket went through it and it serves the receiver."""
        link = receiver.link
        return link in bucket.handles and self.transports[link].serves(receiver.name, bucket.handles[link])

    def _view_for(self, receiver, bucket: BucketRef) -> BucketRef:
        """`bucket` as `receiver` reads it: through its link, else (restarted since its version's route)
        through the table's fallback, carried there from the sender's node when it did not go through it."""
        fallback = self.table.fallback
        bucket.fallback = fallback.name
        if self._reads_link(receiver, bucket):
            return bucket
        if fallback.name not in bucket.handles:
            source = next(iter(bucket.handles.values()))
            bucket.handles[fallback.name] = fallback.carry(source, bucket.slices, self.sender_node)
        return replace(bucket, handles={fallback.name: bucket.handles[fallback.name]})

    async def _stage_bucket(self, bucket: BucketRef, totals: dict) -> None:
        """recv + register-buffer of one bucket on the receivers that stage it as it arrives."""
        try:
            receivers = [r for r in self._live() if not self._at_end(r, bucket)]
            views = {r.name: self._view_for(r, bucket) for r in receivers}
            results = await self._on_all(STAGE_BUCKET, bucket.version, lambda r: r.stage(views[r.name]), receivers)
        finally:
            if bucket.counted:
                self.stream.release()
        _add_times(totals, results)

    def _note_loaded(self, version: int, loads: dict, receivers: list, buckets: list) -> dict[str, int]:
        """Tell every transport who loaded `version` and who serves it from that transport now; returns
        how many loaded it through each transport."""
        read_through = {r.name: (r.link if buckets and self._reads_link(r, buckets[0]) else self.table.fallback.name)
                        for r in receivers if r.name in loads}
        for name, transport in self.transports.items():
            keeping = [r for r, link in read_through.items() if link == name and loads[r].get("keeps_buffer", True)]
            transport.loaded(version, list(loads), keeping)
        return {name: sum(link == name for link in read_through.values()) for name in self.transports}

    async def sync(self, version: int, started_at: float) -> dict[str, float]:
        """Deliver `version`; `started_at` is the wall time (time.time()) its gather began."""
        async with self.lock:
            return await self._sync(version, started_at)

    async def _sync(self, version: int, started_at: float) -> dict[str, float]:
        totals: dict[str, dict] = {}
        staging: list[asyncio.Task] = []
        buckets: list[BucketRef] = []
        try:
            while True:
                item = await self.stream.next(version, self.timeout_s)
                if isinstance(item, VersionEnd):
                    break
                buckets.append(item)
                staging.append(asyncio.ensure_future(self._stage_bucket(item, totals)))
                done = [t for t in staging if t.done()]
                for task in done:  # surface a failed bucket without waiting for the rest
                    task.result()
            await asyncio.gather(*staging)
            at_end = [r for r in self._live() if buckets and self._at_end(r, buckets[0])]
            staged = await self._on_all(STAGE_VERSION, version,
                                        lambda r: r.stage_version(version, buckets, item.num_buckets), at_end)
            _add_times(totals, staged)
            checked = await self._on_all("check", version, lambda r: _as_register(r.check(version, item.num_buckets)),
                                         [r for r in self._live() if r not in at_end])
            _add_times(totals, checked)
        except BaseException:
            for task in staging:
                task.cancel()
            await asyncio.gather(*staging, return_exceptions=True)
            await asyncio.gather(*(r.discard(version) for r in self._live()), return_exceptions=True)
            for transport in self.transports.values():
                transport.ended(version)
            raise
        hold_at("weight_sync", version)
        # a load that fails leaves the region held for good: some receivers may serve it
        loads = await self._on_all("load", version, lambda r: r.commit(version, item.num_buckets))
        total_s = time.time() - started_at  # every receiver serves it now; the clock is told next
        read_through = self._note_loaded(version, loads, self._live(), buckets)
        if self.on_lost is not None:  # a delta is kept whole for restarted receivers
            self.retained = (version, list(item.whole), len(item.whole)) if item.whole else (version, buckets,
                                                                                             item.num_buckets)
            for transport in self.transports.values():
                transport.retain(version)
        await self.clock.set_served_version.remote(version)
        gathered = started_at + item.trainer_timings["gather"]  # the trainer's parts, as it reported them
        self.trace.add("trainer", "gather", started_at, gathered, version=version)
        self.trace.add("trainer", "send", gathered, gathered + item.trainer_timings["send"], version=version)
        generation = [r for r in self.receivers if r.serves_generation and r.name in loads]
        blocked = [loads[r.name]["blocked_s"] for r in generation]
        return {
            "timing_s/param_update/gather": item.trainer_timings["gather"],
            "timing_s/param_update/send": item.trainer_timings["send"],
            "timing_s/param_update/recv": max((t["recv_s"] for t in totals.values()), default=0.0),
            "timing_s/param_update/register_buffer": max((t["register_s"] for t in totals.values()), default=0.0),
            "timing_s/param_update/load": max((t["load_s"] for t in loads.values()), default=0.0),
            "timing_s/param_update/total": total_s,
            "async/param_update/blocked_s": max(blocked, default=0.0),
            "async/param_update/step_wait_s": max((loads[r.name]["load_s"] - loads[r.name]["blocked_s"]
                                                   for r in generation), default=0.0),
            "async/param_update/num_buckets": float(item.num_buckets),
            "async/param_update/bytes": float(sum(s.nbytes for bucket in buckets for s in bucket.slices)),
            "async/param_update/delta": float(any(s.name == BASE for bucket in buckets for s in bucket.slices)),
            **{f"async/param_update/{name}_receivers": float(count) for name, count in read_through.items()},
        }

    async def replace(self, receiver) -> Optional[int]:
        """Put `receiver` (a restarted server) in place of the one of the same name, after loading the
        newest synced version into it (between syncs). Returns that version, or None when no version
        was synced yet (the new server serves the model path's weights, which are version 0)."""
        async with self.lock:
            version, buckets, num_buckets = self.retained or (None, [], 0)
            self._lost.discard(receiver.name)
            for transport in self.transports.values():  # the process it replaces holds and reads nothing
                transport.drop(receiver.name)
            if self.sender_node is not None:
                await self._locate([receiver], version)
            if version is not None:  # its buckets: in the retained region, or kept in the object store
                for bucket in buckets:
                    view = self._view_for(receiver, bucket)
                    await self._on_all(STAGE_BUCKET, version, lambda r, b=view: r.stage(b), [receiver])
                await self._on_all("check", version, lambda r: r.check(version, num_buckets), [receiver])
                loads = await self._on_all("load", version, lambda r: r.commit(version, num_buckets), [receiver])
                self._note_loaded(version, loads, [receiver], buckets)
            if receiver.name in self._lost:  # a loss during the loads above was reported; keep it out
                raise WeightSyncError(f"the restarted {receiver.name} was lost while loading version {version}")
            self.receivers = [receiver if r.name == receiver.name else r for r in self.receivers]
            return version


async def _as_register(check: Awaitable) -> dict[str, float]:
    """A receiver's `check`, timed as register-buffer's last part (`{register_s}`): a delta is put together there."""
    start = time.perf_counter()
    await check
    return {"register_s": time.perf_counter() - start}


def _add_times(totals: dict, results: dict) -> None:
    """Add each receiver's `{recv_s, register_s}` (either may be absent) to its running totals."""
    for name, t in results.items():
        totals.setdefault(name, {"recv_s": 0.0, "register_s": 0.0})
        totals[name]["recv_s"] += t.get("recv_s", 0.0)
        totals[name]["register_s"] += t.get("register_s", 0.0)
