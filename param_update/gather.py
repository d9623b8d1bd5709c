"""gather: full tensors from the trainer's FSDP shards (the only part that blocks training)."""

from __future__ import annotations

import ray


def gather_full_weights(train_worker_group) -> list:
    """Collective gather on every train rank; rank 0's full HF-named CPU tensors."""
    per_rank = train_worker_group.get_full_weights()
    named = per_rank[0]
    if not named:
        raise RuntimeError("gather returned no tensors from train rank 0")
    return named


def publish(named_tensors) -> "ray.ObjectRef":
    """send: put the full tensors into Ray's object store once (off the accelerator)."""
    return ray.put(named_tensors)
