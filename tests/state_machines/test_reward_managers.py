"""A reward manager other than naive / dapo, registered or from a file (`reward.reward_manager.source=importlib`,
`module.path`), and verl's code sandbox (`reward.sandbox_fusion.url`) score through verl's own reward loop
(`RewardLoopWorker`) in the reward stage, as in verl's trainer; a manager that cannot be loaded fails
before Ray starts, naming the key."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from async_rl.core.messages import Sample, build_batch
from async_rl.demo import demo_overrides
from async_rl.run_config import read_run_config
from helpers.lineage import compose_ppo
from state_machines.reward import RewardStage

MANAGER = '''
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase


class LengthManager(RewardManagerBase):
    """Scores a response by its length: 0.1 a token."""

    def __init__(self, config, tokenizer, compute_score, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)

    async def run_single(self, data):
        item = data[0]
        width = item.batch["prompts"].shape[-1]
        return {"reward_score": 0.1 * float(item.batch["attention_mask"][width:].sum()), "reward_extra_info": {}}
'''


def batch(lengths):
    samples = [Sample(uid=f"u{i}", prompt_ids=[5, 6], response_ids=[7] * n, rollout_log_probs=[0.0] * n,
                      token_versions=[0] * n,
                      non_tensor={"data_source": "copy", "reward_model": {"ground_truth": "7777"}, "extra_info": {}})
               for i, n in enumerate(lengths)]
    return build_batch(samples, max_prompt_length=2, max_response_length=4, pad_token_id=0)


def test_a_reward_manager_from_a_file_scores_the_batch(demo_dir, tmp_path):
    path = tmp_path / "length_manager.py"
    path.write_text(MANAGER)
    manager = {"reward.reward_manager.source": "importlib", "reward.reward_manager.name": "LengthManager",
               "reward.reward_manager.module.path": str(path)}
    run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra=manager)))
    stage = RewardStage(config=run.config, tokenizer=AutoTokenizer.from_pretrained(demo_dir / "model"), timeout_s=30)
    scores, failures = asyncio.run(stage._score(batch([1, 4, 2]), 0))
    assert failures == [] and scores.tolist() == pytest.approx([0.1, 0.4, 0.2])
    with pytest.raises(ValueError, match="reward.reward_manager.module.path: verl's reward manager 'NoSuchManager'"):
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={**manager, "reward.reward_manager.name": "NoSuchManager"})))
    with pytest.raises(ValueError, match="reward.reward_manager.name: verl's reward manager 'no_such'"):
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={"reward.reward_manager.name": "no_such"})))


def test_a_sandbox_url_reaches_verls_default_compute_score(demo_dir):
    url = "http://127.0.0.1:1/run_code"
    no_function = {"reward.custom_reward_function.path": None, "reward.sandbox_fusion.url": url}
    run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra=no_function)))
    stage = RewardStage(config=run.config, tokenizer=AutoTokenizer.from_pretrained(demo_dir / "model"), timeout_s=30,
                        on_error="zero")

    async def scorer():  # builds verl's reward loop in this loop; verl scores no 'copy' data source itself
        _, failures = await stage._score(batch([1]), 0)
        assert "Reward function is not implemented for data_source='copy'" in failures[0][1]
        return stage.reward_model.worker.reward_manager.compute_score

    compute_score = asyncio.run(scorer())
    assert compute_score.keywords["sandbox_fusion_url"] == url  # verl's partial of default_compute_score
