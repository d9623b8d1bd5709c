"""The same-node transport ("shm"): each bucket written once into a shared-memory file its
receivers map.

The sender (train rank 0) owns the files,
`<dir>/async_rl_weights-<pid>-<run id>-r<region>-b<bucket>-<bytes>` (dir: /dev/shm), one per
region and bucket, reused by every version written to that region so its pages stay touched. A
receiver on the sender's Ray node maps each file once, read-only, and stages zero-copy views of
it (the dual buffer then serves them). The sender unlinks its files on `close` (the pipeline's
shutdown) and at exit; a run that died leaves files that the next sender on the node removes
(`sweep_stale`: files whose creating process is gone).

Regions: a region is written again only once nothing reads or serves it (`RegionLedger`). The
buffer has two; the param_update stage hands one out per version (`open`, the sender's first
question about a version) and keeps, per region, who uses the version written there:

- the sync of that version, from `open` until it is loaded everywhere or dropped (`loaded`,
  `ended`): receivers read it meanwhile;
- every same-node receiver serving it (the dual buffer swaps the staged views in), until that
  receiver loads a later version (`loaded`) or is lost (`drop`); a receiver that copies on load
  never holds a region past its sync;
- the newest version kept for restarted servers (`retain`).

So with the dual buffer version v gets a region once every receiver has loaded v - 1 (v - 2 is
released everywhere); a failed sync frees its region at once, and v - 1 keeps serving from the other.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import tempfile
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Optional

import numpy as np

from async_rl.api.weights import Bucket, WeightTransport, register_transport
from async_rl.core.config import MB
from async_rl.core.errors import BucketSizeError, WeightSyncError

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "async_rl_weights-"


@dataclass(frozen=True)
class SharedBucket:
    """A bucket in shared memory: its first `nbytes` bytes of file `path` (on the sender's node), its
    slices back to back in order."""

    path: str
    nbytes: int

    def read(self, slices: list) -> list:
        """The bucket's arrays (one per TensorSlice) as read-only, zero-copy views of its file, mapped once
        per process. Valid only on the sender's node."""
        return shared_arrays(self, slices)


class SharedBuffer:
    """The sender's shared-memory files; `write` copies a bucket into its region's file (one copy).

    Args:
        directory: where the files go (tmpfs, so they are memory).
    """

    def __init__(self, directory: str = SHM_DIR):
        sweep_stale(directory)
        self.prefix = os.path.join(directory, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self._files: dict[str, np.ndarray] = {}  # path -> writable mapping
        self._unlink = weakref.finalize(self, _unlink_all, self._files)

    def write(self, region: int, bucket: Bucket, pool=None, parts: int = 1) -> SharedBucket:
        """Copy `bucket`'s arrays back to back into its file in `region`, as `parts` pieces of about equal
        bytes copied at once on `pool` (a ThreadPoolExecutor; numpy's copy releases the GIL)."""
        path = f"{self.prefix}-r{region}-b{bucket.index}-{bucket.nbytes}"
        if path not in self._files:
            self._files[path] = _map(path, bucket.nbytes, create=True)
        runs = byte_runs(bucket.data, parts)
        if pool is None or len(runs) < 2:
            for run in runs:
                _copy_run(self._files[path], run)
        else:
            list(pool.map(partial(_copy_run, self._files[path]), runs))
        return SharedBucket(path, bucket.nbytes)

    def flat(self, shared: SharedBucket) -> np.ndarray:
        """The bytes of a bucket this buffer wrote, as its own writable mapping (uint8, no copy)."""
        return self._files[shared.path][: shared.nbytes] if shared.nbytes else np.empty(0, dtype=np.uint8)

    def close(self) -> None:
        """Unlink every file (receivers' mappings stay valid until they drop them)."""
        self._unlink()


def byte_runs(arrays: list[np.ndarray], parts: int) -> list[list[tuple[int, np.ndarray]]]:
    """The arrays' bytes, concatenated, as at most `parts` runs of about equal bytes: each run a list of
    (offset in the concatenation, uint8 piece of one array)."""
    total = sum(a.nbytes for a in arrays)
    step = max(1, -(-total // max(parts, 1)))
    runs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(-(-total // step))]
    offset = 0
    for a in arrays:
        start = 0
        while start < len(a):
            run = (offset + start) // step
            take = min(len(a) - start, (run + 1) * step - offset - start)
            runs[run].append((offset + start, a[start : start + take]))
            start += take
        offset += len(a)
    return runs


def _copy_run(dst: np.ndarray, run: list[tuple[int, np.ndarray]]) -> None:
    for offset, piece in run:
        np.copyto(dst[offset : offset + len(piece)], piece)


_mapped: dict[str, np.ndarray] = {}  # a receiver's read-only mappings, by path


def shared_arrays(shared: SharedBucket, slices: list) -> list[np.ndarray]:
    """A bucket's arrays (one per TensorSlice) as read-only, zero-copy views of its file, mapped once per
    process. Valid only on the sender's node."""
    flat = _mapped.get(shared.path)
    if flat is None:
        flat = _mapped.setdefault(shared.path, _map(shared.path, shared.nbytes, create=False))
    return _split(flat, slices)


def _split(flat: np.ndarray, slices: list) -> list[np.ndarray]:
    ends = np.cumsum([0] + [s.nbytes for s in slices])
    return [flat[start:end] for start, end in zip(ends[:-1], ends[1:])]


def shm_free_bytes(directory: str = SHM_DIR) -> int:
    """Bytes free in `directory` (the tmpfs the files go to), on this node."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink the files of runs whose sender process is gone (a crash, a kill); returns their paths."""
    removed = []
    for name in os.listdir(directory):
        pid = name[len(PREFIX) :].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if pid.isdigit() and not _alive(int(pid)):
            _remove(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _map(path: str, nbytes: int, create: bool) -> np.ndarray:
    """`nbytes` of file `path` as a uint8 array: created and writable (its memory reserved now, so a full
    tmpfs fails here rather than as SIGBUS mid-copy), or existing and read-only."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL if create else os.O_RDONLY, 0o600)
    try:
        if create:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                _remove(path)
                free = shm_free_bytes(os.path.dirname(path))
                raise OSError(exc.errno, f"no room for {nbytes / 2**20:.0f} MB of weights in {os.path.dirname(path)} "
                                         f"({free / 2**20:.0f} MB free): {path}") from exc
        view = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ | (mmap.PROT_WRITE if create else 0))
    finally:
        os.close(fd)
    return np.frombuffer(view, dtype=np.uint8)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_all(files: dict[str, np.ndarray]) -> None:
    for path in list(files):
        _remove(path)
    files.clear()


SYNC = "<sync>"  # the version's own sync holds its region
RETAINED = "<retained>"  # the newest version, kept for restarted servers

REGIONS = 2  # serving and arriving


class RegionLedger:
    """Which version each region holds and who uses it (receiver names, SYNC, RETAINED). One event loop."""

    def __init__(self, regions: int = REGIONS):
        self.versions: list[Optional[int]] = [None] * regions
        self.users: list[set[str]] = [set() for _ in range(regions)]
        self._freed = asyncio.Event()

    def region_of(self, version: int) -> Optional[int]:
        return self.versions.index(version) if version in self.versions else None

    async def acquire(self, version: int, timeout_s: float) -> int:
        """A region nobody uses, now holding `version` (waits up to `timeout_s` s for one to be freed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not (free := [r for r, users in enumerate(self.users) if not users]):
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise WeightSyncError(f"no shared-memory region free for version {version} after {timeout_s:g} s: "
                                      f"{self.describe()}") from None
        self.versions[free[0]], self.users[free[0]] = version, {SYNC}
        return free[0]

    def loaded(self, version: int, names: Iterable[str], keeping: Iterable[str]) -> None:
        """`names` loaded `version` (its sync is over); those in `keeping` serve it from its region."""
        for name in names:
            self._remove(name)
        region = self.region_of(version)
        if region is not None:
            self.users[region].update(keeping)
        self.ended(version)

    def ended(self, version: int) -> None:
        """The sync of `version` is over (loaded, or dropped everywhere)."""
        region = self.region_of(version)
        if region is not None:
            self.users[region].discard(SYNC)
            self._freed.set()

    def retain(self, version: int) -> None:
        """Keep `version`'s region intact (restarted servers load from it) instead of the previous one's."""
        self._remove(RETAINED)
        region = self.region_of(version)
        if region is not None:
            self.users[region].add(RETAINED)

    def drop(self, name: str) -> None:
        """Receiver `name` is gone: it serves nothing."""
        self._remove(name)

    def _remove(self, user: str) -> None:
        for users in self.users:
            users.discard(user)
        self._freed.set()

    def describe(self) -> str:
        return "; ".join(f"region {r}: version {v}, used by {sorted(u)}"
                         for r, (v, u) in enumerate(zip(self.versions, self.users)))


@register_transport
class SharedMemory(WeightTransport):
    """Shared memory on the sender's Ray node, for receivers whose every process runs there.

    Buckets only here are announced with the version's end; each receiver then registers the
    whole version in one call (views, no copy), so no round trip competes with the copy.
    """

    name: ClassVar[str] = "shm"
    rank: ClassVar[int] = 0
    announces_each_bucket: ClassVar[bool] = False

    def __init__(self, directory: str = SHM_DIR):
        self.directory = directory
        self.ledger = RegionLedger()  # the param_update stage's
        self._buffer: Optional[SharedBuffer] = None  # the sender's; files are made at the first write

    @classmethod
    def reaches(cls, receiver_nodes: Optional[Sequence], sender_node: Any) -> bool:
        return bool(receiver_nodes) and set(receiver_nodes) == {sender_node}

    async def open(self, version: int, timeout_s: float) -> int:
        """A region nobody uses, now holding `version`."""
        return await self.ledger.acquire(version, timeout_s)

    def loaded(self, version: int, names: Sequence[str], keeping: Sequence[str]) -> None:
        self.ledger.loaded(version, names, keeping)

    def ended(self, version: int) -> None:
        self.ledger.ended(version)

    def retain(self, version: int) -> None:
        self.ledger.retain(version)

    def drop(self, name: str) -> None:
        self.ledger.drop(name)

    def write(self, ticket: int, bucket: Bucket, pool=None, parts: int = 1) -> SharedBucket:
        if self._buffer is None:
            self._buffer = SharedBuffer(self.directory)
        return self._buffer.write(ticket, bucket, pool, parts)

    def close(self) -> None:
        if self._buffer is not None:
            self._buffer.close()

    @staticmethod
    def room_bytes() -> Optional[int]:
        return shm_free_bytes()

    def check_room(self, model_bytes: int, bucket_bytes: int, versions_held: int, room_bytes: Optional[int]) -> None:
        """The regions (a version being written, one being served) must fit the node's tmpfs."""
        check_buffer_room("the weight sync's shared buffer", " (a version being written, one being served)",
                          model_bytes, room_bytes, ", or put the rollout on other nodes (trainer.use_nodes_ratios), "
                          "whose weights go through Ray's object store")


def check_buffer_room(owner: str, regions: str, model_bytes: int, room_bytes: Optional[int], advice: str = "") -> None:
    """A shared buffer of REGIONS x `model_bytes` must fit the trainer's node's tmpfs (`room_bytes`, None: not
    known, not checked); BucketSizeError names `owner`, what its regions hold and `advice` beyond more room."""
    if room_bytes is not None and REGIONS * model_bytes > room_bytes:
        raise BucketSizeError(
            f"{owner} needs {REGIONS} x {model_bytes / MB:.0f} MB{regions} in {SHM_DIR} on the trainer's node, "
            f"which has {room_bytes / MB:.0f} MB free: give it more room (a container's --shm-size){advice}"
        )
