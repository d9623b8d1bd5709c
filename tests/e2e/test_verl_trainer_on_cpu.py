"""verl's own synchronous trainer on CPU with this package's rollout backend (flag off)."""

from __future__ import annotations

from omegaconf import OmegaConf, open_dict

from async_rl.verl_trainer_on_cpu import WORKER_ENV, prepare, wants_cpu_rollout
from helpers.lineage import compose_ppo, dumped_step_inputs, expected_step_inputs, read_jsonl
from helpers.rows import step_rows, val_rows
from helpers.runs import run_verl

FLAG_OFF = {"+actor_rollout_ref.async_pipeline": False}


def test_only_a_cpu_rollout_on_a_cpu_device_is_taken_over():
    base = {"trainer": {"device": "cpu"}, "actor_rollout_ref": {"rollout": {"name": "cpu"}}}
    assert wants_cpu_rollout(OmegaConf.create(base))
    assert not wants_cpu_rollout(OmegaConf.merge(base, {"actor_rollout_ref": {"async_pipeline": True}}))
    assert not wants_cpu_rollout(OmegaConf.merge(base, {"actor_rollout_ref": {"rollout": {"name": "vllm"}}}))
    assert not wants_cpu_rollout(OmegaConf.merge(base, {"trainer": {"device": "cuda"}}))


def test_prepare_sets_up_ray_for_cpu_workers(demo_dir, monkeypatch):
    from async_rl.core.config import CONFIG_KEYS
    from async_rl.demo import demo_overrides

    for key in WORKER_ENV:
        monkeypatch.delenv(key, raising=False)
    config = compose_ppo(demo_overrides(demo_dir, extra=FLAG_OFF))
    assert wants_cpu_rollout(config)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    prepare(config)
    assert all(OmegaConf.select(config, key) is None for key in CONFIG_KEYS)  # verl's dataclasses reject them
    ray_init = config.ray_kwargs.ray_init
    assert ray_init.num_gpus == 2 and ray_init.num_cpus >= 16  # logical: one "GPU" per trainer process
    assert ray_init.address == "local"  # not a cluster an earlier `ray start` (or ray's Cluster) advertised
    assert dict(ray_init.runtime_env.env_vars) == WORKER_ENV

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # joining a running cluster: its resources are its own
    joined = compose_ppo(demo_overrides(demo_dir, extra=FLAG_OFF))
    prepare(joined)
    assert all(joined.ray_kwargs.ray_init.get(key) is None for key in ("address", "num_cpus", "num_gpus"))


def test_a_teacher_gets_devices_of_its_own_beside_the_trainers(demo_dir, monkeypatch):
    """`distillation.enabled=True` under verl's own trainer: Ray gets the teacher pool's devices beside the
    trainer's (verl places the teachers on a resource pool of their own)."""
    from async_rl.demo import demo_overrides

    for key in WORKER_ENV:  # prepare() sets them in this process: put back after the test
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    teacher = {"distillation.enabled": True, "distillation.nnodes": 1, "distillation.n_gpus_per_node": 3,
               "distillation.teacher_models.teacher_model.model_path": str(demo_dir / "model")}
    config = compose_ppo(demo_overrides(demo_dir, extra={**FLAG_OFF, **teacher}))
    prepare(config)
    assert config.ray_kwargs.ray_init.num_gpus == 2 + 3


def test_verls_fully_async_main_is_set_up_for_cpu_at_auto_set_device(demo_dir, monkeypatch):
    """verl's fully_async_main never calls validate_config: its auto_set_device call sets up the CPU run,
    with Ray devices for its trainer and its rollout and logical CPUs for its 23-CPU actors."""
    import verl.utils.device as device_module

    from async_rl.demo import demo_overrides

    for key in WORKER_ENV:
        monkeypatch.delenv(key, raising=False)
    config = compose_ppo(demo_overrides(demo_dir, extra=FLAG_OFF))
    with open_dict(config):  # what fully_async_ppo_trainer.yaml adds to verl's ppo_trainer
        config.async_training = {"staleness_threshold": 1.0}
        config.rollout = {"nnodes": 1, "n_gpus_per_node": 1}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    device_module.auto_set_device(config)
    ray_init = config.ray_kwargs.ray_init
    assert ray_init.address == "local"
    assert config.trainer.device == "cpu" and ray_init.num_gpus == 2 + 1 and ray_init.num_cpus >= 48
    assert dict(ray_init.runtime_env.env_vars) == WORKER_ENV


