"""The cross-node transport ("collective"): torch.distributed carries each bucket from the trainer's
sending process to every receiving process on other Ray nodes, in a process group made for the
sync (gloo: the buckets are in host memory).

The group: rank 0 is the sender, ranks 1 .. world - 1 the processes of the receivers whose link
this is (`members`, told by the param_update stage before each version). The sender hosts the
rendezvous (a `TCPStore` on its node) and builds its side at the first bucket of a group; each
receiving process joins at its first read (its rank from the store's counter). A new group (an
`epoch`) is made whenever the members change: a receiver lost, a restarted one back. Building it,
and every send or receive, is bounded by `GROUP_TIMEOUT_S` (the engine's bound on a call,
async_rl/core/timeouts.py, under a sync's wait for a receiver): a group that cannot form, or a
send that cannot finish, falls back (below) before the sync would count its receivers as lost.

The broadcast is gloo's one-to-all algorithm written as the sender's point-to-point sends, one per
member, each tagged with the bucket's number in the group: a member that dies or hangs fails only its
own sends, and a receiving process may receive buckets in any order (gloo buffers early ones).

A receiving process receives into its `ReceiveBuffers` (param_update/transports/receive_buffers.py):
the memory of a version that no longer serves, so loading a version frees nothing.

Each bucket is first copied once into the sender's shared buffer (param_update/transports/
shared_memory.py: regions handed out per version, `RegionLedger`), which the sends read from. That
copy keeps a version readable after its sends: the table's fallback carries it from there to a
restarted receiver (`ObjectStore.carry`), and a member whose group broke mid-version (the sender or
the group gone) fetches it from there through a Ray task on the sender's node.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from async_rl.api.weights import Bucket, WeightTransport, register_transport
from async_rl.core.timeouts import CALL_TIMEOUT_S
from param_update.transports.receive_buffers import ReceiveBuffers
from param_update.transports.shared_memory import (
    REGIONS,
    SHM_DIR,
    RegionLedger,
    SharedBucket,
    SharedBuffer,
    check_buffer_room,
    shared_arrays,
    shm_free_bytes,
)

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = CALL_TIMEOUT_S  # a group's rendezvous, and one send or receive, may take this long
READ_TIMEOUT_S = 300.0  # a fallback read of a bucket from the sender's node may take this long


@dataclass(frozen=True)
class GroupTicket:
    """The param_update stage's answer to the sender for one version: the shared-buffer region its
    buckets go to, and the group they are sent in (`epoch`; `world`: 1 + the members' processes)."""

    region: int
    epoch: int
    world: int


@dataclass(frozen=True)
class CollectiveBucket:
    """A bucket sent in group `epoch` of `world` processes with `tag`, whose rendezvous is the sender's
    store at `address`:`port`; `shared` is its copy in the sender's shared buffer on `sender_node`."""

    shared: SharedBucket
    sender_node: str
    address: str
    port: int
    epoch: int
    world: int
    tag: int

    @property
    def group(self) -> tuple:
        """The group it was sent in: (the sender's store address, port, epoch)."""
        return self.address, self.port, self.epoch

    def read(self, slices: list) -> list[np.ndarray]:
        """The bucket's arrays: on the sender's node read from the shared buffer (zero copy); elsewhere
        received in the group (joined at the first read), or, when this process's group broke, fetched
        from the sender's node."""
        return _RECEIVING.read(self, slices)


# ---- the receiving processes ---------------------------------------------------------------------


@ray.remote(num_cpus=0)
def _read_on_sender_node(shared: SharedBucket, slices: list) -> list[np.ndarray]:
    return shared_arrays(shared, slices)


class _Joined:
    """This process's place in one group."""

    def __init__(self, handle: CollectiveBucket, timeout: datetime.timedelta):
        store = dist.TCPStore(handle.address, handle.port, handle.world, False, timeout=timeout)
        self.rank = int(store.add(_RANK_KEY, 1))
        if self.rank >= handle.world:
            raise RuntimeError(f"weight group {handle.epoch} has {handle.world - 1} receiving processes; this one "
                               f"would be number {self.rank}")
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(f"epoch{handle.epoch}", store), self.rank, handle.world,
                                           timeout)
        self.store = store


_RANK_KEY = "receiving_ranks"


