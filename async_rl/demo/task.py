"""The copy-digits demo task: data, tiny model, verl overrides, and ``prepare``.

Prompt: 4 random digits (e.g. "3141"); the correct response is the same 4
digits. The reward (``async_rl.demo.reward.compute_score``) gives per-position
partial credit. On the tiny model a single-process GRPO loop (group 8, 32 prompts a
step, lr 3e-4) reaches greedy reward 0.9 in about 180-200 steps. ``prepare`` also
writes the lookup task (``lookup``) and the long-tail task (``long_tail``) for the same
model, whose size is a row of ``MODEL_SIZES``.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from async_rl.demo import long_tail, lookup, lookup_reward
from async_rl.demo import reward as reward_module
from async_rl.demo.reward import NUM_DIGITS
from async_rl.demo.tokenizer import build_tokenizer

DATA_SOURCE = "async_rl/copy_digits"
ABILITY = "copy"

LOOKUP_AGENT = "lookup"  # the lookup task's agent loop, as registered in AGENT_LOOPS_FILE
LONG_AGENT = long_tail.LONG_AGENT  # the long-tail task's, registered there too
AGENT_LOOPS_FILE = "agent_loops.yaml"

DEFAULT_TRAIN_SIZE = 4096
DEFAULT_VAL_SIZE = 64

MAX_PROMPT_LENGTH = 16
RESPONSE_LENGTH = NUM_DIGITS
GROUP_SIZE = 8
TRAIN_BATCH_SIZE = 32
LEARNING_RATE = 3e-4
LOOKUP_LEARNING_RATE = 1e-3  # the lookup task learns faster at 1e-3 than at 3e-4 (docs/agent_loops.md)
# without it the lookup policy collapses (every sample of a prompt the same) at validation 0.5-0.7; with it,
# 0.98 at step 200 (docs/agent_loops.md)
LOOKUP_ENTROPY_COEFF = 0.05

# Every size has one attention head (head_dim = hidden_size): vLLM's CPU attention refuses head_dim 16
# (4 heads of 64) and its Qwen2 ignores an explicit `head_dim`, so the same model runs on both rollout
# backends. `prepare(model_size=...)` builds one; "tiny" is the demo's. The larger ones cover a prompt
# (MAX_PROMPT_LENGTH) + the long-tail task's longest response (LONG_CONTEXT) in max_position_embeddings,
# which verl's servers take as their max_model_len.
LONG_CONTEXT = MAX_PROMPT_LENGTH + long_tail.LONG_RESPONSE_TOKENS
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                 num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=64),
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=1,
                  num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=512),
    "medium": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=1,
                   num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=512),
}
DEFAULT_MODEL_SIZE = "tiny"
MODEL_KWARGS = MODEL_SIZES[DEFAULT_MODEL_SIZE]


def model_kwargs(size: str) -> dict[str, Any]:
    """The Qwen2 config keys of a named size (MODEL_SIZES); ValueError naming the sizes for another name."""
    if size not in MODEL_SIZES:
        raise ValueError(f"model size {size!r}: one of {', '.join(MODEL_SIZES)}")
    return MODEL_SIZES[size]


def covers_long_task(size: str) -> bool:
    """Whether a size's max_position_embeddings holds a prompt + the long-tail task's longest response."""
    return model_kwargs(size)["max_position_embeddings"] >= LONG_CONTEXT


def sample_prompts(rng: np.random.Generator, train_size: int, val_size: int) -> tuple[list[str], list[str]]:
    """Draw digit strings; val prompts are unique and disjoint from train whenever the space allows."""
    space = 10**NUM_DIGITS
    unique = rng.permutation(space)
    val = unique[: min(val_size, space)]
    if val_size > space:
        val = np.concatenate([val, rng.choice(space, size=val_size - space)])
    pool = unique[len(val) :] if len(val) < space else unique
    if train_size <= len(pool):
        train = pool[:train_size]
    else:
        train = np.concatenate([pool, rng.choice(pool, size=train_size - len(pool))])
    fmt = f"{{:0{NUM_DIGITS}d}}".format
    return [fmt(int(n)) for n in train], [fmt(int(n)) for n in val]


def make_rows(prompts: list[str], split: str) -> pd.DataFrame:
    """Rows in verl's RL data format (the columns RLHFDataset and the reward manager read)."""
    return pd.DataFrame(
        [
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": digits}],
                "ability": ABILITY,
                "reward_model": {"style": "rule", "ground_truth": digits},
                "extra_info": {"split": split, "index": index},
            }
            for index, digits in enumerate(prompts)
        ]
    )


