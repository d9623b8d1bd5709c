"""Benchmark: what a checkpoint costs training, and what a resume costs.

1. Save (two FSDP2 train ranks of verl's engine worker, synthetic Qwen2 models in float32
   with AdamW state, after one training step), each way in turn, `--repeats` times:
   - sync: verl's own `save_checkpoint`, training waits for every file (verl's trainer);
   - pipeline: `snapshot_checkpoint` (verl's save with its writes captured as host copies,
     async_rl/training/checkpoint_writer.py), the only part training waits for, then the files
     written by a background thread (fsync'ed) while a training step runs beside it.
   Goal: blocked (the snapshot) <= 10% of the sync save. Also the step's slowdown while the
   write runs beside it, against the same step alone.
2. Resume (the demo through verl's command line with the flag): seconds from the command's
   start to its first training step, from scratch and resumed from a checkpoint, and what
   the resume saves or redoes: the batches generated ahead of a checkpoint are not saved;
   the bench prints the generation time a resume spends on them (the first step's wait)
   against what saving them would write at every checkpoint.

    python bench/checkpoint.py [--sizes 10M,100M] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from bench.command import command_line  # noqa: E402


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_dir(size: str, root: Path) -> Path:
    """A synthetic Qwen2 of `size` (bench/param_update.py's sizes) with the demo's tokenizer."""
    from async_rl.demo.tokenizer import build_tokenizer

    path = root / f"model_{size}"
    _load("param_update").build_model(size, seed=0).save_pretrained(path)
    build_tokenizer(model_max_length=128).save_pretrained(path)
    return path


def verl_config(demo_dir: Path, model_path: Path):
    import verl
    from hydra import compose, initialize_config_dir

    from async_rl.core.config import strip_async_keys
    from async_rl.demo import demo_overrides

    extra = {"actor_rollout_ref.model.path": str(model_path), "actor_rollout_ref.rollout.n": 1,
             "actor_rollout_ref.actor.ppo_mini_batch_size": 16}
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        config = compose("ppo_trainer", overrides=demo_overrides(demo_dir, extra=extra))
    strip_async_keys(config)
    return config


def training_batch(vocab: int, rows: int = 16, seed: int = 0):
    """A fixed batch of short random responses (what the step trains does not matter here)."""
    from async_rl.core.messages import Sample, build_batch

    rng = np.random.default_rng(seed)
    samples = [Sample(uid=f"r{i}", prompt_ids=[1, 2, 3], response_ids=[int(t) for t in rng.integers(1, vocab, 24)],
                      rollout_log_probs=[-1.0] * 24, token_versions=[0] * 24) for i in range(rows)]
    batch = build_batch(samples, max_prompt_length=4, max_response_length=32, pad_token_id=0)
    batch.batch["advantages"] = torch.randn(batch.batch["response_mask"].shape, generator=torch.Generator().manual_seed(1))
    return batch


def bench_save(size: str, demo_dir: Path, work: Path, repeats: int) -> dict:
    import ray

    from async_rl.run_config import ray_init_kwargs
    from async_rl.training import engine_calls
    from async_rl.training.worker_groups import make_worker_group

    path = model_dir(size, work)
    config = verl_config(demo_dir, path)
    ray.init(**ray_init_kwargs(config))
    try:
        group = make_worker_group(config, "actor", 2, f"ckpt_{size}")
        batch = training_batch(vocab=8192)

        def train_step() -> float:
            data = batch.select_idxs(np.arange(len(batch)))
            data.batch["old_log_probs"] = engine_calls.compute_log_prob(group, data, 1.0)
            data.batch["rollout_log_probs"] = data.batch["old_log_probs"]
            start = time.perf_counter()
            engine_calls.update_actor(group, data, config.actor_rollout_ref)
            return time.perf_counter() - start

        train_step()  # the optimizer holds its state from here on
        runs = []
        for i in range(repeats):
            alone = train_step()
            start = time.perf_counter()
            group.save_checkpoint(str(work / f"sync_{size}_{i}" / "actor"), None, 1, None)
            sync_s = time.perf_counter() - start
            start = time.perf_counter()
            snapshot = group.snapshot_checkpoint(str(work / f"pipeline_{size}_{i}" / "actor"), 1)
            blocked_s = time.perf_counter() - start
            beside = train_step()  # runs while the files are written
            written = group.wait_checkpoint_written(600.0)
            runs.append({"sync_s": sync_s, "blocked_s": blocked_s, "snapshot_s": max(s["snapshot_s"] for s in snapshot),
                         "write_s": max(w["write_s"] for w in written), "bytes": sum(w["bytes"] for w in written),
                         "step_alone_s": alone, "step_beside_write_s": beside})
            for kind in ("sync", "pipeline"):
                shutil.rmtree(work / f"{kind}_{size}_{i}")
    finally:
        ray.shutdown()
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    median = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    return {"size": size, "gb": runs[0]["bytes"] / 1e9, "runs": runs, "best": best, "median": median,
            "blocked_ratio": median["blocked_s"] / median["sync_s"]}


def first_step_s(demo_dir: Path, work: Path, name: str, extra: dict, timeout_s: float = 600) -> tuple[float, list]:
    """Seconds from `python -m verl.trainer.main_ppo ...` to its first training step in the metrics file."""
    from async_rl.demo import demo_overrides

    metrics = work / f"{name}.jsonl"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *demo_overrides(demo_dir, extra=extra)]
    start = time.monotonic()
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        first = None
        while proc.poll() is None and time.monotonic() - start < timeout_s:
            if first is None and metrics.exists() and "training/global_step" in metrics.read_text():
                first = time.monotonic() - start
            time.sleep(0.05)
        proc.wait(timeout=max(timeout_s - (time.monotonic() - start), 1))
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"{name} failed ({proc.returncode}): see {work / (name + '.log')}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return first, [r["data"] for r in rows if "training/global_step" in r["data"]]


def rollout_batch_bytes(demo_dir: Path) -> int:
    """Bytes of one demo training batch as a checkpoint would hold it (its DataProto, pickled)."""
    from async_rl.core.messages import Sample, build_batch
    from async_rl.demo.task import GROUP_SIZE, MAX_PROMPT_LENGTH, RESPONSE_LENGTH, TRAIN_BATCH_SIZE

    samples = [Sample(uid=str(i // GROUP_SIZE), prompt_ids=[5] * 5, response_ids=[6] * RESPONSE_LENGTH,
                      rollout_log_probs=[-1.0] * RESPONSE_LENGTH, token_versions=[0] * RESPONSE_LENGTH,
                      non_tensor={"data_source": "x", "reward_model": {"ground_truth": "1234"}})
               for i in range(TRAIN_BATCH_SIZE * GROUP_SIZE)]
    buffer = io.BytesIO()
    torch.save(build_batch(samples, MAX_PROMPT_LENGTH, RESPONSE_LENGTH, 0), buffer)
    return buffer.tell()


def bench_resume(demo_dir: Path, work: Path) -> dict:
    ckpt = work / "resume_ckpt"
    base = {"trainer.save_freq": 3, "trainer.default_local_dir": str(ckpt), "trainer.test_freq": -1,
            "trainer.val_before_train": False, "trainer.logger": ["file"]}
    fresh_s, fresh = first_step_s(demo_dir, work, "fresh", {**base, "trainer.total_training_steps": 6})
    resumed_s, resumed = first_step_s(demo_dir, work, "resumed", {**base, "trainer.total_training_steps": 9})
    steady = float(np.median([r["timing_s/step"] for r in fresh[1:] + resumed[1:]]))
    generate = float(np.median([r["async/generate/busy_ratio"] * r["timing_s/step"] for r in fresh[1:]]))
    return {"fresh_first_step_s": fresh_s, "resumed_first_step_s": resumed_s,
            "resumed_first_steps": [r["training/global_step"] for r in resumed][:1],
            "steady_step_s": steady, "generate_s_per_step": generate, "batch_bytes": rollout_batch_bytes(demo_dir)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10M,100M", help="comma-separated, of bench/param_update.py's sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-resume", action="store_true", help="skip the resume section (two demo runs)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    command = command_line()
    from async_rl.demo import prepare

    result: dict = {"command": command, "save": [], "resume": None}
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        work = Path(tmp)
        demo_dir = work / "demo"
        prepare(demo_dir, seed=0, train_size=1024, val_size=16)
        for size in args.sizes.split(","):
            result["save"].append(bench_save(size.strip(), demo_dir, work, args.repeats))
            print(f"done {size}: {json.dumps(result['save'][-1]['median'])}", flush=True)
        if not args.no_resume:
            result["resume"] = bench_resume(demo_dir, work)
    print(f"\ncommand: {command}\ncpus: {os.cpu_count()}, torch {torch.__version__}, two train ranks, "
          f"medians of {args.repeats}")
    header = (f"{'size':>5} {'GB':>6} | {'sync save':>9} | {'blocked':>8} {'blocked/sync':>12} | {'write':>7} | "
              f"{'step alone':>10} {'step beside write':>17}")
    print(header + "\n" + "-" * len(header))
    for r in result["save"]:
        m = r["median"]
        print(f"{r['size']:>5} {r['gb']:>6.2f} | {m['sync_s']:>8.3f}s | {m['blocked_s']:>7.3f}s {r['blocked_ratio']:>12.3f} | "
              f"{m['write_s']:>6.2f}s | {m['step_alone_s']:>9.3f}s {m['step_beside_write_s']:>16.3f}s")
    print("goal: blocked/sync <= 0.1. 'sync save': verl's save_checkpoint (training waits for every file); "
          "'blocked': the pipeline's snapshot, all training waits for; 'write': its files, fsync'ed, written "
          "by a background thread while the next step runs ('step beside write' against 'step alone').")
    if result["resume"] is not None:
        r = result["resume"]
        print(f"\nresume (the demo): first training step {r['fresh_first_step_s']:.1f} s after the command from scratch, "
              f"{r['resumed_first_step_s']:.1f} s resumed (step {r['resumed_first_steps'][0]}); a steady step takes "
              f"{r['steady_step_s']:.3f} s, of which generation keeps the generate stage busy {r['generate_s_per_step']:.3f} s.")
        print(f"batches generated ahead (at most eta = generate_ahead_steps - 1 per checkpoint): regenerated at a resume, "
              f"costing about {r['generate_s_per_step']:.3f} s of generation each, once per resume; saving them instead "
              f"would write {r['batch_bytes'] / 1e6:.2f} MB per batch at every checkpoint.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
