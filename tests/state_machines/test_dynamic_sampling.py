"""DAPO's dynamic sampling with refill (state_machines/dynamic_sampling.py): groups whose
rewards differ are pooled across generated batches into full training batches, oldest first,
and never older than eta at the step that trains them."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from async_rl.core.messages import Sample, ScoredBatch, TrainingBatch, build_batch
from async_rl.core.policy_clock import ClockRef
from async_rl.core.staleness import StalenessGate
from state_machines.dynamic_sampling import DynamicSamplingStage

GROUP = 2  # samples per prompt


def clock(eta: int) -> ClockRef:
    return ClockRef.in_process(StalenessGate(eta, steps_formed_after_generation=True))


def config(batch_groups=2, max_gen_batches=0):
    return OmegaConf.create({"data": {"train_batch_size": batch_groups},
                             "algorithm": {"filter_groups": {"enable": True, "max_num_gen_batches": max_gen_batches}}})


def generated(index: int, rewards: list[list[float]], version: int) -> ScoredBatch:
    """A scored generated batch: one group per entry of `rewards`, tokens from `version`."""
    samples, scores = [], []
    for g, group in enumerate(rewards):
        for reward in group:
            samples.append(Sample(uid=f"b{index}g{g}", prompt_ids=[1], response_ids=[2, 3], rollout_log_probs=[0.0, 0.0],
                                  token_versions=[version, version],
                                  non_tensor={"start_version": version, "index": np.int64(g),
                                              "reward_model": {"ground_truth": str(g), "style": "rule"}}))
            scores.append(reward)
    batch = build_batch(samples, max_prompt_length=2, max_response_length=4, pad_token_id=0)
    return ScoredBatch(index=index, scores=torch.tensor(scores, dtype=torch.float32), uids=np.asarray(batch.non_tensor_batch["uid"]),
                       batch_ref=batch)


def run(stage, *batches):
    async def main():
        return [await stage.process_data(b) for b in batches]

    return asyncio.run(main())


def test_draws_until_the_batch_is_full_of_groups_whose_rewards_differ():
    stage = DynamicSamplingStage(config=config(batch_groups=2), clock=clock(1), total_steps=2)
    assert isinstance(stage.clock(), float)  # StateMachine.clock, the timeline's alignment, not shadowed
    outs = run(stage,
               generated(0, [[1, 1], [0, 1]], version=0),  # one usable group: not full yet
               generated(1, [[0, 0], [1, 0]], version=0))  # a second one: the batch is full
    assert outs[0] is None and isinstance(outs[1], TrainingBatch)
    batch = outs[1].batch_ref
    assert outs[1].index == 0 and outs[1].scored.index == 0
    assert list(batch.non_tensor_batch["uid"]) == ["b0g1", "b0g1", "b1g1", "b1g1"]  # whole groups, in order
    assert outs[1].scored.scores.tolist() == [0, 1, 1, 0]
    assert outs[1].scored.metrics["async/dynamic_sampling/gen_batches"] == 2
    assert outs[1].scored.metrics["async/dynamic_sampling/kept_ratio"] == 0.5
    assert stage.step == 1


def test_oldest_groups_first_and_leftovers_carry_over():
    stage = DynamicSamplingStage(config=config(batch_groups=1), clock=clock(2), total_steps=3)
    first, second = run(stage, generated(0, [[0, 1], [1, 0]], version=0), generated(1, [[0, 1]], version=1))
    assert list(first.batch_ref.non_tensor_batch["uid"]) == ["b0g0", "b0g0"]
    # b0g1 (version 0) is older than b1g0 (version 1): it goes first; b1g0 waits
    assert list(second.batch_ref.non_tensor_batch["uid"]) == ["b0g1", "b0g1"]
    assert [g.uid for g in stage.pending] == ["b1g0"]


def test_groups_older_than_eta_at_their_step_are_dropped():
    stage = DynamicSamplingStage(config=config(batch_groups=1), clock=clock(1), total_steps=5)
    outs = run(stage,
               generated(0, [[0, 1], [0, 1], [0, 1]], version=0),  # step 0 takes one; two left over (version 0)
               generated(1, [[1, 1]], version=1),  # nothing new: step 1 takes a leftover (staleness 1 = eta)
               generated(2, [[0, 1]], version=2))  # step 2: the last version-0 leftover is 2 old: dropped
    assert [o.index for o in outs] == [0, 1, 2]
    assert outs[2].batch_ref.non_tensor_batch["uid"][0] == "b2g0"
    assert outs[2].scored.metrics["async/dynamic_sampling/dropped_stale_groups"] == 1
    for out in outs:  # no trained group exceeds eta
        assert out.index - int(out.batch_ref.batch["token_versions"].max()) <= 1


def test_too_many_generated_batches_fail_with_the_key_named():
    stage = DynamicSamplingStage(config=config(batch_groups=2, max_gen_batches=2), clock=clock(1), total_steps=1)
    with pytest.raises(RuntimeError, match="max_num_gen_batches=2"):
        run(stage, generated(0, [[1, 1], [0, 0]], version=0), generated(1, [[1, 1], [0, 1]], version=0))


def test_input_after_the_last_step_is_dropped():
    stage = DynamicSamplingStage(config=config(batch_groups=1), clock=clock(1), total_steps=1)
    outs = run(stage, generated(0, [[0, 1]], version=0), generated(1, [[0, 1]], version=1))
    assert isinstance(outs[0], TrainingBatch) and outs[1] is None


def test_a_stage_restored_from_a_checkpoint_forms_what_the_original_forms(tmp_path):
    """checkpoint_state(step): the pool right after batch step - 1 was formed and the generated batches
    drawn by then; a stage built from it, fed the batches after those, forms the same training batches."""
    from async_rl.checkpoints import load_plain
    from async_rl.core.plain_data import to_plain
    from async_rl.training.checkpoint_writer import write_durably

    inputs = [generated(0, [[0, 1], [1, 0], [0, 1]], version=0), generated(1, [[1, 1], [0, 1]], version=1),
              generated(2, [[0, 1]], version=2), generated(3, [[1, 0], [0, 1]], version=3)]
    original = DynamicSamplingStage(config=config(batch_groups=2), clock=clock(2), total_steps=4)
    outs = run(original, *inputs)
    formed = [o for o in outs if o is not None]
    assert [o.index for o in formed] == [0, 1, 2]
    generated_by_then, pool = original.checkpoint_state(1)  # a step-1 checkpoint: batch 0 trained
    assert generated_by_then == 1 and [g["uid"] for g in pool] == ["b0g2"]  # the leftover of batch 0
    write_durably(to_plain(pool), str(tmp_path / "state.pt"))  # as RunCheckpointer writes async_rl_state.pt
    pool = load_plain(str(tmp_path / "state.pt"))  # and a resume loads it: weights_only=True
    restored = DynamicSamplingStage(config=config(batch_groups=2), clock=clock(2), total_steps=4, start_step=1,
                                    generated_batches=generated_by_then, pool=pool)
    again = [o for o in run(restored, *inputs[generated_by_then:]) if o is not None]
    assert [o.index for o in again] == [1, 2]
    for a, b in zip(again, formed[1:]):
        assert list(a.batch_ref.non_tensor_batch["uid"]) == list(b.batch_ref.non_tensor_batch["uid"])
        assert a.scored.scores.tolist() == b.scored.scores.tolist()
        for column in ("reward_model", "index", "start_version"):  # the non-tensor columns, as generated
            assert a.batch_ref.non_tensor_batch[column].tolist() == b.batch_ref.non_tensor_batch[column].tolist()
            assert a.batch_ref.non_tensor_batch[column].dtype == b.batch_ref.non_tensor_batch[column].dtype
        assert a.batch_ref.batch["responses"].equal(b.batch_ref.batch["responses"])
    assert restored.generated == original.generated == 4
    with pytest.raises(KeyError, match="no dynamic-sampling snapshot for step 1"):
        original.checkpoint_state(1) if original.checkpoint_state(2) else None


def test_remax_baselines_follow_their_groups_into_the_training_batch():
    """Each kept row keeps its prompt's greedy-sample score (ReMax's `reward_baselines`), in the batch's order."""
    stage = DynamicSamplingStage(config=config(batch_groups=2), clock=clock(1), total_steps=2)
    first, second = generated(0, [[1, 1], [0, 1]], version=0), generated(1, [[0, 1]], version=0)
    first.baselines = torch.tensor([0.9, 0.9, 0.2, 0.2])
    second.baselines = torch.tensor([0.7, 0.7])
    out = run(stage, first, second)[1]
    assert list(out.batch_ref.non_tensor_batch["uid"]) == ["b0g1", "b0g1", "b1g0", "b1g0"]
    assert out.scored.baselines.tolist() == pytest.approx([0.2, 0.2, 0.7, 0.7])
    # the reward stage's metric, of the prompts this batch trains (b0g0's 0.9 filtered out)
    assert out.scored.metrics["async/remax/baseline_score/mean"] == pytest.approx(0.45)
