"""verl's V1 sampler keys under the flag: `max_off_policy_threshold` (the most policy versions a trajectory may span)
bounds the pipeline's `generate_ahead_steps`, `max_off_policy_strategy` and `sync_refill_failed_groups` are done the
pipeline's way (said in the log), and the V1 replay buffer's own sampler class is refused naming the key."""

from __future__ import annotations

import logging

import pytest

from async_rl.core.errors import AsyncConfigError
from async_rl.core.verl_keys import replaced_settings
from async_rl.run_config import read_run_config
from helpers.lineage import compose_ppo

AHEAD = "+trainer.generate_ahead_steps"
SAMPLER = "trainer.v1.sampler"


def composed(demo_dir, extra: dict, ahead: int | None = None):
    from async_rl.demo import demo_overrides

    overrides = [o for o in demo_overrides(demo_dir, extra=extra) if not o.startswith(AHEAD + "=")]
    return compose_ppo(overrides + ([f"{AHEAD}={ahead}"] if ahead is not None else []))


@pytest.mark.parametrize("threshold,ahead,expected", [(1, None, 1), (3, None, 2), (None, None, 2), (4, 3, 3), (2, 2, 2),
                                                     (8, 17, 17)])  # verl's default 8 binds only its own V1 modes
def test_the_threshold_bounds_the_versions_a_trajectory_spans(demo_dir, threshold, ahead, expected, caplog):
    extra = {} if threshold is None else {f"{SAMPLER}.max_off_policy_threshold": threshold}
    with caplog.at_level(logging.WARNING, logger="async_rl.run_config"):
        run = read_run_config(composed(demo_dir, extra, ahead))
    assert run.async_cfg.generate_ahead_steps == expected
    assert run.async_cfg.max_staleness == expected - 1
    lowered = f"max_off_policy_threshold={threshold}: +trainer.generate_ahead_steps={threshold}"
    assert (lowered in caplog.text) == (threshold is not None and threshold < 2 and ahead is None)


def test_a_threshold_below_the_commands_own_bound_or_not_a_count_is_refused(demo_dir):
    with pytest.raises(AsyncConfigError, match=r"generate_ahead_steps=3; allowed: at most .*max_off_policy_threshold=2"):
        read_run_config(composed(demo_dir, {f"{SAMPLER}.max_off_policy_threshold": 2}, ahead=3))
    with pytest.raises(AsyncConfigError, match=r"max_off_policy_threshold=0; allowed: null or an int >= 1"):
        read_run_config(composed(demo_dir, {f"{SAMPLER}.max_off_policy_threshold": 0}))


def test_the_strategy_is_said_done_the_pipelines_way_and_a_sampler_class_is_refused(demo_dir):
    config = composed(demo_dir, {f"{SAMPLER}.max_off_policy_strategy": "wait"})
    read_run_config(config)
    assert any("max_off_policy_strategy" in line for line in replaced_settings(config))
    with pytest.raises(AsyncConfigError, match=r"trainer\.v1\.sampler\.custom_sampler\.path='my\.py'.*no replay buffer"):
        read_run_config(composed(demo_dir, {f"{SAMPLER}.custom_sampler.path": "my.py"}))
