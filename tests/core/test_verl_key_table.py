"""Every key of verl 0.9.1's PPO config has a row saying what the pipeline does with it
(async_rl/core/verl_key_table.py), and a key it does not honour is refused before Ray starts, naming it."""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from async_rl.core.errors import AsyncConfigError
from async_rl.core.prompts import model_tokenizer
from async_rl.core.verl_key_table import VERL_KEYS, Handling, row_for
from async_rl.core.verl_keys import (
    leaf_keys,
    raw_default,
    refuse_unsupported,
    replaced_settings,
    verl_defaults,
)
from async_rl.demo import demo_overrides
from async_rl.run_config import read_run_config, total_training_steps
from helpers.lineage import compose_ppo

VERL_KEY_NAMES = list(leaf_keys(verl_defaults()))
REFUSED_KEYS = [k for k in VERL_KEY_NAMES if row_for(k).handling is Handling.REFUSED]
REPLACED_KEYS = [k for k in VERL_KEY_NAMES if row_for(k).handling is Handling.REPLACED]


@pytest.fixture(scope="module")
def demo_config(demo_dir):
    return compose_ppo(demo_overrides(demo_dir))


def another_value(default):
    """A value of the default's kind that is not the default."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, dict):
        return {"set_by_the_command": 1}
    return "set_by_the_command"


def test_every_verl_key_has_a_row_and_every_row_names_verl_keys():
    assert len(VERL_KEY_NAMES) > 800  # the whole config, not a part of it
    assert [k for k in VERL_KEY_NAMES if row_for(k) is None] == []  # a new verl key must be decided
    for row in VERL_KEYS:  # a misspelt row would decide nothing
        assert any(k == row.prefix or k.startswith(row.prefix + ".") for k in VERL_KEY_NAMES), row.prefix
    assert len({row.prefix for row in VERL_KEYS}) == len(VERL_KEYS)


def test_the_demo_sets_nothing_refused_and_verls_defaults_pass(demo_config):
    refuse_unsupported(demo_config)
    assert REFUSED_KEYS and all(row_for(k).where for k in REFUSED_KEYS)


@pytest.mark.parametrize("key", REFUSED_KEYS)
def test_a_key_the_pipeline_does_not_honour_is_refused_naming_it(demo_config, key):
    config = demo_config.copy()
    value = another_value(raw_default(key) if "${" not in str(raw_default(key)) else False)
    OmegaConf.update(config, key, value, merge=False, force_add=True)
    with pytest.raises(AsyncConfigError, match="invalid config") as refused:
        refuse_unsupported(config)
    assert f"{key}={value!r}" in str(refused.value) and row_for(key).where in str(refused.value)


def test_an_interpolated_default_is_compared_as_the_command_resolves_it(demo_config):
    config = demo_config.copy()  # rollout.profiler.enable follows actor.profiler.enable by default
    assert "${" in raw_default("actor_rollout_ref.rollout.profiler.enable")
    refuse_unsupported(config)
    OmegaConf.update(config, "actor_rollout_ref.rollout.profiler.enable", True, merge=False)
    with pytest.raises(AsyncConfigError, match="actor_rollout_ref.rollout.profiler.enable=True"):
        refuse_unsupported(config)


def test_a_key_done_the_pipelines_own_way_is_logged_not_refused(demo_dir, demo_config, caplog):
    # the demo sizes verl's own worker pools for 2 cores (async_rl/demo/task.py): logged, not refused
    assert [line.split("=")[0] for line in replaced_settings(demo_config)] == [
        "actor_rollout_ref.rollout.agent.num_workers", "reward.num_workers",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units"]
    assert "data.gen_batch_size" in REPLACED_KEYS
    config = demo_config.copy()
    OmegaConf.update(config, "data.gen_batch_size", 64, merge=False)
    (line,) = [line for line in replaced_settings(config) if line.startswith("data.")]
    assert line.startswith("data.gen_batch_size=64 is not used: ") and "train_batch_size" in line
    with caplog.at_level(logging.WARNING, logger="async_rl.run_config"):
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={"data.gen_batch_size": 64})))
    assert "data.gen_batch_size=64 is not used" in caplog.text


@pytest.mark.parametrize("key,value,allowed", [
    ("actor_rollout_ref.actor.strategy", "megatron", "fsdp or fsdp2"),
    ("critic.strategy", "megatron", "fsdp or fsdp2"),
])
def test_a_value_the_pipeline_cannot_run_is_refused(demo_config, key, value, allowed):
    config = demo_config.copy()
    OmegaConf.update(config, key, value, merge=False)
    with pytest.raises(AsyncConfigError, match=f"{key}='{value}'.*{allowed}"):
        refuse_unsupported(config)


def test_train_max_samples_caps_the_steps_as_verls_dataset_caps_the_rows(demo_config):
    config = demo_config.copy()
    OmegaConf.update(config, "trainer.total_training_steps", None, merge=False)
    OmegaConf.update(config, "trainer.total_epochs", 2, merge=False)
    batch = int(config.data.train_batch_size)
    assert total_training_steps(config, 10 * batch) == 20
    OmegaConf.update(config, "data.train_max_samples", 3 * batch + 1, merge=False)
    assert total_training_steps(config, 10 * batch) == 6
    OmegaConf.update(config, "data.train_max_samples", 100 * batch, merge=False)
    assert total_training_steps(config, 10 * batch) == 20


def test_the_pipelines_tokenizer_is_verls_model_config_one(demo_config, tmp_path):
    config = demo_config.copy()
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    OmegaConf.update(config, "actor_rollout_ref.model.custom_chat_template", template, merge=False)
    tokenizer = model_tokenizer(config)
    assert tokenizer.chat_template == template
    OmegaConf.update(config, "actor_rollout_ref.model.tokenizer_path", str(tmp_path / "none"), merge=False)
    with pytest.raises(Exception, match="none"):  # the tokenizer comes from tokenizer_path, not model.path
        model_tokenizer(config)


def test_a_key_absent_from_the_config_is_not_taken_for_one_set():
    refuse_unsupported(OmegaConf.create({"trainer": {"save_freq": 2}, "algorithm": {"adv_estimator": "grpo"}}))


def test_sequence_parallelism_runs_on_cpu_where_the_heads_divide(demo_config, demo_dir):
    """Ulysses runs on CPU (verl_patches/ulysses_sdpa.py); a size that does not divide the model's heads is
    refused before Ray starts, naming the key (verl would fail once its workers are up)."""
    key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    config = demo_config.copy()
    OmegaConf.update(config, key, 2, merge=False)
    assert config.trainer.device == "cpu"
    refuse_unsupported(config)
    with pytest.raises(AsyncConfigError, match=f"{key}=2.*a divisor of the 1 attention heads"):
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={key: 2})))
