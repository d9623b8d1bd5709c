"""LoRA end to end (the demo's `overrides_lora.txt` keys): a version carries the adapter alone, every
receiver serves the trainer's merged weights, and checkpoints go round trip between the pipeline and
verl's own trainer, whose CPU rollout serves the adapter too."""

from __future__ import annotations

from safetensors.torch import load_file

from async_rl.demo.task import LORA_OVERRIDES
from conftest import every_step_with, run_pipeline_reading_digests, run_verl, step_rows
from param_update.buckets import tensor_digest

FLAG_OFF = {"+actor_rollout_ref.async_pipeline": False}
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # all-linear but lm_head
FP32_NOISE = 1e-4  # rollout vs trainer log-probs with the same weights (measured ~1e-7)


def test_every_receiver_serves_the_trained_adapter_merged(demo_dir, tmp_path, ray_address):
    """Two train ranks (the adapter gathered from FSDP2 shards, layer by layer), two logp ranks (PEFT models loading the
    adapter), two rollout servers (merging it onto their base); k=1, so every step's rollout log-probs
    are the trainer's: each version's adapter reached the servers."""
    extra = {
        **LORA_OVERRIDES,
        "trainer.n_gpus_per_node": 4,
        "trainer.total_training_steps": 3,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
        "trainer.generate_ahead_steps": 1,
        "+algorithm.proximal_logp_workers": "logp",
        "actor_rollout_ref.rollout.layered_summon": True,  # the adapter gathered one FSDP unit at a time
    }
    proc, result = run_pipeline_reading_digests(demo_dir, extra, tmp_path, env={"RAY_ADDRESS": ray_address})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    digests = result["digests"]
    assert set(digests) == {"actor_train", "logp", "rollout_server_0", "rollout_server_1"}
    trainer = digests["actor_train"]
    for receiver, held in digests.items():
        assert held == trainer, f"{receiver} differs from the trainer"
    base = load_file(str(demo_dir / "model" / "model.safetensors"))
    changed = {name for name, tensor in base.items() if tensor_digest(tensor) != trainer[name]}
    # every adapted Linear's weight changed (trained), nothing else (biases, norms, embeddings frozen)
    assert changed == {name for name in base if name.endswith(tuple(f".{p}.weight" for p in ADAPTED))}
    steps = every_step_with([{"step": s["training/global_step"], "data": s} for s in result["steps"]], 3,
                            ["rollout_corr/log_ppl_abs_diff", "async/param_update/bytes"])
    rank = int(LORA_OVERRIDES["actor_rollout_ref.model.lora_rank"])
    adapter_bytes = sum(rank * sum(base[name].shape) * 4 for name in changed)  # A: r x in, B: out x r, float32
    for step, metrics in steps.items():
        assert metrics["async/staleness/max"] == 0
        assert metrics["rollout_corr/log_ppl_abs_diff"] < FP32_NOISE, (step, metrics["rollout_corr/log_ppl_abs_diff"])
        assert metrics["async/param_update/bytes"] == adapter_bytes  # the adapter, not the model


def test_the_adapter_goes_round_trip_between_the_pipeline_and_verls_trainer(demo_dir, tmp_path, ray_address):
    """Pipeline steps 1-2 (saved) -> verl's synchronous trainer, flag off, on the CPU rollout (which merges
    the adapter verl sends it) resumes step 3: the rollout's log-probs are the trainer's, so the resumed
    adapter is the one served. (Both load checkpoints with verl's `load_checkpoint`; the pipeline's
    resume then sends the loaded adapter as a sync, which the next test covers from a saved adapter.)"""
    ckpt = tmp_path / "ckpt"
    common = {**LORA_OVERRIDES, "trainer.default_local_dir": str(ckpt), "trainer.test_freq": -1,
              "trainer.val_before_train": False, "trainer.resume_mode": "auto"}
    code, out, rows = run_verl(demo_dir, {**common, "trainer.total_training_steps": 2, "trainer.save_freq": 2,
                                          "trainer.generate_ahead_steps": 1}, tmp_path / "first", ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert sorted(step_rows(rows)) == [1, 2] and (ckpt / "global_step_2" / "async_rl_state.pt").exists()

    # one trainer rank, as the pipeline's (FSDP checkpoints are per world size)
    verl = {**common, **FLAG_OFF, "trainer.n_gpus_per_node": 1, "trainer.total_training_steps": 3,
            "trainer.save_freq": 3}
    code, out, rows = run_verl(demo_dir, verl, tmp_path / "verl", ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert "async-rl" not in out  # verl's trainer ran
    assert sorted(step_rows(rows)) == [3]
    assert step_rows(rows)[3]["training/rollout_probs_diff_max"] < FP32_NOISE, step_rows(rows)[3]


def test_a_pretrained_adapter_is_served_from_the_first_step(demo_dir, tmp_path, ray_address):
    """`lora_adapter_path`: the train ranks start from a saved adapter (not zero), so the servers, which
    load the base, are sent version 0 before anything generates: step 1's rollout log-probs are the
    trainer's already."""
    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(demo_dir / "model"), LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=int(LORA_OVERRIDES["actor_rollout_ref.model.lora_rank"]),
        lora_alpha=int(LORA_OVERRIDES["actor_rollout_ref.model.lora_alpha"]), target_modules="all-linear"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(tmp_path / "adapter")
    (tmp_path / "run").mkdir()
    extra = {**LORA_OVERRIDES, "actor_rollout_ref.model.lora_adapter_path": str(tmp_path / "adapter"),
             "trainer.total_training_steps": 2, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "trainer.generate_ahead_steps": 1}
    proc, result = run_pipeline_reading_digests(demo_dir, extra, tmp_path / "run", env={"RAY_ADDRESS": ray_address})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert result["digests"]["rollout_server_0"] == result["digests"]["actor_train"]
    first = next(s for s in result["steps"] if s["training/global_step"] == 1)
    assert first["rollout_corr/log_ppl_abs_diff"] < FP32_NOISE, first["rollout_corr/log_ppl_abs_diff"]
