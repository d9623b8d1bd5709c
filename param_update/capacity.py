"""Start-time checks of the weight sync: bucket sizes, and the room of every transport the sync will
use, that cannot work fail here, with the key to change, instead of as an out-of-memory error mid-run."""

from __future__ import annotations

import torch

import param_update.transports  # noqa: F401 - registers the built-in transports
from async_rl.api.weights import link_of, transport_class
from async_rl.core.model_class import auto_model_class
from param_update.buckets import check_bucket_sizes


def model_weight_bytes(model_path: str) -> int:
    """Bytes of one full copy of the model's weights (float32 unless the config says otherwise),
    from its config alone: the model is built on the meta device, tied weights counted once."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def planned_links(placement, replicas_read_same_node: bool, logp_receives: bool) -> set[str]:
    """The links the weight sync will use under `placement` (async_rl/core/placement.py), by node
    index: the sender is train rank 0. `replicas_read_same_node`: the rollout backend's receivers
    tell their nodes (else their node is unknown: verl's replicas read through their workers)."""
    per_node = placement.devices_per_node
    sender = placement.groups["train"].start // per_node
    nodes = [r.nodes(per_node) if replicas_read_same_node else None for r in placement.replicas]
    if logp_receives and "logp" in placement.groups:
        nodes.append(placement.groups["logp"].nodes(per_node))
    return {link_of(n, sender) for n in nodes}


def check_weight_sync(model_bytes: int, preduce_mb: float, consume_mb: float, versions_held: int,
                      links: set[str], rooms: dict) -> dict[str, int]:
    """Raise BucketSizeError when the sync cannot work; returns the bucket sizes in bytes.

    `versions_held`: versions a receiver keeps staged at once (async_rl/build.py `versions_held`: 2 with the
    dual buffer, with restartable servers, which keep the newest, or with deltas into verl's replicas, else 1);
    `links`: the transports in use (`planned_links`); `rooms`: transport name -> its room in bytes (None: not
    checked).
    """
    sizes = check_bucket_sizes(model_bytes, preduce_mb, consume_mb)
    for name in sorted(links):
        transport_class(name)().check_room(model_bytes, sizes["preduce"], versions_held, rooms.get(name))
    return sizes
