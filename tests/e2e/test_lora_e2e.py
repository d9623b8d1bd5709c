"""LoRA end to end (the demo's `overrides_lora.txt` keys): a version carries the adapter alone, every
receiver serves the trainer's merged weights (a saved adapter's from the first step), and checkpoints go
round trip between the pipeline and verl's own trainer, whose CPU rollout serves the adapter too."""

from __future__ import annotations

from safetensors.torch import load_file

from async_rl.demo.task import LORA_OVERRIDES
from helpers.rows import every_step_with, step_rows
from helpers.runs import run_pipeline_reading_digests, run_verl
from param_update.buckets import tensor_digest

FLAG_OFF = {"+actor_rollout_ref.async_pipeline": False}
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # all-linear but lm_head
FP32_NOISE = 1e-4  # rollout vs trainer log-probs with the same weights (measured ~1e-7)
PRETRAINED_LAYER = "model.layers.0."  # the saved adapter's non-zero part; every other lora_B is zero, as at init


def save_adapter(demo_dir, path):
    """A PEFT adapter (all-linear, the demo's rank and alpha) whose lora_B is random on layer 0 (it changes
    what the model generates) and zero elsewhere (those weights change only by training)."""
    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(demo_dir / "model"), LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=int(LORA_OVERRIDES["actor_rollout_ref.model.lora_rank"]),
        lora_alpha=int(LORA_OVERRIDES["actor_rollout_ref.model.lora_alpha"]), target_modules="all-linear"))
    generator = torch.Generator().manual_seed(0)
    randomised = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name and f".{PRETRAINED_LAYER}" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
                randomised += 1
    assert randomised == len(ADAPTED)
    model.save_pretrained(path)


def test_a_pretrained_adapter_trained_is_served_merged_by_every_receiver_and_resumed_by_verls_trainer(
        demo_dir, tmp_path, ray_address):
    """The pipeline starts from a saved adapter (`lora_adapter_path`) on two train ranks (gathered from FSDP2
    shards, layer by layer), two logp ranks (PEFT models loading it) and two rollout servers (merging it onto
    their base): version 0 reaches the servers before anything generates and, k=1, every step's rollout
    log-probs are the trainer's, each version's adapter alone sent and served bit for bit. Its step-3
    checkpoint -> verl's synchronous trainer, flag off, on the CPU rollout (which merges the adapter verl
    sends it) resumes step 4 with the rollout's log-probs the trainer's: the resumed adapter is served."""
    ckpt = tmp_path / "ckpt"
    save_adapter(demo_dir, tmp_path / "adapter")
    common = {**LORA_OVERRIDES, "actor_rollout_ref.model.lora_adapter_path": str(tmp_path / "adapter"),
              "trainer.default_local_dir": str(ckpt), "trainer.test_freq": -1, "trainer.val_before_train": False,
              "trainer.resume_mode": "auto"}
    pipeline = {
        **common,
        "trainer.n_gpus_per_node": 4,  # 2 train ranks, 2 logp ranks, 2 rollout servers
        "trainer.total_training_steps": 3,
        "trainer.save_freq": 3,
        "trainer.generate_ahead_steps": 1,
        "+algorithm.proximal_logp_workers": "logp",
        "actor_rollout_ref.rollout.layered_summon": True,  # the adapter gathered one FSDP unit at a time
    }
    (tmp_path / "pipeline").mkdir()
    proc, result = run_pipeline_reading_digests(demo_dir, pipeline, tmp_path / "pipeline", env={"RAY_ADDRESS": ray_address})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    digests = result["digests"]
    assert set(digests) == {"actor_train", "logp", "rollout_server_0", "rollout_server_1"}
    trainer = digests["actor_train"]
    for receiver, held in digests.items():
        assert held == trainer, f"{receiver} differs from the trainer"
    base = load_file(str(demo_dir / "model" / "model.safetensors"))
    changed = {name for name, tensor in base.items() if tensor_digest(tensor) != trainer[name]}
    # every adapted Linear's weight changed (layer 1's only by training: its lora_B started at zero), nothing
    # else (biases, norms, embeddings frozen)
    adapted = {name for name in base if name.endswith(tuple(f".{p}.weight" for p in ADAPTED))}
    assert changed == adapted and any(not name.startswith(PRETRAINED_LAYER) for name in adapted)
    steps = every_step_with([{"step": s["training/global_step"], "data": s} for s in result["steps"]], 3,
                            ["rollout_corr/log_ppl_abs_diff", "async/param_update/bytes"])
    rank = int(LORA_OVERRIDES["actor_rollout_ref.model.lora_rank"])
    adapter_bytes = sum(rank * sum(base[name].shape) * 4 for name in changed)  # A: r x in, B: out x r, float32
    for step, metrics in steps.items():  # step 1's: the saved adapter was served from the first step
        assert metrics["async/staleness/max"] == 0
        assert metrics["rollout_corr/log_ppl_abs_diff"] < FP32_NOISE, (step, metrics["rollout_corr/log_ppl_abs_diff"])
        assert metrics["async/param_update/bytes"] == adapter_bytes  # the adapter, not the model
    assert (ckpt / "global_step_3" / "async_rl_state.pt").exists()

    # two trainer ranks, as the pipeline's (FSDP checkpoints are per world size)
    verl = {**common, **FLAG_OFF, "trainer.n_gpus_per_node": 2, "trainer.total_training_steps": 4,
            "trainer.save_freq": 4}
    code, out, rows = run_verl(demo_dir, verl, tmp_path / "verl", ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert "async-rl" not in out  # verl's trainer ran
    assert sorted(step_rows(rows)) == [4]
    assert step_rows(rows)[4]["training/rollout_probs_diff_max"] < FP32_NOISE, step_rows(rows)[4]