def build_model(vocab_size: int, eos_token_id: int, pad_token_id: int, seed: int = 0,
                size: str = DEFAULT_MODEL_SIZE):
    """Random-init Qwen2ForCausalLM of a named size (MODEL_SIZES) in float32 with eos/pad set in config and
    generation config."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **model_kwargs(size),
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id
    )
    return model


def build_reward_model(vocab_size: int, pad_token_id: int, seed: int = 0, size: str = DEFAULT_MODEL_SIZE):
    """Random-init Qwen2ForSequenceClassification (one label: a score), float32, the policy's
    architecture (a size of MODEL_SIZES) and tokenizer: a discriminative reward model for verl's
    `reward.reward_model.*` keys."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(**model_kwargs(size), vocab_size=vocab_size, bos_token_id=None, pad_token_id=pad_token_id,
                         num_labels=1, dtype="float32")
    torch.manual_seed(seed)
    return Qwen2ForSequenceClassification(config).to(torch.float32)


def _format_value(value: Any) -> str:
    """Render a value for a hydra override, quoting strings hydra would not parse bare."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    text = str(value)
    if isinstance(value, str) and not re.fullmatch(r"[\w\-+./:~@]+", text):
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return text


# The async pipeline on this CPU machine (see README "Configuration" and ARCHITECTURE.md):
# verl's FSDP2 engine in fp32 with sdpa attention, the CPU rollout backend, dynamic
# micro-batches, one PPO mini-batch per step, metrics to console + JSONL file.
CPU_PIPELINE_OVERRIDES: dict[str, str] = {
    "trainer.device": "cpu",
    "trainer.nnodes": "1",
    "trainer.n_gpus_per_node": "2",
    "trainer.total_training_steps": "300",
    "trainer.test_freq": "10",
    "trainer.val_before_train": "True",
    "trainer.save_freq": "-1",
    "trainer.logger": "[console,file]",
    "trainer.project_name": "async_rl_demo",
    "trainer.experiment_name": "copy_digits",
    # the demo's batches are a few rows of digits: read in the dataloader stage itself, not in verl's
    # default 8 forked workers (a few hundred MB each on a 2-core machine)
    "data.dataloader_num_workers": "0",
    # verl's trainer (without the flag) starts 8 agent-loop workers, 8 reward-loop workers and 8 transfer-queue
    # storage units by default, each a Ray process importing torch and verl (7-10 s of CPU each here); one of
    # each serves the demo's batches. The pipeline runs its agent loops and rewards in its own stages.
    "actor_rollout_ref.rollout.agent.num_workers": "1",
    "reward.num_workers": "1",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": "1",
    "actor_rollout_ref.rollout.name": "cpu",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",  # a CPU replica is one process
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "False",
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "actor_rollout_ref.ref.strategy": "fsdp2",
    "actor_rollout_ref.actor.use_torch_compile": "False",
    "actor_rollout_ref.ref.use_torch_compile": "False",
    "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision": "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision": "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    "actor_rollout_ref.actor.ppo_mini_batch_size": str(TRAIN_BATCH_SIZE),
    "actor_rollout_ref.actor.use_dynamic_bsz": "True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "8192",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "8192",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "True",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "8192",
    "actor_rollout_ref.actor.use_kl_loss": "False",
    "actor_rollout_ref.actor.entropy_coeff": "0",
    "algorithm.use_kl_in_reward": "False",
    "+actor_rollout_ref.async_pipeline": "True",
    "+trainer.use_nodes_ratios": "[0.5,0.5,0.5,0.5]",
    "+actor_rollout_ref.rollout.enable_dual_buffer": "True",
    "+actor_rollout_ref.rollout.param_update_preduce_bucket_size_mb": "512",
    "+actor_rollout_ref.rollout.param_update_consume_bucket_size_mb": "128",
    "+trainer.generate_ahead_steps": "2",
}


# PPO with a critic (verl's default estimator, gae): the critic is a value model built from the
# demo's model (verl's critic keys; fp32, sdpa and no torch.compile on CPU, as for the actor).
PPO_OVERRIDES: dict[str, str] = {
    "algorithm.adv_estimator": "gae",
    "critic.strategy": "fsdp2",
    "critic.optim.lr": "1e-3",
    "critic.ppo_mini_batch_size": str(TRAIN_BATCH_SIZE),
    "critic.use_dynamic_bsz": "True",
    "critic.ppo_max_token_len_per_gpu": "8192",
    "critic.fsdp.use_torch_compile": "False",
    "+critic.model.override_config.attn_implementation": "sdpa",
    "+critic.fsdp.mixed_precision": "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
}


# LoRA on every Linear layer in place of full fine-tuning, at 7e-4: at 3e-3 the demo reached 0.9 sooner but
# did not stay there, at 1e-3 it dipped once below it; at 7e-4 it held on both seeds (docs/lora.md#the-learning-rate)
LORA_OVERRIDES = {
    "actor_rollout_ref.model.lora_rank": "16",
    "actor_rollout_ref.model.lora_alpha": "32",
    "actor_rollout_ref.actor.optim.lr": "7e-4",
    "trainer.experiment_name": "copy_digits_lora",
}


def lookup_overrides(root: Path) -> dict[str, str]:
    """The lookup task (``async_rl.demo.lookup``) in place of the copy task: its data, reward and
    agent loop (verl's ``agent_loop_config_path`` + ``default_agent_loop``)."""
    return {
        "data.train_files": _format_value(str(root / "data" / "lookup_train.parquet")),
        "data.val_files": _format_value(str(root / "data" / "lookup_val.parquet")),
        "data.max_prompt_length": _format_value(lookup.PROMPT_LENGTH),
        "data.max_response_length": _format_value(lookup.RESPONSE_LENGTH),
        "reward.custom_reward_function.path": _format_value(str(root / "lookup_reward.py")),
        "actor_rollout_ref.rollout.agent.agent_loop_config_path": _format_value(str(root / AGENT_LOOPS_FILE)),
        "actor_rollout_ref.rollout.agent.default_agent_loop": LOOKUP_AGENT,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": _format_value(lookup.MAX_ASSISTANT_TURNS),
        "actor_rollout_ref.actor.optim.lr": _format_value(LOOKUP_LEARNING_RATE),
        "actor_rollout_ref.actor.entropy_coeff": _format_value(LOOKUP_ENTROPY_COEFF),
        "trainer.experiment_name": "lookup",
    }


def long_tail_overrides(root: Path) -> dict[str, str]:
    """The long-tail task (``async_rl.demo.long_tail``) in place of the copy task: its data (the copy task's
    prompts and reward, each row's response length in its extra_info), responses up to
    LONG_RESPONSE_TOKENS, and its agent loop, which generates exactly each row's length."""
    return {
        "data.train_files": _format_value(str(root / "data" / "long_train.parquet")),
        "data.val_files": _format_value(str(root / "data" / "long_val.parquet")),
        "data.max_response_length": _format_value(long_tail.LONG_RESPONSE_TOKENS),
        "actor_rollout_ref.rollout.agent.agent_loop_config_path": _format_value(str(root / AGENT_LOOPS_FILE)),
        "actor_rollout_ref.rollout.agent.default_agent_loop": LONG_AGENT,
        "trainer.experiment_name": "long_tail",
    }


def demo_overrides(output_dir: str | Path, extra: Mapping[str, Any] | Iterable[str] | None = None,
                   critic: bool = False, agent: bool = False, lora: bool = False,
                   long: bool = False) -> list[str]:
    """verl hydra overrides (``key=value``) for the demo prepared in ``output_dir``.

    ``extra`` (a mapping, or ``key=value`` strings) is merged last: a key that is
    already present is replaced in place, new keys are appended. ``critic``: PPO with GAE and a
    critic (``PPO_OVERRIDES``) instead of GRPO. ``agent``: the lookup task, an agent loop calling a
    tool (``lookup_overrides``), instead of the copy task. ``lora``: a LoRA adapter trained in place of
    the whole model (``LORA_OVERRIDES``). ``long``: the long-tail task (``long_tail_overrides``), instead
    of the copy task.
    """
    root = Path(output_dir).resolve()
    overrides: dict[str, str] = {
        "data.train_files": _format_value(str(root / "data" / "train.parquet")),
        "data.val_files": _format_value(str(root / "data" / "val.parquet")),
        "data.max_prompt_length": _format_value(MAX_PROMPT_LENGTH),
        "data.max_response_length": _format_value(RESPONSE_LENGTH),
        "data.train_batch_size": _format_value(TRAIN_BATCH_SIZE),
        "actor_rollout_ref.model.path": _format_value(str(root / "model")),
        "reward.custom_reward_function.path": _format_value(str(root / "reward.py")),
        "reward.custom_reward_function.name": "compute_score",
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.rollout.n": _format_value(GROUP_SIZE),
        "actor_rollout_ref.actor.optim.lr": _format_value(LEARNING_RATE),
        **CPU_PIPELINE_OVERRIDES,
    }
    if critic:
        overrides.update({**PPO_OVERRIDES, "critic.model.path": _format_value(str(root / "model"))})
    if agent:
        overrides.update(lookup_overrides(root))
    if long:
        overrides.update(long_tail_overrides(root))
    if lora:
        overrides.update(LORA_OVERRIDES)
    if isinstance(extra, Mapping):
        overrides.update({key: _format_value(value) for key, value in extra.items()})
    elif extra is not None:
        for item in extra:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"override must look like key=value, got {item!r}")
            overrides[key] = value
    return [f"{key}={value}" for key, value in overrides.items()]


