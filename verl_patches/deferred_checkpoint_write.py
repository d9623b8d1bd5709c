"""Deferred checkpoint write: verl's FSDP checkpoint manager with its `torch.save` calls captured.

verl's `FSDPCheckpointManager.save_checkpoint` does everything a checkpoint needs (the
sharded model, optimizer and extra-state dicts of each rank, the HF config and tokenizer,
`fsdp_config.json`, the barriers between ranks) and writes the big files with
`torch.save` while training waits. Inside `deferred_torch_save()` the manager runs
unchanged except that each `torch.save(obj, path)` is recorded instead of written: the
caller copies and writes the captured `(path, obj)` pairs from a background thread, to the
very files verl would have written (async_rl/training/checkpoint_writer.py).

The captured state dicts hold the live model and optimizer tensors, which verl's next
`optimizer_step` changes in place; `hold_optimizer_step(engine, wait)` makes the engine call
`wait()` (the copy is done) before each optimizer step.

Both are patches of verl, applied only in the pipeline's train workers: the first swaps the
module-level name `torch` of `verl.utils.checkpoint.fsdp_checkpoint_manager` for a proxy
whose `save` records (every other attribute is torch's), for the duration of one `with`
block; the second wraps one engine instance's `optimizer_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


class _TorchWithCapturedSave:
    """`torch`, except that `save(obj, path)` appends `(path, obj)` to `captured`."""

    def __init__(self, captured: list):
        self._captured = captured

    def save(self, obj, f, *args, **kwargs) -> None:
        if not isinstance(f, (str, bytes)) and not hasattr(f, "__fspath__"):
            raise TypeError(f"deferred torch.save takes a path, got {type(f).__name__}")
        self._captured.append((str(f), obj))

    def __getattr__(self, name: str):
        return getattr(torch, name)


@contextlib.contextmanager
def deferred_torch_save() -> Iterator[list]:
    """Within the block, verl's FSDP checkpoint manager records instead of writing; yields the
    list of `(path, obj)` it would have written, in order."""
    import verl.utils.checkpoint.fsdp_checkpoint_manager as manager_module

    captured: list = []
    original = manager_module.torch
    manager_module.torch = _TorchWithCapturedSave(captured)
    try:
        yield captured
    finally:
        manager_module.torch = original


def hold_optimizer_step(engine, wait: Callable[[], None]) -> None:
    """Make `engine.optimizer_step()` call `wait()` first (idempotent per engine)."""
    if getattr(engine, "_async_rl_holds_optimizer_step", False):
        return
    original = engine.optimizer_step

    def optimizer_step(*args, **kwargs):
        wait()
        return original(*args, **kwargs)

    engine.optimizer_step = optimizer_step
    engine._async_rl_holds_optimizer_step = True
