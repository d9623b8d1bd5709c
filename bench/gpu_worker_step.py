"""verl's FSDP2 engine training on one device through the pipeline's trainer worker (`PipelineWorker`,
async_rl/training/workers.py), in one process with no Ray cluster: the GPU check kit's trainer part.

    python bench/gpu_worker_step.py --device cuda --sizes 0.5B,1.5B
    python bench/gpu_worker_step.py --device cpu --sizes tiny    # CI: tests/training/test_gpu_worker_step.py

Per size (`bench.gpu_check.SIZES`: Qwen2.5 shapes, random init, built locally):
- the model (bf16) and the demo's tokenizer are written to a temporary folder, verl's `ppo_trainer` config is
  composed around it, and `PipelineWorker(role="actor")` is built and `init_model()`ed as rank 0 of 1
  (verl's FSDP2 engine and optimizer; the worker's methods are called directly, the way Ray's actor would);
- per step (`--steps`, 2): log-probs of a random batch (`engine_calls.compute_log_prob`), one PPO update on
  it with random advantages (`engine_calls.update_actor`, verl's loss, backward and optimizer step), then the
  sync's gather as the worker does it: verl's `get_per_tensor_param`, packed into buckets on the device
  (`pack_buckets(device=None)`).
Prints per step the seconds of each, verl's loss and grad norm, the gather's GB/s against the device's own
copy, and whether the update changed the weights. Exit 1 if a loss or grad norm is not finite or an update
leaves the weights as they were.

Ray is imported (verl imports it) but never started. On a GPU the attention is flash-attention's where the
`flash_attn` package is installed (verl's padding-free path), else sdpa on padded micro-batches
(`use_remove_padding=False`): sdpa on a packed micro-batch would attend across samples.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.command import command_line  # noqa: E402
from bench.gpu_check import (COPY_BYTES, GB, SIZES, copy_rates, fingerprint, free_port, parse_checked,  # noqa: E402
                             qwen2, sync)
from param_update.buckets import pack_buckets  # noqa: E402

BUCKET_BYTES = 512 << 20  # the pipeline's default preduce bucket (param_update_preduce_bucket_size_mb)
LR = 1e-5


def write_model(size: str, path: str) -> int:
    """A random-init Qwen2 of `size` (bf16) and the demo's tokenizer saved in `path`; returns the tokenizer's
    vocabulary size (the batch's token ids stay below it)."""
    from async_rl.demo.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(model_max_length=4096)
    model = qwen2(size, "cpu", seed=0)
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return len(tokenizer)


def attention_overrides(device: str) -> list[str]:
    """verl keys for the attention: flash-attention's padding-free path where it is installed (GPU), else sdpa;
    sdpa on padded micro-batches on a GPU, on the CPU on packed ones (verl_patches.packed_sdpa keeps samples
    apart there)."""
    if device == "cuda":
        if importlib.util.find_spec("flash_attn") is not None:
            return ["+actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2"]
        return ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                "actor_rollout_ref.model.use_remove_padding=False"]
    fp32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"  # the demo's CPU precision
    return ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={fp32}"]


