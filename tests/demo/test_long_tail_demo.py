"""The long-tail demo (async_rl/demo/long_tail.py): the seeded draw of response lengths, what `prepare` writes
for it at a chosen model size, and its verl agent loop asking for exactly each row's length (run by the
generate stage on a scripted server, the rows read by verl's dataset)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pandas as pd
import pytest
import torch

from async_rl.demo import long_tail, task
from helpers.lineage import compose_ppo
from helpers.scripted_server import ScriptedServer

TRAIN_SIZE, VAL_SIZE, SEED = 40, 8, 3


def test_the_draw_is_long_tailed_cut_at_the_cap_and_the_same_for_a_seed():
    lengths = long_tail.draw_response_tokens(0, task.DEFAULT_TRAIN_SIZE + task.DEFAULT_VAL_SIZE)
    assert lengths.dtype.kind == "i" and lengths.max() == long_tail.LONG_RESPONSE_TOKENS == 256
    assert lengths.min() >= long_tail.MIN_RESPONSE_TOKENS
    assert lengths.mean() <= long_tail.LONG_RESPONSE_TOKENS / 4  # a quarter of the maximum or less
    assert 0.005 <= np.mean(lengths == 256) <= 0.05  # the tail a synchronous step waits for
    assert np.median(lengths) < lengths.mean() / 1.3  # skewed: most responses short
    assert np.array_equal(lengths, long_tail.draw_response_tokens(0, len(lengths)))
    assert not np.array_equal(lengths, long_tail.draw_response_tokens(1, len(lengths)))


def test_every_model_size_has_one_attention_head_and_the_larger_ones_hold_the_long_task():
    assert task.MODEL_KWARGS == task.MODEL_SIZES["tiny"] and task.MODEL_KWARGS["hidden_size"] == 64
    for name, kwargs in task.MODEL_SIZES.items():
        assert kwargs["num_attention_heads"] == kwargs["num_key_value_heads"] == 1, name
    assert [s for s in task.MODEL_SIZES if task.covers_long_task(s)] == ["small", "medium"]
    assert task.LONG_CONTEXT == task.MAX_PROMPT_LENGTH + 256
    with pytest.raises(ValueError, match="tiny, small, medium"):
        task.model_kwargs("huge")


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("long_demo")
    task.prepare(root, seed=SEED, train_size=TRAIN_SIZE, val_size=VAL_SIZE, model_size="small")
    return root


def test_prepare_writes_the_chosen_size_and_the_long_tasks_rows_with_their_lengths(small_demo):
    config = json.loads((small_demo / "model" / "config.json").read_text())
    small = task.MODEL_SIZES["small"]
    assert {k: config[k] for k in small} == small
    assert json.loads((small_demo / "reward_model" / "config.json").read_text())["hidden_size"] == small["hidden_size"]
    copy_rows = pd.read_parquet(small_demo / "data" / "train.parquet")
    lengths = long_tail.draw_response_tokens(SEED, TRAIN_SIZE + VAL_SIZE)
    for split, rows, expected in (("train", pd.read_parquet(small_demo / "data" / "long_train.parquet"), lengths[:TRAIN_SIZE]),
                                  ("test", pd.read_parquet(small_demo / "data" / "long_val.parquet"), lengths[TRAIN_SIZE:])):
        assert [info["response_tokens"] for info in rows["extra_info"]] == expected.tolist()
        assert {info["split"] for info in rows["extra_info"]} == {split}
        assert set(rows["data_source"]) == {long_tail.DATA_SOURCE}
    long_train = pd.read_parquet(small_demo / "data" / "long_train.parquet")
    assert list(long_train["reward_model"]) == list(copy_rows["reward_model"])  # the copy task's prompts and truth


def test_the_long_tasks_overrides_name_its_agent_loop_and_256_tokens(small_demo):
    from async_rl.rollout.agent_loop_files import check_agent_loops

    overrides = (small_demo / "overrides_long.txt").read_text().split()
    assert overrides == task.demo_overrides(small_demo, long=True)
    config = compose_ppo(overrides)
    rollout = config.actor_rollout_ref.rollout
    assert rollout.response_length == 256 and config.data.max_response_length == 256
    assert rollout.agent.default_agent_loop == long_tail.LONG_AGENT == "long_tail"
    assert config.data.train_files.endswith("long_train.parquet") and config.data.val_files.endswith("long_val.parquet")
    check_agent_loops(config)  # the registry file lists it and its class imports
    assert "long_tail" not in (small_demo / "overrides.txt").read_text()  # the copy task as it was


def test_the_agent_loop_asks_for_each_rows_length_with_eos_ignored():
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    assert _agent_loop_registry[long_tail.LONG_AGENT] == {"_target_": "async_rl.demo.long_tail.LongTailAgentLoop"}
    given = {"temperature": 1.0, "top_p": 1.0, "logprobs": True}
    params = long_tail.forced_length_params(given, {"split": "train", "index": 0, "response_tokens": 97})
    assert params == {**given, "max_tokens": 97, "ignore_eos": True} and "max_tokens" not in given
    with pytest.raises(KeyError, match="response_tokens"):
        long_tail.forced_length_params(given, {"split": "train", "index": 0})


def test_the_generate_stage_runs_the_loop_to_each_rows_length(small_demo):
    """verl's dataset reads the rows; the stage's agent-loop worker runs the long-tail loop; a scripted
    server that stops after one token unless told to ignore EOS: every response is its row's length."""
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from transformers import AutoTokenizer

    from async_rl.core.config import strip_async_keys
    from async_rl.core.messages import PromptBatch, build_batch
    from async_rl.core.policy_clock import ClockRef
    from async_rl.core.staleness import StalenessGate
    from async_rl.rollout.agent_loop_files import check_agent_loops
    from state_machines.generate import GenerateStage

    tokenizer = AutoTokenizer.from_pretrained(small_demo / "model")
    digit = tokenizer.encode("7", add_special_tokens=False)[0]

    def answer(kwargs, calls):
        params = kwargs["sampling_params"]
        return [digit] * (params["max_tokens"] if params.get("ignore_eos") else 1), 0, "completed"

    server = ScriptedServer(answer)
    config = compose_ppo(task.demo_overrides(small_demo, long=True, extra={"actor_rollout_ref.rollout.n": 2}))
    strip_async_keys(config)
    check_agent_loops(config)
    dataset = RLHFDataset(data_files=config.data.train_files, tokenizer=tokenizer, config=config.data, processor=None)
    rows = [{k: v for k, v in dataset[i].items() if not isinstance(v, torch.Tensor)} for i in range(3)]
    stage = GenerateStage(servers=[server], config=config, clock=ClockRef.in_process(StalenessGate(1)))
    out = asyncio.run(asyncio.wait_for(stage.process_data(PromptBatch(0, rows)), 60))
    batch = build_batch(out.samples, task.MAX_PROMPT_LENGTH, long_tail.LONG_RESPONSE_TOKENS, pad_token_id=0)
    expected = np.repeat(long_tail.draw_response_tokens(SEED, TRAIN_SIZE + VAL_SIZE)[:3], 2)
    assert batch.batch["response_mask"].sum(-1).tolist() == expected.tolist()
    assert sorted(c["sampling_params"]["max_tokens"] for c in server.calls) == sorted(expected.tolist())
    assert all(c["sampling_params"]["ignore_eos"] is True for c in server.calls)
