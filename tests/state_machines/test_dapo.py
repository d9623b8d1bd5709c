"""DAPO under verl's own keys: overlong reward shaping (the reward stage equals verl's `dapo`
reward manager), clip-higher and token-level loss (verl's actor keys reach verl's loss)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from async_rl.core.messages import Sample, build_batch
from async_rl.core.scoring import overlong_shaping, score_batch

MAX_RESP, BUFFER, FACTOR = 20, 8, 1.5


def reward_config(manager="dapo", enable=True, **kwargs):
    return OmegaConf.create({"reward": {
        "reward_manager": {"name": manager},
        "reward_kwargs": {"max_resp_len": MAX_RESP,
                          "overlong_buffer_cfg": {"enable": enable, "len": BUFFER, "penalty_factor": FACTOR, "log": False},
                          **kwargs},
    }})


class DigitTokenizer:
    """Token t <-> character str(t % 10); enough for decode() in both reward paths."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(int(t) % 10) for t in ids)


def constant_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.startswith(ground_truth) else 0.25


def length_batch(lengths):
    rng = np.random.default_rng(0)
    samples = [
        Sample(uid=f"u{i}", prompt_ids=[1, 2], response_ids=[int(t) for t in rng.integers(1, 10, n)],
               rollout_log_probs=[0.0] * n, token_versions=[0] * n,
               non_tensor={"data_source": "digits", "reward_model": {"ground_truth": "1"}, "extra_info": {}})
        for i, n in enumerate(lengths)
    ]
    return build_batch(samples, max_prompt_length=2, max_response_length=MAX_RESP, pad_token_id=0)


def test_overlong_penalty_equals_verls_dapo_reward_manager():
    from verl.experimental.reward_loop.reward_manager.dapo import DAPORewardManager

    lengths = [1, 5, 12, 13, 16, 19, 20]
    batch = length_batch(lengths)
    config = reward_config()
    ours = score_batch(batch, DigitTokenizer(), constant_score, overlong_shaping(config))

    async def verl_scores():
        manager = DAPORewardManager(config, DigitTokenizer(), constant_score)  # takes the running loop
        return [(await manager.run_single(batch[i : i + 1]))["reward_score"] for i in range(len(batch))]

    want = asyncio.run(verl_scores())
    torch.testing.assert_close(ours, torch.tensor(want, dtype=torch.float32))
    plain = score_batch(batch, DigitTokenizer(), constant_score)
    penalties = (ours - plain).tolist()
    assert penalties[:3] == [0.0, 0.0, 0.0]  # within max_resp_len - buffer = 12 tokens
    assert penalties[-1] == pytest.approx(-FACTOR)  # at max_resp_len: the full penalty


def test_overlong_shaping_only_with_verls_dapo_manager_and_enabled():
    assert overlong_shaping(reward_config(manager="naive")) is None
    assert overlong_shaping(reward_config(enable=False)) is None
    assert overlong_shaping(OmegaConf.create({})) is None
    shaping = overlong_shaping(reward_config())
    assert (shaping.max_resp_len, shaping.buffer_len, shaping.penalty_factor) == (MAX_RESP, BUFFER, FACTOR)


@pytest.mark.parametrize("bad,fragment", [({"max_resp_len": 4}, "max_resp_len=4"), ({"max_resp_len": None}, "max_resp_len=None")])
def test_bad_overlong_settings_name_the_key(bad, fragment):
    with pytest.raises(ValueError, match=fragment):
        overlong_shaping(reward_config(**bad))


def test_clip_higher_and_token_mean_reach_the_train_workers_unchanged(demo_dir):
    """verl's DAPO actor keys pass through the pipeline's config handling as the user set them (the
    loss they drive is checked against the equations in test_decoupled_ppo.py, with eps_high != eps_low)."""
    from async_rl.demo import demo_overrides
    from async_rl.run_config import read_run_config
    from helpers.lineage import compose_ppo

    dapo = {"actor_rollout_ref.actor.clip_ratio_low": 0.2, "actor_rollout_ref.actor.clip_ratio_high": 0.28,
            "actor_rollout_ref.actor.clip_ratio_c": 10.0, "actor_rollout_ref.actor.loss_agg_mode": "token-mean"}
    run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra=dapo)))
    actor = run.config.actor_rollout_ref.actor  # what make_worker_group hands to verl's workers
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c, actor.loss_agg_mode) == (
        0.2, 0.28, 10.0, "token-mean")
    assert run.config.algorithm.rollout_correction.rollout_is == "token"  # decoupled PPO on by default
