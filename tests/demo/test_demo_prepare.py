"""Tests for the copy-digits demo: prepare output, tokenizer, data format, reward, verl overrides."""

import random
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from async_rl.demo.__main__ import main as cli_main
from async_rl.demo.reward import compute_score
from async_rl.demo.task import DATA_SOURCE, demo_overrides
from async_rl.demo.tokenizer import SEPARATOR
from helpers.lineage import compose_ppo

TRAIN_SIZE, VAL_SIZE = 48, 8


def token_ids(output):
    """apply_chat_template may return a list or a BatchEncoding, depending on transformers."""
    from verl.utils.tokenizer import normalize_token_ids

    return normalize_token_ids(output)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    cli_main(["prepare", "--output-dir", str(out), "--seed", "0",
              "--train-size", str(TRAIN_SIZE), "--val-size", str(VAL_SIZE)])
    return out


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return AutoTokenizer.from_pretrained(demo_dir / "model")


def test_prepare_writes_all_files(demo_dir):
    for rel in ["model/config.json", "model/model.safetensors", "model/tokenizer.json",
                "model/generation_config.json", "data/train.parquet", "data/val.parquet",
                "reward.py", "overrides.txt"]:
        assert (demo_dir / rel).is_file(), rel
    lines = (demo_dir / "overrides.txt").read_text().split()
    assert lines == demo_overrides(demo_dir)


def test_model_and_tokenizer_load_offline(demo_dir, tokenizer):
    config = AutoConfig.from_pretrained(demo_dir / "model")
    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model")
    assert config.model_type == "qwen2" and config.vocab_size == len(tokenizer)
    assert config.tie_word_embeddings and config.hidden_size == 64 and config.num_hidden_layers == 2
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.eos_token_id == config.eos_token_id == model.generation_config.eos_token_id
    assert tokenizer.pad_token_id == config.pad_token_id == model.generation_config.pad_token_id
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    ids = torch.tensor([tokenizer.encode("1234=")])
    assert model(input_ids=ids).logits.shape == (1, 5, len(tokenizer))


def test_tokenizer_is_one_token_per_character(demo_dir, tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(demo_dir / "model" / "tokenizer.json"))
    for text in ["0123456789", "12 3\n4=", "9=9<|endoftext|><pad>"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == raw.encode(text).ids
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("0123456789=\n ", add_special_tokens=False)) == 13


def test_chat_template_is_digits_then_separator(tokenizer):
    out = tokenizer.apply_chat_template([{"role": "user", "content": "1234"}],
                                        add_generation_prompt=True, tokenize=True)
    ids = token_ids(out)
    assert ids == tokenizer.encode("1234" + SEPARATOR, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["1", "2", "3", "4", SEPARATOR]


def test_parquet_columns_and_split(demo_dir):
    train = pd.read_parquet(demo_dir / "data" / "train.parquet")
    val = pd.read_parquet(demo_dir / "data" / "val.parquet")
    assert len(train) == TRAIN_SIZE and len(val) == VAL_SIZE
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} <= set(train.columns)
    row = train.iloc[0]
    digits = row["prompt"][0]["content"]
    assert row["data_source"] == DATA_SOURCE and row["prompt"][0]["role"] == "user"
    assert len(digits) == 4 and digits.isdigit()
    assert row["reward_model"]["style"] == "rule" and row["reward_model"]["ground_truth"] == digits
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == 0
    train_prompts = {p[0]["content"] for p in train["prompt"]}
    val_prompts = {p[0]["content"] for p in val["prompt"]}
    assert len(val_prompts) == VAL_SIZE and not train_prompts & val_prompts


def test_rlhf_dataset_and_agent_loop_tokenization(demo_dir, tokenizer):
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    cfg = compose_ppo(demo_overrides(demo_dir, extra={"data.filter_overlong_prompts": True}))
    dataset = RLHFDataset(data_files=cfg.data.train_files, tokenizer=tokenizer, config=cfg.data, processor=None)
    assert len(dataset) == TRAIN_SIZE  # no prompt filtered as overlong
    item = dataset[0]
    digits = item["reward_model"]["ground_truth"]
    # verl 0.9.1 returns raw chat messages; the agent loop tokenizes them with the
    # continuous-token builder chosen from config.json's model_type ("qwen2").
    builder = create_continuous_token_builder(tokenizer, hf_model_type="qwen2")
    ids = builder.build_initial_tokens(list(item["raw_prompt"]))
    assert len(ids) <= cfg.data.max_prompt_length
    assert tokenizer.decode(ids) == digits + SEPARATOR


@pytest.mark.parametrize("response, expected", [
    ("1234", 1.0), ("1299", 0.5), ("9934", 0.5), ("", 0.0), ("5678", 0.0), (None, 0.0),
    ("12", 0.5), ("1234<|endoftext|>", 1.0), ("1234<|endoftext|><pad><pad>", 1.0),
    ("12<|endoftext|>", 0.5), ("12345678", 1.0), (" 1234", 0.0),
])
def test_compute_score(response, expected):
    assert compute_score(DATA_SOURCE, response, "1234") == expected
    assert compute_score(DATA_SOURCE, response, "1234", extra_info={"index": 0}, num_turns=2) == expected


def test_overrides_compose_and_verl_loads_reward(demo_dir):
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = compose_ppo(demo_overrides(demo_dir))
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.data.train_batch_size == 32 and cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-4)
    assert cfg.actor_rollout_ref.rollout.response_length == 4
    assert Path(cfg.actor_rollout_ref.model.path) == demo_dir / "model"
    fn = get_custom_reward_fn(cfg)
    assert fn(data_source=DATA_SOURCE, solution_str="1299", ground_truth="1234", extra_info={}) == 0.5


def test_overrides_extra_and_bad_key(demo_dir):
    extended = demo_overrides(demo_dir, extra={"actor_rollout_ref.rollout.n": 4, "trainer.total_epochs": 2})
    assert "actor_rollout_ref.rollout.n=4" in extended and extended[-1] == "trainer.total_epochs=2"
    assert len(extended) == len(demo_overrides(demo_dir)) + 1
    assert demo_overrides(demo_dir, extra=["trainer.total_epochs=3"])[-1] == "trainer.total_epochs=3"
    compose_ppo(extended)
    with pytest.raises(Exception):
        compose_ppo(demo_overrides(demo_dir, extra=["data.no_such_key=1"]))


def test_random_policy_reward_is_low(tokenizer):
    rng = random.Random(0)
    scores = []
    for _ in range(2000):
        target = "".join(rng.choice("0123456789") for _ in range(4))
        ids = [rng.randrange(len(tokenizer)) for _ in range(4)]
        response = tokenizer.decode(ids, skip_special_tokens=True)  # as verl's naive reward manager
        scores.append(compute_score(DATA_SOURCE, response, target))
    assert sum(scores) / len(scores) < 0.15
