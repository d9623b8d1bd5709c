"""Start-time checks of the weight sync: bucket sizes, object-store room and shared-memory room that
cannot work fail here, with the key to change, instead of as an out-of-memory error mid-run."""

from __future__ import annotations

import torch

from param_update.buckets import MB, BucketSizeError, check_bucket_sizes
from param_update.overlapped import SHM, STORE
from param_update.regions import REGIONS
from param_update.shared_buffer import SHM_DIR


def model_weight_bytes(model_path: str) -> int:
    """Bytes of one full copy of the model's weights (float32 unless the config says otherwise),
    from its config alone: the model is built on the meta device, tied weights counted once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def weight_links(placement, rollout_on_cpu: bool, logp_receives: bool) -> set[str]:
    """The links the weight sync will use under `placement` (async_rl/placement.py): SHM for a receiver
    whose devices are all on the node of train rank 0 (the sender), STORE for the others; verl's GPU
    replicas always take the object store (their checkpoint-engine path)."""
    per_node = placement.devices_per_node
    sender = placement.groups["train"].start // per_node
    receivers = (list(placement.replicas) if rollout_on_cpu else []) + (
        [placement.groups["logp"]] if logp_receives and "logp" in placement.groups else [])
    links = {SHM if r.nodes(per_node) == [sender] else STORE for r in receivers}
    return links | ({STORE} if not rollout_on_cpu else set())


def check_weight_sync(
    model_bytes: int, preduce_mb: float, consume_mb: float, dual_buffer: bool, object_store_bytes: int | None,
    retain_newest: bool = False, links: frozenset = frozenset({STORE}), shm_free_bytes: int | None = None,
) -> dict[str, int]:
    """Raise BucketSizeError when the sync cannot work; returns the bucket sizes in bytes.

    `links` (`weight_links`): through Ray's object store ("store"), staged versions live in the
    node's object store, shared by its receivers: two of them with the dual buffer (the serving
    one and the arriving one), one without; `retain_newest` (rollout servers may be restarted):
    the newest version stays there too, so two either way. Through shared memory ("shm"), the
    trainer's node holds the shared buffer's regions, a whole version each, in `shm_free_bytes`
    (free bytes of /dev/shm there; None: not checked).
    """
    held = 2 if dual_buffer or retain_newest else 1
    sizes = check_bucket_sizes(model_bytes, preduce_mb, consume_mb, object_store_bytes if STORE in links else None, held)
    if SHM in links and shm_free_bytes is not None and REGIONS * model_bytes > shm_free_bytes:
        raise BucketSizeError(
            f"the weight sync's shared buffer needs {REGIONS} x {model_bytes / MB:.0f} MB (a version being written, "
            f"one being served) in {SHM_DIR} on the trainer's node, which has {shm_free_bytes / MB:.0f} MB free: give "
            f"it more room (a container's --shm-size), or put the rollout on other nodes (trainer.use_nodes_ratios), "
            f"whose weights go through Ray's object store"
        )
    return sizes
