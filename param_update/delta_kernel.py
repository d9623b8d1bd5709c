"""The delta's two loops in C (delta_kernel.c): encode a tensor against its previous version (one pass, where
numpy's compare, `flatnonzero`, gaps and value gather take several), and write a delta's values into a
tensor in place.

The source is built with the machine's C compiler (`$CC`, else `cc`) at first use in a process, into
`$XDG_CACHE_HOME/async_rl` (else `~/.cache/async_rl`) under a name from its hash, so each machine builds
it once. `kernel()` is None where it cannot be built or loaded (logged once): param_update/delta.py then
runs the same format in numpy. Calls release the GIL.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("delta_kernel.c")
FLAGS = ("-O3", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120.0
GAP_LIMIT = (1 << 16) - 1  # the largest gap between two positions of a delta (uint16), as delta_kernel.c's
LEVELS = {"best": 0, "plain": 1, "avx2": 2, "avx512": 3}  # the compare loops delta_kernel.c has
_TOO_MANY = _OUT_OF_RANGE = -1
_UNSUPPORTED = -2
_ITEMSIZES = (2, 4)


class DeltaKernel:
    """delta_kernel.c's entry points over CPU tensors."""

    def __init__(self, library: ctypes.CDLL):
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._encode = library.async_rl_delta_encode
        self._encode.restype, self._encode.argtypes = i64, [ptr, ptr, i64, i64, ptr, ptr, i64, i64]
        self._write = library.async_rl_delta_write
        self._write.restype, self._write.argtypes = i64, [ptr, i64, i64, ptr, ptr, i64]
        self._level = library.async_rl_delta_level
        self._level.restype, self._level.argtypes = i64, []

    @property
    def level(self) -> str:
        """The best compare loop this CPU runs (a key of LEVELS)."""
        best = int(self._level())
        return next(name for name, value in LEVELS.items() if value == best)

    @staticmethod
    def handles(tensor: torch.Tensor) -> bool:
        """The kernel takes this tensor: on the CPU, contiguous, of 2- or 4-byte elements."""
        return tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.element_size() in _ITEMSIZES

    def encode(self, new: torch.Tensor, old: torch.Tensor, cap: int,
               level: str = "best") -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(gaps as uint16 in int16 bits, values of `new` there) of the positions where `new` and `old` (same
        dtype and shape, `handles`) differ bit for bit, bridged as delta.py's `wire_positions`; None when there
        are more than `cap`. `level`: the compare loop (LEVELS; for tests)."""
        if not (self.handles(new) and self.handles(old) and old.dtype == new.dtype and old.shape == new.shape):
            raise ValueError(f"the delta kernel diffs two contiguous CPU tensors of one dtype and shape, not "
                             f"{new.dtype} {tuple(new.shape)} against {old.dtype} {tuple(old.shape)}")
        n = new.numel()
        slots = max(0, min(cap, n + n // GAP_LIMIT + 1))
        gaps = torch.empty(slots, dtype=torch.int16)
        values = torch.empty(slots, dtype=new.dtype)
        count = self._encode(new.data_ptr(), old.data_ptr(), n, new.element_size(), gaps.data_ptr(),
                             values.data_ptr(), slots, LEVELS[level])
        if count == _TOO_MANY:
            return None
        if count == _UNSUPPORTED:
            raise ValueError(f"the delta kernel takes 2- or 4-byte elements at a level this CPU runs "
                             f"(best: {self.level}), not {new.dtype} at {level!r}")
        return gaps[:count].clone(), values[:count].clone()

    def write(self, out: torch.Tensor, gaps: torch.Tensor, values: torch.Tensor) -> None:
        """`values` written into `out` (`handles`) at the positions `gaps` stand for. ValueError when a position
        falls past its end."""
        if (not self.handles(out) or gaps.dtype != torch.int16 or values.dtype != out.dtype
                or gaps.numel() != values.numel()):
            raise ValueError(f"a delta of {gaps.numel()} {gaps.dtype} gaps and {values.numel()} {values.dtype} values "
                             f"for a {out.dtype} tensor on {out.device} (the kernel writes contiguous CPU tensors)")
        gaps, values = gaps.contiguous(), values.contiguous()
        result = self._write(out.data_ptr(), out.numel(), out.element_size(), gaps.data_ptr(), values.data_ptr(),
                             gaps.numel())
        if result == _OUT_OF_RANGE:
            raise ValueError(f"a changed position past the end of a tensor of {out.numel()} values")
        if result == _UNSUPPORTED:
            raise ValueError(f"the delta kernel takes 2- or 4-byte elements, not {out.dtype}")


_lock = threading.Lock()
_loaded: dict[str, Optional[DeltaKernel]] = {}


def kernel() -> Optional[DeltaKernel]:
    """This process's kernel, built or found in the cache at the first call; None where it cannot be."""
    with _lock:
        if "kernel" not in _loaded:
            try:
                _loaded["kernel"] = DeltaKernel(ctypes.CDLL(str(build())))
            except (OSError, subprocess.SubprocessError) as exc:
                logger.warning("delta sync: the C kernel could not be built (%s); the delta runs in numpy", exc)
                _loaded["kernel"] = None
        return _loaded["kernel"]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "async_rl"


def build(directory: Optional[Path] = None) -> Path:
    """The shared library of SOURCE in `directory` (default `cache_dir()`), compiled unless already there.
    OSError or subprocess.SubprocessError when the compiler is missing or fails."""
    compiler = os.environ.get("CC") or "cc"
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + repr((compiler, FLAGS, platform.machine())).encode()).hexdigest()[:16]
    directory = Path(directory or cache_dir())
    target = directory / f"delta_kernel-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)  # built aside, then renamed: builds may race
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, "-o", partial, str(SOURCE)], capture_output=True, text=True,
                                timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise subprocess.SubprocessError(f"{compiler} exited {result.returncode}: {result.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target
