"""The dataloader stage draws verl's batches and resumes from a saved position exactly: the
batches after a resume are the ones the uninterrupted stage would have drawn, across epochs."""

from __future__ import annotations

import asyncio

import pytest

from async_rl.checkpoints import dataloader_workers_in_state
from helpers.lineage import compose_ppo


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory):
    from async_rl.demo import prepare

    root = tmp_path_factory.mktemp("small_demo")
    prepare(root, seed=1, train_size=70, val_size=8)  # 2 batches of 32 per epoch (the rest dropped, as verl does)
    return root


def emit(stage, first: int, count: int) -> list[tuple[int, list]]:
    """(index, each prompt's chat messages) of `count` batches from `first`."""
    async def main():
        return [await stage.process_data(i) for i in range(first, first + count)]

    return [(b.index, [row["raw_prompt"] for row in b.non_tensor]) for b in asyncio.run(main())]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_stage_draws_what_the_uninterrupted_one_drew(small_demo, workers):
    from transformers import AutoTokenizer

    from async_rl.demo import demo_overrides
    from state_machines.dataloader import DataloaderStage

    config = compose_ppo(demo_overrides(small_demo, extra={"data.dataloader_num_workers": workers}))
    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    whole = DataloaderStage(config=config, tokenizer=tokenizer, total_batches=None)
    batches = emit(whole, 0, 5)  # epochs of 2 batches: two epoch boundaries
    assert [len(p) for _, p in batches] == [32] * 5
    assert batches[0][1] != batches[2][1]  # a new epoch is a new shuffle
    for k in (1, 2, 4, 5):
        state = whole.state_before(k)
        assert dataloader_workers_in_state(state) == workers
        resumed = DataloaderStage(config=config, tokenizer=tokenizer, total_batches=None, first_index=k, resume_state=state)
        assert emit(resumed, k, 5 - k) == batches[k:], k
    with pytest.raises(KeyError, match="no dataloader state kept for batch 1"):
        whole.state_before(1)  # taken by a checkpoint of a later step: dropped
