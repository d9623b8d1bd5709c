"""Weights-only checkpoint loads: verl's FSDP checkpoint manager reads its files with `weights_only=True`.

verl 0.9.1's `FSDPCheckpointManager.load_checkpoint` reads each rank's model, optimizer and
extra-state files with `torch.load(path, weights_only=False)`: unpickling, which runs whatever
code a file names. Their payloads need none of it: tensors and DTensors, the optimizer's numbers
and lists, the lr scheduler's state, and the RNG states (Python's tuple, torch's byte tensors,
numpy's `('MT19937', uint32 array, ...)`). The patch swaps the module-level name `torch` of
`verl.utils.checkpoint.fsdp_checkpoint_manager` for a proxy whose `load` runs with
`weights_only=True`, numpy's arrays of numbers allowed (`NUMPY_GLOBALS`); every other attribute is
torch's. Applied in the pipeline's train and critic workers; verl's own trainer keeps verl's load.
"""

from __future__ import annotations

import numpy as np
import torch

# what a numpy array of numbers pickles as (numpy's RNG state holds one): its reconstruction and dtypes
NUMPY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype,
                 *(type(np.dtype(code)) for code in "?bhilqBHILQefdg")]


class _TorchWithWeightsOnlyLoad:
    """`torch`, except that `load` reads tensors and plain data only (`weights_only=True`)."""

    def load(self, f, *args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(NUMPY_GLOBALS):
            return torch.load(f, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch, name)


def patch_weights_only_checkpoint_load() -> None:
    """Make verl's FSDP checkpoint manager load with `weights_only=True` in this process (idempotent)."""
    import verl.utils.checkpoint.fsdp_checkpoint_manager as manager_module

    if not isinstance(manager_module.torch, _TorchWithWeightsOnlyLoad):
        manager_module.torch = _TorchWithWeightsOnlyLoad()
