"""Data-parallel balance (async_rl/core/balance.py) and the loss scaling it relies on: the gradient
of a batch split over two ranks into token-budget micro-batches, rows balanced, equals the
gradient of the same batch in one piece on one rank (verl's real FSDP2 engine workers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.core.balance import balance_rows
from helpers.engine_workers import run_on_workers, skewed_batch


def rank_tokens(batch, dp: int) -> list[int]:
    per_row = batch.batch["attention_mask"].sum(-1)
    return [int(chunk.sum()) for chunk in per_row.chunk(dp)]


@pytest.mark.parametrize("dp", [2, 4])
def test_balance_evens_out_tokens_and_keeps_every_row(dp):
    batch = skewed_batch()
    before = rank_tokens(batch, dp)
    ids_before = sorted(map(tuple, batch.batch["input_ids"].tolist()))
    row_of_uid = dict(zip(batch.non_tensor_batch["uid"], map(tuple, batch.batch["input_ids"].tolist())))
    metrics = balance_rows(batch, dp)
    after = rank_tokens(batch, dp)
    assert sorted(map(tuple, batch.batch["input_ids"].tolist())) == ids_before  # a permutation of the rows
    assert sum(after) == sum(before)
    assert max(after) - min(after) < (max(before) - min(before)) / 4
    assert metrics["global_seqlen/balanced_max"] == max(after) and metrics["global_seqlen/balanced_min"] == min(after)
    assert metrics["global_seqlen/max"] == max(before)
    # non-tensor fields travel with their rows
    assert dict(zip(batch.non_tensor_batch["uid"], map(tuple, batch.batch["input_ids"].tolist()))) == row_of_uid
    assert list(batch.non_tensor_batch["uid"]) != [f"row{i}" for i in range(len(batch))]  # it did reorder


def test_with_verls_prefix_grouper_whole_groups_stay_on_one_rank_balanced_by_tokens():
    """`actor.use_prefix_grouper`: verl's group-level balance, the rows of a prompt group on one rank (here
    interleaved in the batch: verl's partitioner wants a group's rows side by side)."""
    batch = skewed_batch(rows=16)
    batch.non_tensor_batch["uid"] = np.array([f"g{i % 4}" for i in range(16)], dtype=object)
    tokens = dict(zip(range(16), batch.batch["attention_mask"].sum(-1).tolist()))
    ids_before = sorted(map(tuple, batch.batch["input_ids"].tolist()))
    balance_rows(batch, 2, by_group=True)
    assert sorted(map(tuple, batch.batch["input_ids"].tolist())) == ids_before  # a permutation of the rows
    ranks = [set(batch.non_tensor_batch["uid"][:8]), set(batch.non_tensor_batch["uid"][8:])]
    assert len(ranks[0]) == len(ranks[1]) == 2 and not ranks[0] & ranks[1]  # two whole groups a rank
    group_tokens = {f"g{g}": sum(tokens[r] for r in range(16) if r % 4 == g) for g in range(4)}
    best = min(abs(sum(group_tokens[g] for g in pair) * 2 - sum(group_tokens.values()))
               for pair in (("g0", "g1"), ("g0", "g2"), ("g0", "g3")))
    assert abs(sum(rank_tokens(batch, 2)) - 2 * rank_tokens(batch, 2)[1]) == best  # the best split of the groups
    with pytest.raises(ValueError, match="use_prefix_grouper: 4 prompt groups do not split evenly over 8"):
        balance_rows(batch, 8, by_group=True)


def test_balance_leaves_a_batch_it_cannot_split_evenly():
    batch = skewed_batch(rows=6)
    before = batch.batch["input_ids"].clone()
    assert balance_rows(batch, 4) == {} and torch.equal(batch.batch["input_ids"], before)
    assert balance_rows(batch, 1) == {}


GRADIENT_SCRIPT = """
from async_rl.core.balance import balance_rows
from omegaconf import open_dict

config = demo_config(**{"actor_rollout_ref.actor.ppo_mini_batch_size": 16, "actor_rollout_ref.rollout.n": 1,
                        "actor_rollout_ref.actor.optim.lr": 0.0})
ray.init(**ray_init_kwargs(config))
batch = demo_batch()
batch.batch["advantages"] = torch.randn(batch.batch["response_mask"].shape, generator=torch.Generator().manual_seed(1))

def grad_norm(world_size, budget, balance):
    cfg = config.copy()
    with open_dict(cfg):
        cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = budget
        cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu = budget
    group = make_worker_group(cfg, "actor", world_size, f"grad{world_size}_{budget}")
    data = batch.select_idxs(np.arange(len(batch)))
    data.batch["old_log_probs"] = engine_calls.compute_log_prob(group, data, 1.0)
    data.batch["rollout_log_probs"] = data.batch["old_log_probs"]
    balance = balance_rows(data, world_size) if balance else {}
    metrics = engine_calls.update_actor(group, data, cfg.actor_rollout_ref)
    return {"grad_norm": metrics["actor/grad_norm"], **balance}

done({"whole": grad_norm(1, 4096, False), "split": grad_norm(2, 40, True)})
"""


@pytest.mark.ray  # a Ray of its own
def test_gradient_with_balanced_micro_batches_equals_one_big_batch(demo_dir, tmp_path):
    result = run_on_workers(GRADIENT_SCRIPT, demo_dir, tmp_path)
    whole, split = result["whole"]["grad_norm"], result["split"]["grad_norm"]
    assert whole > 0
    assert split == pytest.approx(whole, rel=1e-5), result
    # two ranks, several micro-batches of at most 40 tokens each, rows balanced between the ranks
    assert result["split"]["global_seqlen/balanced_max"] < result["split"]["global_seqlen/max"]
