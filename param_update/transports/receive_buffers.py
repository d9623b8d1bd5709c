"""A receiving process's buffers for buckets that arrive over a link (param_update/transports/collective.py).

A received bucket lives in memory of the receiving process, and the weights a receiver serves are views
of it (the dual buffer swaps them in, zero copy). When a later version is loaded, the version that stops
serving would be freed inside the load's critical section, and freeing about 2 GB holds the GIL for
about 0.14 s on this machine: the engine's decoding stalls for that long. `ReceiveBuffers` keeps the
memory instead and receives later buckets into it once nothing views it any more, so a load frees
nothing and a receive writes into pages already mapped.
"""

from __future__ import annotations

import sys
import threading

import numpy as np


class ReceiveBuffers:
    """Byte buffers handed out for receives and taken back once no view of them is left.

    A buffer is free when only the pool refers to it: every view (numpy slices, tensors made from them)
    holds a reference to it, so the weights a receiver serves keep theirs in use. `take(n)` returns a
    uint8 array of n bytes, a view of the smallest free buffer that holds n (a new buffer if none does).
    A new buffer replaces the free ones smaller than it, so the pool holds at most the buffers in use plus
    one free buffer per bucket size still in use.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._buffers: list[np.ndarray] = []
        self._unreferenced = _refcounts([np.empty(1, dtype=np.uint8)])[0]  # a buffer only a list holds

    def take(self, nbytes: int) -> np.ndarray:
        """n bytes to receive into (contents undefined), in use until the caller drops every view of them."""
        with self._lock:
            free = [c <= self._unreferenced for c in _refcounts(self._buffers)]
            fits = [buf for buf, is_free in zip(self._buffers, free) if is_free and buf.nbytes >= nbytes]
            if fits:
                return min(fits, key=lambda buf: buf.nbytes)[:nbytes]
            self._buffers = [buf for buf, is_free in zip(self._buffers, free) if buf.nbytes >= nbytes or not is_free]
            self._buffers.append(np.empty(nbytes, dtype=np.uint8))
            return self._buffers[-1][:nbytes]

    @property
    def held_bytes(self) -> int:
        """Bytes of every buffer the pool keeps, in use or free."""
        with self._lock:
            return sum(buf.nbytes for buf in self._buffers)


def _refcounts(buffers: list[np.ndarray]) -> list[int]:
    """Each buffer's reference count, seen from here (the same for two buffers referred to alike)."""
    return [sys.getrefcount(buf) for buf in buffers]