def actor_config(model_path: str, device: str, rows: int, max_tokens: int):
    """verl's `ppo_trainer` config composed as verl's trainer composes it, with the actor on `model_path`."""
    import verl
    from hydra import compose, initialize_config_dir

    overrides = [
        f"actor_rollout_ref.model.path={model_path}",
        f"trainer.device={device}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.use_torch_compile=False",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max_tokens}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={max_tokens}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        *attention_overrides(device),
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def random_batch(rows: int, prompt_tokens: int, response_tokens: int, vocab: int, seed: int):
    """A verl batch of `rows` random prompts and responses (response lengths from half to all of
    `response_tokens`), in the pipeline's layout (`build_batch`)."""
    from async_rl.core.messages import Sample, build_batch

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        n = int(torch.randint(response_tokens // 2, response_tokens + 1, (1,), generator=g))
        samples.append(Sample(uid=f"row{i}", prompt_ids=torch.randint(1, vocab, (prompt_tokens,), generator=g).tolist(),
                              response_ids=torch.randint(1, vocab, (n,), generator=g).tolist(),
                              rollout_log_probs=[-1.0] * n, token_versions=[0] * n))
    return build_batch(samples, prompt_tokens, response_tokens, pad_token_id=0)


def start_rank(device: str) -> None:
    """This process as rank 0 of 1 (the env verl's worker reads; Ray would set it), on the CPU with verl's CPU
    platform selected, as the pipeline's CPU runs do."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    if device == "cpu":
        from verl_patches.cpu_patches import set_engine_device_env, use_cpu_platform

        use_cpu_platform()
        set_engine_device_env()


def gathered(worker, device: str) -> tuple[float, int, list[int]]:
    """The sync's gather as `PipelineWorker.send_weight_buckets` does it (verl's per-tensor full weights,
    packed into buckets, here on the device): (seconds, bytes, each tensor's fingerprint)."""
    sync(device)
    start = time.perf_counter()
    nbytes = sum(bucket.nbytes for bucket in pack_buckets(worker._sent_tensors(), BUCKET_BYTES, version=0, device=None))
    sync(device)
    seconds = time.perf_counter() - start
    prints = fingerprint({name: t for name, t in worker._sent_tensors()})
    return seconds, nbytes, prints


def step_size(size: str, device: str, steps: int, rows: int, prompt_tokens: int, response_tokens: int) -> bool:
    """Build the worker on a model of `size` and run `steps` steps; prints them; returns whether all passed."""
    from async_rl.training import engine_calls
    from async_rl.training.workers import PipelineWorker

    ok = True
    with tempfile.TemporaryDirectory(prefix=f"gpu_worker_step_{size}_") as model_path:
        t0 = time.perf_counter()
        vocab = write_model(size, model_path)
        config = actor_config(model_path, device, rows, max_tokens=rows * (prompt_tokens + response_tokens))
        t1 = time.perf_counter()
        worker = PipelineWorker(config.actor_rollout_ref, role="actor", on_cpu=device == "cpu")
        worker.init_model()
        sync(device)
        t2 = time.perf_counter()
        print(f"[{size}] model written in {t1 - t0:.1f} s; PipelineWorker(role=actor) built and verl's FSDP2 engine "
              f"initialised in {t2 - t1:.1f} s", flush=True)
        rate = copy_rates(device, COPY_BYTES[device])["device copy"]
        _, _, before = gathered(worker, device)
        temperature = float(config.actor_rollout_ref.rollout.temperature)
        for step in range(1, steps + 1):
            batch = random_batch(rows, prompt_tokens, response_tokens, vocab, seed=step)
            sync(device)
            a = time.perf_counter()
            log_probs = engine_calls.compute_log_prob(worker, batch, temperature)
            sync(device)
            b = time.perf_counter()
            batch.batch["old_log_probs"] = log_probs
            batch.batch["advantages"] = torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(step))
            metrics = engine_calls.update_actor(worker, batch, config.actor_rollout_ref)
            sync(device)
            c = time.perf_counter()
            gather_s, nbytes, after = gathered(worker, device)
            loss, grad_norm = float(metrics["actor/pg_loss"]), float(metrics["actor/grad_norm"])
            changed = sum(x != y for x, y in zip(before, after))
            passed = math.isfinite(loss) and math.isfinite(grad_norm) and changed > 0
            ok = ok and passed
            print(f"[{size}] step {step}: log-prob {b - a:.3f} s, update {c - b:.3f} s (pg_loss {loss:.4f}, "
                  f"grad_norm {grad_norm:.4f}), gather {gather_s:.3f} s {nbytes / gather_s / GB:.2f} GB/s "
                  f"({nbytes / gather_s / GB / rate:.3f} x device copy) of {nbytes / GB:.3f} GB; "
                  f"{changed} of {len(after)} tensors changed{'' if passed else ' FAILED'}", flush=True)
            before = after
        del worker
    if device == "cuda":
        torch.cuda.empty_cache()
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sizes", default="0.5B,1.5B", help=f"comma-separated, of {','.join(SIZES)}")
    parser.add_argument("--steps", type=int, default=2, help="training steps per size")
    parser.add_argument("--rows", type=int, help="rows per batch (default: 16 on cuda, 4 on cpu)")
    parser.add_argument("--prompt-tokens", type=int, help="default: 128 on cuda, 4 on cpu")
    parser.add_argument("--response-tokens", type=int, help="default: 512 on cuda, 8 on cpu")
    args, sizes = parse_checked(parser)
    gpu = args.device == "cuda"
    rows = args.rows or (16 if gpu else 4)
    prompt_tokens = args.prompt_tokens or (128 if gpu else 4)
    response_tokens = args.response_tokens or (512 if gpu else 8)
    print(command_line(), flush=True)
    start_rank(args.device)
    import ray
    import verl

    print(f"torch {torch.__version__}, verl {verl.__version__}, ray {ray.__version__} (not started)"
          + (f", {torch.cuda.get_device_name()}" if gpu else ""), flush=True)
    print("verl keys: " + " ".join(attention_overrides(args.device)), flush=True)
    ok = all([step_size(size, args.device, args.steps, rows, prompt_tokens, response_tokens) for size in sizes])
    print(f"ray started: {ray.is_initialized()}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