def test_checkpoints_round_trip_between_the_pipeline_and_verls_sync_trainer(demo_dir, tmp_path, ray_address):
    """PPO with a critic: pipeline steps 1-2 -> verl's synchronous trainer (flag off, our CPU replicas)
    resumes actor and critic for steps 3-4 -> the pipeline resumes verl's checkpoint for step 5 (critic
    version 4). verl's own trainer reads the pipeline's checkpoint and the other way round; every step
    trains verl's dataloader's prompts."""
    ckpt, dumps = tmp_path / "ckpt", tmp_path / "dumps"
    common = {"trainer.save_freq": 2, "trainer.default_local_dir": str(ckpt), "trainer.rollout_data_dir": str(dumps),
              "trainer.resume_mode": "auto", "trainer.test_freq": -1, "trainer.val_before_train": False}
    # 2 train/critic ranks (sharing 2 devices), as verl has, and a replica on a third device; k=1 (on-policy
    # PPO; test_critic_e2e runs k=3)
    pipeline = {**common, "trainer.n_gpus_per_node": 4, "+trainer.use_nodes_ratios": [0.5, 0.25, 0.25, 0.25, 0.5],
                "+trainer.generate_ahead_steps": 1}

    contents = {"actor_rollout_ref.actor.checkpoint.save_contents": ["model", "optimizer", "extra", "hf_model"]}
    code, out, rows = run_verl(demo_dir, {**pipeline, **contents, "trainer.total_training_steps": 2}, tmp_path / "first",
                                 critic=True, ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert sorted(step_rows(rows)) == [1, 2] and (ckpt / "global_step_2" / "async_rl_state.pt").exists()
    for step, metrics in step_rows(rows).items():  # on-policy, and each batch's values from critic version step - 1
        assert metrics["async/staleness/max"] == 0 and metrics["async/critic_version"] == step - 1, metrics
    critic_dir = ckpt / "global_step_2" / "critic"
    assert (critic_dir / "model_world_size_2_rank_0.pt").exists() and (critic_dir / "optim_world_size_2_rank_1.pt").exists()
    assert_verls_merger_reads(ckpt / "global_step_2" / "actor", tmp_path / "merged")

    extra = {**common, **FLAG_OFF, "trainer.total_training_steps": 4, "trainer.test_freq": 4}
    code, out, rows = run_verl(demo_dir, extra, tmp_path / "verl", timeout_s=900, critic=True, ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert "async-rl" not in out  # not the pipeline's progress bar: verl's trainer ran
    steps = step_rows(rows)
    assert sorted(steps) == [3, 4]  # verl resumed the pipeline's step 2
    for metrics in steps.values():
        # the server's log-probs equal the trainer's: it holds the resumed weights, synced each update
        assert metrics["training/rollout_probs_diff_max"] < 1e-3, metrics["training/rollout_probs_diff_max"]
        assert "critic/vf_loss" in metrics
    assert 4 in val_rows(rows)
    assert (ckpt / "global_step_4" / "critic").is_dir()
    assert (ckpt / "global_step_4" / "data.pt").exists() and not (ckpt / "global_step_4" / "async_rl_state.pt").exists()

    last = {**pipeline, "trainer.total_training_steps": 5, "trainer.test_freq": 5, "trainer.validation_data_dir": str(tmp_path / "val"),
            "trainer.del_local_ckpt_after_load": True}
    code, out, rows = run_verl(demo_dir, last, tmp_path / "last", critic=True, ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert f"resuming from {ckpt}/global_step_4 (step 4, written by verl)" in out
    assert sorted(step_rows(rows)) == [5] and step_rows(rows)[5]["async/critic_version"] == 4
    assert dumped_step_inputs(dumps) == expected_step_inputs(demo_dir, 5)
    assert (ckpt / "global_step_4" / "actor" / "model_world_size_2_rank_0.pt").exists()  # verl deletes remote copies only
    val = read_jsonl(tmp_path / "val" / "5.jsonl")  # the final validation, in verl's dump format
    assert len(val) == 32 and set(val[0]) == {"input", "output", "gts", "score", "step"} and val[0]["step"] == 5


def assert_verls_merger_reads(actor_dir, target):
    """`python -m verl.model_merger merge` turns the pipeline's shards into an HF model equal to the
    `hf_model` the checkpoint holds (save_contents): two of verl's own readers of the shards agree."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    proc = subprocess.run([sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir",
                           str(actor_dir), "--target_dir", str(target)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    merged = load_file(str(next(target.glob("*.safetensors"))))
    saved = load_file(str(next((actor_dir / "huggingface").glob("*.safetensors"))))
    shared = set(merged) & set(saved)
    assert len(shared) >= 20, (sorted(merged)[:5], sorted(saved)[:5])
    for name in shared:  # the merger writes bf16 (verl's default); the checkpoint's hf_model keeps the trainer's fp32
        assert torch.equal(merged[name], saved[name].to(merged[name].dtype)), name