def prepare(
    output_dir: str | Path,
    seed: int = 0,
    train_size: int = DEFAULT_TRAIN_SIZE,
    val_size: int = DEFAULT_VAL_SIZE,
    model_size: str = DEFAULT_MODEL_SIZE,
) -> dict[str, Path]:
    """Write model + tokenizer (``model_size``: a row of MODEL_SIZES), a reward model (`reward_model/`:
    random, the same architecture with a score head), train/val parquet, reward.py, overrides.txt (GRPO)
    and overrides_ppo.txt (PPO with a critic), overrides_lora.txt (a LoRA adapter) under ``output_dir``;
    and, for the same model, the lookup task's (its parquet files, lookup_reward.py, agent_loops.yaml and
    overrides_agent.txt) and the long-tail task's (its parquet files, each row's response length in its
    extra_info, and overrides_long.txt; it needs a size that ``covers_long_task``)."""
    size = model_kwargs(model_size)
    root = Path(output_dir).resolve()
    model_dir, data_dir = root / "model", root / "data"
    model_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(model_max_length=size["max_position_embeddings"])
    model = build_model(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=seed, size=model_size)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    reward_model_dir = root / "reward_model"  # for verl's reward.reward_model.* keys: a random score head
    build_reward_model(len(tokenizer), tokenizer.pad_token_id, seed=seed + 1,
                       size=model_size).save_pretrained(reward_model_dir)
    tokenizer.save_pretrained(reward_model_dir)

    train, val = sample_prompts(np.random.default_rng(seed), train_size, val_size)
    paths = {
        "model": model_dir,
        "reward_model": reward_model_dir,
        "train": data_dir / "train.parquet",
        "val": data_dir / "val.parquet",
        "reward": root / "reward.py",
        "overrides": root / "overrides.txt",
        "ppo_overrides": root / "overrides_ppo.txt",
        "lora_overrides": root / "overrides_lora.txt",
        "lookup_train": data_dir / "lookup_train.parquet",
        "lookup_val": data_dir / "lookup_val.parquet",
        "lookup_reward": root / "lookup_reward.py",
        "agent_loops": root / AGENT_LOOPS_FILE,
        "agent_overrides": root / "overrides_agent.txt",
        "long_train": data_dir / "long_train.parquet",
        "long_val": data_dir / "long_val.parquet",
        "long_overrides": root / "overrides_long.txt",
    }
    train_rows, val_rows = make_rows(train, "train"), make_rows(val, "test")
    train_rows.to_parquet(paths["train"], index=False)
    val_rows.to_parquet(paths["val"], index=False)
    shutil.copyfile(reward_module.__file__, paths["reward"])
    paths["overrides"].write_text("\n".join(demo_overrides(root)) + "\n")
    paths["ppo_overrides"].write_text("\n".join(demo_overrides(root, critic=True)) + "\n")
    paths["lora_overrides"].write_text("\n".join(demo_overrides(root, lora=True)) + "\n")

    table = lookup.LookupTable.build(seed)
    train_keys, val_keys = lookup.sample_keys(table, np.random.default_rng(seed), train_size, val_size)
    lookup.make_rows(table, train_keys, "train").to_parquet(paths["lookup_train"], index=False)
    lookup.make_rows(table, val_keys, "test").to_parquet(paths["lookup_val"], index=False)
    shutil.copyfile(lookup_reward.__file__, paths["lookup_reward"])
    paths["agent_loops"].write_text(  # verl's agent-loop registry file: a list of {name, _target_, kwargs}
        f"- name: {LOOKUP_AGENT}\n  _target_: {lookup.LookupAgentLoop.__module__}.LookupAgentLoop\n  seed: {seed}\n"
        f"- name: {LONG_AGENT}\n  _target_: {long_tail.LongTailAgentLoop.__module__}.LongTailAgentLoop\n")
    paths["agent_overrides"].write_text("\n".join(demo_overrides(root, agent=True)) + "\n")

    lengths = long_tail.draw_response_tokens(seed, len(train) + len(val))  # the copy task's prompts
    long_tail.with_lengths(train_rows, lengths[:len(train)]).to_parquet(paths["long_train"], index=False)
    long_tail.with_lengths(val_rows, lengths[len(train):]).to_parquet(paths["long_val"], index=False)
    paths["long_overrides"].write_text("\n".join(demo_overrides(root, long=True)) + "\n")
    return paths