class ReceivingSide:
    """The groups this process joined (one per sender: joining a newer one leaves the older), and those
    that broke here (read through the fallback from then on), by `CollectiveBucket.group`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._joined: dict[tuple, _Joined] = {}
        self._broken: set[tuple] = set()
        self._node: Optional[str] = None
        self._buffers = ReceiveBuffers()  # received into; reused once a version no longer serves

    def _this_node(self) -> Optional[str]:
        if self._node is None and ray.is_initialized():
            self._node = ray.get_runtime_context().get_node_id()
        return self._node

    def _group(self, handle: CollectiveBucket) -> Optional[_Joined]:
        key = handle.group
        with self._lock:
            if key in self._broken:
                return None
            if key not in self._joined:
                try:
                    joined = _Joined(handle, datetime.timedelta(seconds=GROUP_TIMEOUT_S))
                except Exception:  # noqa: BLE001 - the fallback reads it
                    logger.exception("could not join weight group %s", key)
                    self._broken.add(key)
                    return None
                # a newer group of the same sender replaces its older one (its members changed)
                self._joined = {k: v for k, v in self._joined.items() if k[:2] != key[:2]}
                self._joined[key] = joined
            return self._joined[key]

    def read(self, handle: CollectiveBucket, slices: list) -> list[np.ndarray]:
        if self._this_node() == handle.sender_node:
            return shared_arrays(handle.shared, slices)
        nbytes = handle.shared.nbytes
        joined = self._group(handle) if nbytes else None
        if joined is not None:
            flat = self._buffers.take(nbytes)
            try:
                joined.group.recv([torch.from_numpy(flat)], 0, handle.tag).wait(
                    datetime.timedelta(seconds=GROUP_TIMEOUT_S))
                return _split(flat, slices)
            except Exception:  # noqa: BLE001 - the sender or the group is gone: read it from the sender's node
                logger.exception("weight group %s broke at bucket tag %d", handle.group, handle.tag)
                with self._lock:
                    self._broken.add(handle.group)
                    self._joined.pop(handle.group, None)
        if nbytes == 0:
            return _split(np.empty(0, dtype=np.uint8), slices)
        on_sender = NodeAffinitySchedulingStrategy(handle.sender_node, soft=False)
        return ray.get(_read_on_sender_node.options(scheduling_strategy=on_sender).remote(handle.shared, slices),
                       timeout=READ_TIMEOUT_S)


_RECEIVING = ReceivingSide()


def _split(flat: np.ndarray, slices: list) -> list[np.ndarray]:
    ends = np.cumsum([0] + [s.nbytes for s in slices])
    return [flat[start:end] for start, end in zip(ends[:-1], ends[1:])]


# ---- the sending process ---------------------------------------------------------------------------


class SendingGroup:
    """The sender's side of one group: built in its own thread (the rendezvous waits for the receiving
    processes, which join only once their first bucket is announced), then it sends each queued bucket
    to every live member; a member whose send fails or times out is left out of the group's later sends
    (its receiver is being replaced; the group after it has other members)."""

    def __init__(self, epoch: int, world: int, timeout_s: float = GROUP_TIMEOUT_S):
        self.epoch, self.world = epoch, world
        self.address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(self.address, 0, world, True, timeout=self._timeout, wait_for_workers=False)
        self.port = self._store.port
        self.next_tag = 0
        self.error: Optional[BaseException] = None
        self._dead: set[int] = set()
        self._queue: queue.Queue = queue.Queue()
        self._sends: queue.Queue = queue.Queue()
        self._group = None
        threading.Thread(target=self._run, name=f"weight-group-{epoch}", daemon=True).start()
        threading.Thread(target=self._reap, name=f"weight-group-{epoch}-waits", daemon=True).start()

    def send(self, flat: torch.Tensor) -> int:
        """Queue `flat` (uint8, kept unchanged until every member has it) for every member; its tag."""
        tag, self.next_tag = self.next_tag, self.next_tag + 1
        if flat.numel():
            self._queue.put((tag, flat))
        return tag

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        try:
            self._group = dist.ProcessGroupGloo(dist.PrefixStore(f"epoch{self.epoch}", self._store), 0, self.world,
                                                self._timeout)
        except BaseException as exc:  # noqa: BLE001 - receivers time out and read through the fallback
            self.error = exc
            logger.exception("weight group %d could not form", self.epoch)
            self._sends.put(None)
            return
        while (item := self._queue.get()) is not None:
            tag, flat = item
            for rank in range(1, self.world):
                if rank not in self._dead:
                    try:
                        self._sends.put((rank, self._group.send([flat], rank, tag)))
                    except BaseException as exc:  # noqa: BLE001
                        self._lost(rank, exc)
        self._sends.put(None)

    def _reap(self) -> None:
        while (item := self._sends.get()) is not None:
            rank, work = item
            if rank in self._dead:
                continue
            try:
                work.wait(self._timeout)
            except BaseException as exc:  # noqa: BLE001
                self._lost(rank, exc)

    def _lost(self, rank: int, exc: BaseException) -> None:
        self._dead.add(rank)
        logger.warning("weight group %d: receiving rank %d left out after %s: %s", self.epoch, rank,
                       type(exc).__name__, exc)


@register_transport
class Collective(WeightTransport):
    """torch.distributed (gloo) to receivers on other nodes than the sender's, each bucket announced and
    received as it is sent."""

    name: ClassVar[str] = "collective"
    rank: ClassVar[int] = 50  # after shared memory (same node), before the object store
    announces_each_bucket: ClassVar[bool] = True

    def __init__(self, directory: str = SHM_DIR):
        self.directory = directory
        # the param_update stage's
        self.ledger = RegionLedger()
        self.epoch = 0
        self._members: dict[str, int] = {}  # receiver name -> processes, of the current epoch
        self._epoch_members: dict[int, set[str]] = {}  # epoch -> its receivers not lost since
        # the sender's
        self._buffer: Optional[SharedBuffer] = None
        self._group: Optional[SendingGroup] = None

    @classmethod
    def reaches(cls, receiver_nodes: Optional[Sequence], sender_node: Any) -> bool:
        """Receivers whose every process runs on another node than the sender's, where gloo runs."""
        return (bool(receiver_nodes) and sender_node not in set(receiver_nodes)
                and dist.is_available() and dist.is_gloo_available())

    # ---- the param_update stage ------------------------------------------------------------------
    def members(self, readers: dict[str, int]) -> None:
        """The receivers reading through this transport from the next version on (name -> processes):
        a change makes a new group."""
        if readers != self._members:
            self.epoch += 1
            self._members = dict(readers)
            self._epoch_members[self.epoch] = set(readers)
            for old in [e for e in self._epoch_members if e < self.epoch - REGIONS]:
                del self._epoch_members[old]

    def serves(self, name: str, handle: Any) -> bool:
        return name in self._epoch_members.get(getattr(handle, "epoch", None), ())

    async def open(self, version: int, timeout_s: float) -> GroupTicket:
        region = await self.ledger.acquire(version, timeout_s)
        return GroupTicket(region, self.epoch, 1 + sum(self._members.values()))

    def loaded(self, version: int, names: Sequence[str], keeping: Sequence[str]) -> None:
        self.ledger.loaded(version, names, keeping=())  # receivers serve their own copy, not the region

    def ended(self, version: int) -> None:
        self.ledger.ended(version)

    def retain(self, version: int) -> None:
        self.ledger.retain(version)

    def drop(self, name: str) -> None:
        self.ledger.drop(name)
        for members in self._epoch_members.values():
            members.discard(name)
        if name in self._members:  # the next version goes in a group without it
            self.members({n: p for n, p in self._members.items() if n != name})

    # ---- the trainer's send thread ---------------------------------------------------------------
    def write(self, ticket: GroupTicket, bucket: Bucket, pool=None, parts: int = 1) -> CollectiveBucket:
        if self._buffer is None:
            self._buffer = SharedBuffer(self.directory)
        shared = self._buffer.write(ticket.region, bucket, pool, parts)
        if self._group is None or self._group.epoch != ticket.epoch:
            if self._group is not None:
                self._group.close()
            self._group = SendingGroup(ticket.epoch, ticket.world)
        flat = self._buffer.flat(shared)
        tag = self._group.send(torch.from_numpy(flat))
        return CollectiveBucket(shared, ray.get_runtime_context().get_node_id() if ray.is_initialized() else "",
                                self._group.address, self._group.port, ticket.epoch, ticket.world, tag)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        if self._buffer is not None:
            self._buffer.close()

    # ---- the driver, at start ----------------------------------------------------------------------
    @staticmethod
    def room_bytes() -> Optional[int]:
        return shm_free_bytes()

    def check_room(self, model_bytes: int, bucket_bytes: int, versions_held: int, room_bytes: Optional[int]) -> None:
        """The sends read from a shared buffer of two regions on the trainer's node."""
        check_buffer_room("the collective weight transport's buffer", "", model_bytes, room_bytes)
