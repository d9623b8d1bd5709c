"""One train rank's checkpoint writes, beside training.

`snapshot(save, step)` runs verl's own `save_checkpoint` (FSDP checkpoint manager: sharded
model, optimizer, lr scheduler + RNG, HF config, the barriers between ranks) with its
`torch.save` calls captured (verl_patches/deferred_checkpoint_write.py): training waits
only for that. A background thread then copies the captured tensors to host memory and
writes them to the files verl names. The copy must finish before the live tensors change:
the train worker holds the engine's next `optimizer_step` until `wait_copied()` returns,
so the forward and backward of the next step run beside the copy. Each file is written to
`<name>.tmp`, flushed to disk and renamed, so a file that exists is complete. `wait()`
joins the thread and raises its error, if any. One write is in flight at a time.

On an accelerator the host copy is a device-to-host copy issued on the default stream: it
is ordered after the optimizer step that produced the state and before the next one.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Optional

import torch
from torch.utils._pytree import tree_map_only

from async_rl.core.fault_points import hold_at
from verl_patches.deferred_checkpoint_write import deferred_torch_save


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory; a DTensor stays a DTensor (same mesh and placements)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local = tensor.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=tensor.stride())
    return tensor.detach().to("cpu", copy=True)


def host_snapshot(obj):
    """`obj` (nested dicts / lists / tuples) with every tensor replaced by its host copy."""
    return tree_map_only(torch.Tensor, host_copy, obj)


def write_durably(obj, path: str) -> int:
    """`torch.save(obj, path)` through `<path>.tmp`, fsync'ed and renamed; returns bytes written."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return os.path.getsize(path)


class CheckpointWriter:
    """Captures now; copies, then writes, in a background thread."""

    def __init__(self):
        self._thread: Optional[threading.Thread] = None
        self._copied = threading.Event()
        self._copied.set()
        self._error: Optional[BaseException] = None
        self._copy_error: Optional[BaseException] = None
        self._result: dict = {}
        self.step: Optional[int] = None

    def snapshot(self, save: Callable[[], None], step: int) -> dict[str, float]:
        """Run `save` (verl's save_checkpoint) capturing its writes; {"snapshot_s": seconds training waited}."""
        self.wait()
        start = time.perf_counter()
        with deferred_torch_save() as captured:
            save()
        self.step, self._error, self._copy_error, self._result = step, None, None, {}
        self._copied = threading.Event()
        self._thread = threading.Thread(target=self._copy_and_write, args=(captured, step), name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()
        return {"snapshot_s": time.perf_counter() - start}

    def _copy_and_write(self, captured: list, step: int) -> None:
        start = time.perf_counter()
        try:
            hold_at("checkpoint_copy", step)
            copies = [(path, host_snapshot(obj)) for path, obj in captured]
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() and wait_copied()
            self._error = self._copy_error = exc
            return
        finally:
            self._copied.set()
        copy_s, written = time.perf_counter() - start, 0
        try:
            hold_at("checkpoint_write", step)
            for path, obj in copies:
                written += write_durably(obj, path)
            self._result = {"copy_s": copy_s, "write_s": time.perf_counter() - start, "bytes": float(written)}
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._error = exc

    def wait_copied(self) -> None:
        """Return once the captured state is copied (the live tensors may change); raise if the copy failed."""
        self._copied.wait()
        if self._copy_error is not None:
            raise RuntimeError(f"copying checkpoint {self.step} failed: {self._copy_error!r}") from self._copy_error

    def wait(self, timeout_s: Optional[float] = None) -> dict[str, float]:
        """Block until the write in flight (if any) is on disk; {"copy_s", "write_s", "bytes"} of it.
        Raises TimeoutError after `timeout_s`, or the writer's error."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint {self.step}: the write did not finish within {timeout_s:g} s")
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing checkpoint {self.step} failed: {type(error).__name__}: {error}") from error
        return dict(self._result)
