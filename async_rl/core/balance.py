"""Data-parallel balance: reorder a training batch so every rank gets about the same work.

The same as verl's trainer does with `trainer.balance_batch=True` (`RayPPOTrainer._balance_batch`,
a trainer method, hence rewritten here from verl's own pieces): Karmarkar-Karp partitions of
the per-row workload into `dp_size` groups of equal row count (verl's dispatch splits a batch
into equal contiguous chunks), each group laid out small-large-small. Inside a rank, verl's
engine cuts token-budget micro-batches (`use_dynamic_bsz`, `ppo_max_token_len_per_gpu`) with
the same micro-batch count on every rank, and its token-mean loss divides by the global token
count, so the gradient does not depend on the split.
"""

from __future__ import annotations

import torch


def balance_rows(batch, dp_size: int, prefix: str = "global_seqlen", by_group: bool = False) -> dict[str, float]:
    """Reorder `batch` (a DataProto, in place) for `dp_size` ranks; returns verl's balance metrics.

    `by_group` (verl's `actor.use_prefix_grouper`): the rows of one prompt group (`uid`) stay together on
    one rank, groups balanced by their tokens (verl's `get_group_balanced_partitions`, its rows in
    order); ValueError, as in verl, when the groups do not split evenly over the ranks."""
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions, log_seqlen_unbalance

    attention_mask = batch.batch["attention_mask"]
    seqlens = attention_mask.view(attention_mask.shape[0], -1).sum(-1)
    if dp_size <= 1 or len(seqlens) % dp_size:
        return {}
    if by_group:
        from verl.utils.seqlen_balancing import get_group_balanced_partitions

        uids = list(batch.non_tensor_batch["uid"])
        first = {uid: i for i, uid in reversed(list(enumerate(uids)))}
        order = sorted(range(len(uids)), key=lambda row: (first[uids[row]], row))  # a group's rows side by side
        groups = len(first)
        if groups % dp_size:
            raise ValueError(f"actor_rollout_ref.actor.use_prefix_grouper: {groups} prompt groups do not split "
                             f"evenly over {dp_size} data-parallel ranks (verl's rule: whole groups per rank)")
        parts = get_group_balanced_partitions([int(seqlens[r]) for r in order], [uids[r] for r in order], dp_size)
        partitions = [[order[i] for i in part] for part in parts]
    else:
        workloads = calculate_workload(seqlens)
        partitions = get_seqlen_balanced_partitions(workloads, k_partitions=dp_size, equal_size=True)
        for i, part in enumerate(partitions):
            part.sort(key=lambda row: (workloads[row], row))
            partitions[i] = part[::2] + part[1::2][::-1]
    batch.reorder(torch.tensor([row for part in partitions for row in part]))
    return {k: float(v) for k, v in log_seqlen_unbalance(seqlens.tolist(), partitions, prefix=prefix).items()}
