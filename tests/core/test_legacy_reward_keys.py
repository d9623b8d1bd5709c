"""verl's legacy top-level reward keys (`reward_model.*`, `custom_reward_function.*`, `sandbox_fusion.*`; verl's
`ppo_trainer/run_qwen2-7b_rm_seq_balance.sh` and `gspo_trainer/test_gspo_3b_math.sh` write them) are read as
verl 0.9.1's `migrate_legacy_reward_impl` maps them onto `reward.*`, with a log line naming the new keys."""

from __future__ import annotations

import logging

from async_rl.core.legacy_reward_keys import migrate_legacy_reward_keys
from async_rl.demo import demo_overrides
from async_rl.run_config import read_run_config
from helpers.lineage import compose_ppo


def legacy_keys(demo_dir) -> dict:
    """The rm_seq_balance script's reward-model keys (on the CPU backend, the demo's reward model), the gspo
    script's reward manager and kwargs, and the legacy reward function and sandbox sections."""
    return {"reward_model.enable": True, "reward_model.model.path": str(demo_dir / "reward_model"),
            "reward_model.rollout.name": "cpu", "reward_model.rollout.tensor_model_parallel_size": 1,
            "reward_model.rollout.prompt_length": 64, "reward_model.rollout.response_length": 8,
            "reward_model.num_workers": 2, "reward_model.reward_manager": "dapo",
            "+reward_model.reward_kwargs.max_resp_len": 8, "+reward_model.reward_kwargs.overlong_buffer_cfg.enable": False,
            "custom_reward_function.path": str(demo_dir / "reward.py"),
            "sandbox_fusion.url": "http://127.0.0.1:1/run_code", "sandbox_fusion.max_concurrent": 4}


def test_the_legacy_keys_map_as_verls_migration_maps_them(demo_dir):
    config = compose_ppo(demo_overrides(demo_dir, extra=legacy_keys(demo_dir)))
    migrated, line = migrate_legacy_reward_keys(config)
    reward = migrated.reward
    assert reward.reward_model.enable is True and reward.reward_model.model_path == str(demo_dir / "reward_model")
    assert reward.reward_model.rollout.name == "cpu" and reward.reward_model.rollout.tensor_model_parallel_size == 1
    assert reward.reward_model.rollout.prompt_length == 64 and reward.reward_model.rollout.response_length == 8
    assert reward.num_workers == 2 and reward.reward_manager.name == "dapo"
    assert reward.reward_kwargs.max_resp_len == 8 and reward.reward_kwargs.overlong_buffer_cfg.enable is False
    assert reward.custom_reward_function.path == str(demo_dir / "reward.py")
    assert reward.custom_reward_function.name == "compute_score"  # the legacy section's null: verl's default
    assert reward.sandbox_fusion.url == "http://127.0.0.1:1/run_code" and reward.sandbox_fusion.max_concurrent == 4
    assert not {"reward_model", "custom_reward_function", "sandbox_fusion"} & set(migrated)
    assert config.reward_model.enable is True and config.reward.reward_model.enable is False  # the input as it was
    for legacy, new in (("reward_model.model.path=", "reward.reward_model.model_path="),
                        ("reward_model.reward_manager='dapo'", "reward.reward_manager.name='dapo'"),
                        ("sandbox_fusion.url=", "reward.sandbox_fusion.url=")):
        assert legacy in line and new in line, line
    untouched = compose_ppo(demo_overrides(demo_dir))
    assert migrate_legacy_reward_keys(untouched) == (untouched, None)


def test_the_run_takes_the_reward_model_the_legacy_keys_name_and_says_so(demo_dir, caplog):
    keys = {k: v for k, v in legacy_keys(demo_dir).items() if not k.startswith(("sandbox", "custom"))}
    with caplog.at_level(logging.WARNING, logger="async_rl.run_config"):
        run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra=keys)))
    rm = run.config.reward.reward_model
    assert rm.enable is True and rm.model_path == str(demo_dir / "reward_model") and rm.rollout.name == "cpu"
    assert "reward_model" not in run.config and run.config.reward.reward_manager.name == "dapo"
    assert any("verl's legacy keys reward_model.num_workers=2" in r.message and "(write those keys instead)" in r.message
               for r in caplog.records)
