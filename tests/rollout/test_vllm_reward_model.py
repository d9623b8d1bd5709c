"""A reward model on vLLM's CPU build (the vllm venv; async_rl/rollout/reward_models.py): verl's vLLM server
started standalone on a device of its own answers verl's reward loop through verl's router with the reward
model's score, and when it is lost it is started again at a new address, the router following it, while a
row waits within its deadline."""

from __future__ import annotations

import asyncio

import pytest
import ray
from transformers import AutoTokenizer

from async_rl.core.reward_loop_scoring import one_row
from async_rl.rollout.reward_models import prepare_reward_model_config, start_reward_model
from async_rl.run_config import ray_init_kwargs
from test_cpu_reward_model import (RAW_PROMPT, config_for, kill_and_wait, prompt_ids, score_in_a_loop,
                                   verl_recipe_score)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM_REWARD_MODEL = {"reward.reward_model.rollout.name": "vllm", "reward.reward_model.rollout.dtype": "float32",
                     "reward.reward_model.rollout.enforce_eager": True, "reward.reward_model.enable_resource_pool": True,
                     "reward.reward_model.n_gpus_per_node": 1, "reward.reward_model.nnodes": 1,
                     "reward.custom_reward_function.path": None}


def test_a_lost_vllm_reward_model_is_started_again_and_the_router_follows_it(demo_dir, ray_address, request, monkeypatch):
    config = config_for(demo_dir, VLLM_REWARD_MODEL)
    prepare_reward_model_config(config)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    env = ray_init_kwargs(config)["runtime_env"]["env_vars"]  # vLLM's CPU build's settings, as a run sets them
    ray.init(address=ray_address, runtime_env={"env_vars": {**env, "PYTHONPATH": str(request.path.parent)}})
    try:
        service = start_reward_model(config, timeout_s=300, max_restarts=1)
        try:
            tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
            prompt, response = prompt_ids(tokenizer), tokenizer("1234")["input_ids"]
            row = one_row(prompt, response, {"raw_prompt": RAW_PROMPT, "data_source": "d",
                                             "reward_model": {"ground_truth": "1234"}})
            expected = verl_recipe_score(demo_dir, prompt, response)
            before, failures = asyncio.run(score_in_a_loop(config, service.router_address, [row], 60))
            assert failures == [] and before.item() == pytest.approx(expected, abs=1e-4)

            replica, router = service.replicas[0], service.router_address
            address = replica.server_address
            kill_and_wait(replica.servers[0])
            after, failures = asyncio.run(score_in_a_loop(config, service.router_address, [row], 240))
            assert failures == [] and service.restarts == [1]
            assert replica.server_address != address and service.router_address == router  # moved; the router followed
            assert after.item() == pytest.approx(expected, abs=1e-4)
        finally:
            service.stop()
        assert not [g for g in ray.util.placement_group_table().values()
                    if g["name"].startswith("rollout_pool_reward") and g["state"] != "REMOVED"]  # its devices freed
    finally:
        ray.shutdown()
