"""verl's own synchronous trainer on CPU with this package's rollout backend (flag off)."""

from __future__ import annotations

from omegaconf import OmegaConf

from conftest import compose_ppo, run_verl, step_rows, val_rows
from verl_patches.verl_trainer_on_cpu import WORKER_ENV, prepare, wants_cpu_rollout

FLAG_OFF = {"+actor_rollout_ref.async_pipeline": False}


def test_only_a_cpu_rollout_on_a_cpu_device_is_taken_over():
    base = {"trainer": {"device": "cpu"}, "actor_rollout_ref": {"rollout": {"name": "cpu"}}}
    assert wants_cpu_rollout(OmegaConf.create(base))
    assert not wants_cpu_rollout(OmegaConf.merge(base, {"actor_rollout_ref": {"async_pipeline": True}}))
    assert not wants_cpu_rollout(OmegaConf.merge(base, {"actor_rollout_ref": {"rollout": {"name": "vllm"}}}))
    assert not wants_cpu_rollout(OmegaConf.merge(base, {"trainer": {"device": "cuda"}}))


def test_prepare_sets_up_ray_for_cpu_workers(demo_dir, monkeypatch):
    from async_rl.config import CONFIG_KEYS
    from async_rl.demo import demo_overrides

    for key in WORKER_ENV:
        monkeypatch.delenv(key, raising=False)
    config = compose_ppo(demo_overrides(demo_dir, extra=FLAG_OFF))
    assert wants_cpu_rollout(config)
    prepare(config)
    assert all(OmegaConf.select(config, key) is None for key in CONFIG_KEYS)  # verl's dataclasses reject them
    ray_init = config.ray_kwargs.ray_init
    assert ray_init.num_gpus == 2 and ray_init.num_cpus >= 16  # logical: one "GPU" per trainer process
    assert dict(ray_init.runtime_env.env_vars) == WORKER_ENV


def test_verls_sync_trainer_trains_with_the_cpu_backend(demo_dir, tmp_path):
    """The demo command with the flag off: verl's trainer, our replicas, weights synced every step."""
    extra = {**FLAG_OFF, "trainer.total_training_steps": 2, "trainer.test_freq": 2}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900)
    assert code == 0, out[-4000:]
    assert "async-rl" not in out  # not the pipeline's progress bar: verl's trainer ran
    steps = step_rows(rows)
    assert sorted(steps) == [1, 2]
    for metrics in steps.values():
        # the server's log-probs equal the trainer's: it holds the weights of the step (synced each update)
        assert metrics["training/rollout_probs_diff_max"] < 1e-3, metrics["training/rollout_probs_diff_max"]
    assert 2 in val_rows(rows)
