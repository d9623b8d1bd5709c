"""Start-time checks of the weight sync: bucket sizes and object-store room that cannot work
fail here, with the key to change, instead of as an out-of-memory error mid-run."""

from __future__ import annotations

import torch

from param_update.buckets import check_bucket_sizes


def model_weight_bytes(model_path: str) -> int:
    """Bytes of one full copy of the model's weights (float32 unless the config says otherwise),
    from its config alone: the model is built on the meta device, tied weights counted once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_weight_sync(
    model_bytes: int, preduce_mb: float, consume_mb: float, dual_buffer: bool, object_store_bytes: int | None,
    retain_newest: bool = False,
) -> dict[str, int]:
    """Raise BucketSizeError naming the key when the sync cannot work; returns the bucket sizes in bytes.

    Staged versions live in the node's object store, shared by its receivers: two of them
    with the dual buffer (the serving one and the arriving one), one without. `retain_newest`
    (rollout servers may be restarted): the newest version stays there too, so two either way.
    """
    held = 2 if dual_buffer or retain_newest else 1
    return check_bucket_sizes(model_bytes, preduce_mb, consume_mb, object_store_bytes, held)
