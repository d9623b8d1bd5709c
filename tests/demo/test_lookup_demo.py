"""The lookup demo (async_rl/demo/lookup.py): its table, reward and verl agent loop, run by the generate
stage on scripted servers (a perfect agent, one that answers without calling the tool); what verl's data metrics
say of the turns."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from async_rl.core.messages import PromptBatch, build_batch
from async_rl.core.scoring import decode_responses
from async_rl.demo import lookup
from async_rl.demo.lookup_reward import compute_score, model_turns
from async_rl.demo.task import demo_overrides
from async_rl.rollout.agent_loop_files import check_agent_loops
from helpers.lineage import compose_ppo
from helpers.scripted_server import ScriptedServer
from state_machines.actor_train import agent_loop_timings
from async_rl.core.policy_clock import ClockRef
from async_rl.core.staleness import StalenessGate
from state_machines.generate import GenerateStage

TABLE = lookup.LookupTable.build(0)  # the table `prepare(seed=0)` registers (conftest's demo_dir)


def test_the_table_chains_take_one_to_three_lookups_and_every_chain_ends_in_a_value():
    depths = Counter(len(TABLE.perfect_turns(key)) - 1 for key in TABLE.items)
    assert depths == lookup.KEYS_BY_DEPTH
    for key in TABLE.items:
        turns = TABLE.perfect_turns(key)
        assert all(t.startswith(" ") and len(t) == lookup.TURN_TOKENS for t in turns[:-1])
        assert turns[-1].isdigit() and len(turns[-1]) == lookup.VALUE_DIGITS
    assert lookup.LookupTable.build(0) == TABLE != lookup.LookupTable.build(1)
    missing = next(f"{k:04d}" for k in range(10**4) if f"{k:04d}" not in TABLE.items)
    with pytest.raises(KeyError, match="no key"):
        TABLE.perfect_turns(missing)
    assert TABLE.reply(" 99x") == TABLE.reply(" " + missing) == TABLE.reply(missing) == lookup.NOT_FOUND


def transcript(turns, replies):
    return turns[0] + "".join(f"\n{reply}={turn}" for reply, turn in zip(replies, turns[1:]))


def test_the_reward_needs_the_tool_and_credits_each_turn():
    key = next(k for k in TABLE.items if len(TABLE.perfect_turns(k)) == 3)
    perfect = TABLE.perfect_turns(key)
    truth = "|".join(perfect)
    assert compute_score("d", transcript(perfect, perfect[1:]), truth) == 1.0
    assert model_turns(transcript(perfect, perfect[1:])) == perfect
    assert compute_score("d", perfect[0], truth) == pytest.approx(1 / 3)  # the right call, then nothing
    assert compute_score("d", "x" + key, truth) == pytest.approx(0.8 / 3)  # the best answer without the tool
    wrong = perfect[0][:-1] + str((int(perfect[0][-1]) + 1) % 10)  # the key's last digit off
    assert compute_score("d", transcript([wrong, ""], [TABLE.reply(wrong)]), truth) == pytest.approx(0.8 / 3)
    assert compute_score("d", "", truth) == 0.0


def test_prepare_writes_the_lookup_task_and_its_overrides(demo_dir):
    rows = pd.read_parquet(demo_dir / "data" / "lookup_train.parquet")
    val = pd.read_parquet(demo_dir / "data" / "lookup_val.parquet")
    keys = [r[0]["content"][1:] for r in rows["prompt"]]
    assert not set(keys) & {r[0]["content"][1:] for r in val["prompt"]}  # validation keys never trained on
    assert all(t["ground_truth"] == "|".join(TABLE.perfect_turns(k)) for t, k in zip(rows["reward_model"], keys))
    turns = Counter(len(TABLE.perfect_turns(k)) for k in keys)  # rollout lengths vary: 2 to 4 turns
    assert set(turns) == {2, 3, 4} and turns[2] > turns[4]
    overrides = (demo_dir / "overrides_agent.txt").read_text().split()
    assert overrides == demo_overrides(demo_dir, agent=True)
    assert f"actor_rollout_ref.rollout.agent.agent_loop_config_path={demo_dir / 'agent_loops.yaml'}" in overrides


def perfect_agent() -> ScriptedServer:
    """Repeats the latest item: the TURN_TOKENS tokens before the prompt's last "="."""
    def answer(kwargs, calls):
        return kwargs["prompt_ids"][-1 - lookup.TURN_TOKENS:-1], 0, "completed"

    return ScriptedServer(answer)


