"""The same-node transport: each bucket written once into a shared-memory file its receivers map.

The sender (train rank 0) owns the files,
`<dir>/async_rl_weights-<pid>-<run id>-r<region>-b<bucket>-<bytes>` (dir: /dev/shm), one per
region and bucket, reused by every version written to that region so its pages stay touched. A receiver on the sender's Ray node maps each file once, read-only, and stages
zero-copy views of it (the dual buffer then serves them). Which region a version may be written to
is param_update/regions.py's handshake. The sender unlinks its files on `close` (the pipeline's
shutdown) and at exit; a run that died leaves files that the next sender on the node removes
(`sweep_stale`: files whose creating process is gone).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from functools import partial

import numpy as np
import ray

from param_update.buckets import Bucket

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "async_rl_weights-"


@dataclass(frozen=True)
class SharedBucket:
    """A bucket in shared memory: its first `nbytes` bytes of file `path` (on the sender's node), its
    slices back to back in order."""

    path: str
    nbytes: int


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


@ray.remote(num_cpus=0)
def copy_to_store(shared: SharedBucket, slices: list) -> list[np.ndarray]:
    """Run on the sender's node: a bucket read from its file and returned, so into Ray's object store, for
    a receiver on another node that the version's route did not plan for (a server restarted there).
    Not kept mapped: the file's memory goes once it is unlinked."""
    return _split(_map(shared.path, shared.nbytes, create=False), slices)


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
