"""A reward model end to end (`rollout.name=cpu`): under the flag, named by verl's legacy `reward_model.*` keys
as verl's `ppo_trainer/run_qwen2-7b_rm_seq_balance.sh` writes them, the reward stage and validation score with
it through verl's reward loop, here inside the user's reward function as verl combines them; verl's own
trainer, flag off, scores with the same CPU reward model alone (named by `reward.reward_model.*`: verl
0.9.1's main_ppo does not read the legacy keys).
What each step trained is read back from verl's `trainer.rollout_data_dir` dumps and scored here again,
by hand, with the reward model's forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from helpers.rows import every_step_with, val_rows
from helpers.runs import run_verl

RESPONSE_LENGTH = 4  # the demo's


def reward_model_keys(demo_dir: Path, dump: Path, reward_function, legacy: bool = False) -> dict:
    """The reward model's keys (`legacy`: verl's old top-level `reward_model.*` names), the run's sizes."""
    model = {"reward_model.enable": True, "reward_model.model.path": str(demo_dir / "reward_model"),
             "reward_model.rollout.name": "cpu", "reward_model.rollout.tensor_model_parallel_size": 1} if legacy else {
        "reward.reward_model.enable": True, "reward.reward_model.model_path": str(demo_dir / "reward_model"),
        "reward.reward_model.rollout.name": "cpu", "reward.reward_model.rollout.tensor_model_parallel_size": 1}
    return {**model, "reward.custom_reward_function.path": reward_function, "trainer.rollout_data_dir": str(dump),
            "trainer.total_training_steps": 2, "trainer.test_freq": 2, "trainer.val_before_train": True}


def scored_by_hand(demo_dir: Path, dump: Path, text_of) -> list[tuple[float, float]]:
    """(dumped score, the score recomputed) for every dumped row `text_of(row)` can rebuild the reward model's
    input for (None: it cannot)."""
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "reward_model")
    model = AutoModelForSequenceClassification.from_pretrained(demo_dir / "reward_model").eval()
    pairs = []
    for path in sorted(dump.glob("*.jsonl")):
        for row in map(json.loads, path.read_text().splitlines()):
            text = text_of(row, tokenizer)
            if text is None:
                continue
            with torch.no_grad():
                score = float(model(input_ids=torch.tensor([tokenizer(text)["input_ids"]])).logits[0, -1])
            pairs.append((row["score"], score))
    return pairs


def plain_response_text(row, tokenizer):
    """verl's reward-model input for a response of 4 visible tokens (the dump drops special tokens, which
    verl's input keeps: such rows cannot be rebuilt): the prompt's digits, the response, eos."""
    if len(tokenizer(row["output"])["input_ids"]) != RESPONSE_LENGTH:
        return None
    return row["input"].removesuffix("=") + row["output"] + tokenizer.eos_token


def test_a_reward_function_combines_a_rule_with_the_reward_model(demo_dir, tmp_path, ray_address):
    """Under the flag the reward stage and validation score through verl's reward loop; the user's function
    gets the router's address and the reward model's tokenizer, as in verl. (Without a function verl's
    loop scores with the reward model alone: tests/rollout/test_cpu_reward_model.py, and the test below.)"""
    dump = tmp_path / "dump"
    function = str(Path(__file__).parent / "rm_plus_rule_reward.py")
    # verl's ppo_trainer/run_qwen2-7b_rm_seq_balance.sh: PPO with a critic (gae) and a reward model, in its keys
    code, out, rows = run_verl(demo_dir, reward_model_keys(demo_dir, dump, function, legacy=True), tmp_path,
                               critic=True, ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert "verl's legacy keys reward_model.enable=True" in out and "reward.reward_model.enable=True" in out
    steps = every_step_with(rows, 2, ["critic/score/mean", "async/faults/reward_errors", "critic/vf_loss"])
    assert all(metrics["async/faults/reward_errors"] == 0 for metrics in steps.values())
    assert sorted(val_rows(rows)) == [0, 2]

    def combined(row, tokenizer):  # exactly what the function sends: the decoded response, special tokens dropped
        return row["gts"] + row["output"] + tokenizer.eos_token

    pairs = scored_by_hand(demo_dir, dump, combined)
    assert len(pairs) == 2 * 32 * 8
    assert len({round(d, 6) for d, _ in pairs}) > 10  # the scores are the model's, not the rule's 0 / 1
    outputs = [json.loads(line)["output"] == json.loads(line)["gts"]
               for path in sorted(dump.glob("*.jsonl")) for line in path.read_text().splitlines()]
    for (dumped, by_hand), exact in zip(pairs, outputs):
        assert dumped == pytest.approx(by_hand + float(exact), abs=1e-5)


def test_verls_own_trainer_scores_with_the_cpu_reward_model(demo_dir, tmp_path, ray_address):
    """Flag off: verl's trainer starts the CPU backend's reward-model server and its reward loop scores with
    it (the patch for rollout.name=cpu). (A reward function together with the reward model fails in verl
    0.9.1's own trainer, on any backend: its `_compute_reward_colocate` passes the reward loop `raw_prompt`
    alone, and verl's reward manager reads `data_source`: docs/reward_models.md.)"""
    dump = tmp_path / "dump"
    keys = {**reward_model_keys(demo_dir, dump, None), "+actor_rollout_ref.async_pipeline": False,
            "trainer.val_before_train": False}
    code, out, rows = run_verl(demo_dir, keys, tmp_path, ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert "async-rl" not in out  # verl's trainer ran
    pairs = scored_by_hand(demo_dir, dump, plain_response_text)
    assert len(pairs) >= 64, len(pairs)
    for dumped, by_hand in pairs:
        assert dumped == pytest.approx(by_hand, abs=1e-5)