def run_lookup(demo_dir, server, keys):
    from async_rl.core.config import strip_async_keys

    config = compose_ppo(demo_overrides(demo_dir, agent=True, extra={"actor_rollout_ref.rollout.n": 2}))
    strip_async_keys(config)
    check_agent_loops(config)
    stage = GenerateStage(servers=[server], config=config, clock=ClockRef.in_process(StalenessGate(1)))
    rows = [{"raw_prompt": [{"role": "user", "content": " " + key}], "data_source": lookup.DATA_SOURCE,
             "index": i, "reward_model": {"ground_truth": "|".join(TABLE.perfect_turns(key))}}
            for i, key in enumerate(keys)]
    out = asyncio.run(asyncio.wait_for(stage.process_data(PromptBatch(0, rows)), 60))
    return config, build_batch(out.samples, lookup.PROMPT_LENGTH, lookup.RESPONSE_LENGTH, pad_token_id=0)


def test_a_perfect_agent_calls_the_tool_until_the_value_and_scores_one(demo_dir):
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    by_turns = {n: [k for k in TABLE.items if len(TABLE.perfect_turns(k)) == n] for n in (2, 3, 4)}
    keys = [by_turns[2][0], by_turns[2][1], by_turns[3][0], by_turns[4][0]]
    config, batch = run_lookup(demo_dir, perfect_agent(), keys)
    scored = decode_responses(batch, tokenizer)
    assert [compute_score("d", r.solution_str, r.ground_truth) for r in scored] == [1.0] * 8
    assert [model_turns(r.solution_str) for r in scored[::2]] == [TABLE.perfect_turns(k) for k in keys]
    mask = batch.batch["response_mask"]
    lengths = [len(TABLE.perfect_turns(k)) for k in keys]
    turn, reply = lookup.TURN_TOKENS, lookup.REPLY_TOKENS
    for row, turns in enumerate(np.repeat(lengths, 2)):  # model tokens: `turn` a turn; the tool's replies: masked
        assert int(mask[row].sum()) == turn * turns
        assert int(batch.batch["attention_mask"][row, lookup.PROMPT_LENGTH:].sum()) == turn * turns + reply * (turns - 1)
    for key in ("token_level_scores", "token_level_rewards", "advantages", "returns"):  # what verl's metrics read
        batch.batch[key] = torch.zeros_like(mask, dtype=torch.float32)
    metrics = compute_data_metrics(batch, use_critic=False)  # verl's names; a mean that is not a whole number
    assert metrics["num_turns/mean"] == pytest.approx(np.mean([2 * t for t in lengths]))
    assert metrics["tool_call_counts/mean"] == pytest.approx(np.mean([t - 1 for t in lengths]))
    timings = agent_loop_timings(batch.non_tensor_batch)  # verl's agent_loop/* timings, seconds a trajectory
    assert 0 < timings["agent_loop/generate_sequences/min"] <= timings["agent_loop/generate_sequences/max"]
    assert timings["agent_loop/tool_calls/max"] > 0


def test_an_agent_that_never_calls_the_tool_stays_below_the_target(demo_dir):
    """Even one that knows every value (it answers the value at once): the first turn is a call's place."""
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    keys = sorted(TABLE.items)[:2]
    values = {TABLE.perfect_turns(k)[-1] for k in keys}

    def knows_the_values(kwargs, calls):
        key = tokenizer.decode(kwargs["prompt_ids"][-1 - lookup.KEY_DIGITS:-1])
        return tokenizer.encode(TABLE.perfect_turns(key)[-1], add_special_tokens=False), 0, "completed"

    _, batch = run_lookup(demo_dir, ScriptedServer(knows_the_values), keys)
    scored = decode_responses(batch, tokenizer)
    assert {r.solution_str for r in scored} == values  # one turn each: an answer ends the episode
    assert all(compute_score("d", r.solution_str, r.ground_truth) <= 0.4 for r in scored)
