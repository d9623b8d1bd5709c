"""Benchmark: a LoRA adapter's weight sync beside the full model's, through the same five parts.

For synthetic Qwen2 models (bench/param_update.py's sizes, float32), in one run on one Ray node: a
trainer actor sends version after version to a CPU rollout server through the param_update stage
(shared memory, the dual buffer), once as full weights, once as a LoRA adapter of rank `--rank` on
every Linear layer (PEFT, the adapter's `lora_A` / `lora_B` alone; the server merges it onto its
base: param_update/lora.py). Syncs alternate between the two, so both see the same machine state.

Per size and mode: the bytes a version carries (`async/param_update/bytes`), the median total sync
latency, the load (for the adapter: its merge, computed while the previous version serves, then
the swap) and the time generation was blocked, over `--syncs` versions.

    python bench/lora_sync.py [--sizes 10M,100M] [--rank 16] [--syncs 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.command import command_line  # noqa: E402
from bench.param_update import VersionLog, build_model, wait_for  # noqa: E402

TIMEOUT_S = 900
TOTAL, LOAD, BYTES = "timing_s/param_update/total", "timing_s/param_update/load", "async/param_update/bytes"
BLOCKED = "async/param_update/blocked_s"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@ray.remote
class Trainer:
    """A model sent as full weights, and the same base with a LoRA adapter sent as the adapter alone."""

    def __init__(self, size: str, rank: int):
        import torch
        from peft import LoraConfig, TaskType, get_peft_model

        from param_update.sender import BucketSender

        self.full = build_model(size, seed=0)
        self.peft = get_peft_model(build_model(size, seed=0), LoraConfig(
            task_type=TaskType.CAUSAL_LM, r=rank, lora_alpha=2 * rank, target_modules=TARGETS, bias="none"))
        with torch.no_grad():  # a trained adapter (PEFT starts B at zero)
            for name, param in self.peft.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.01)
        self.sender = BucketSender()

    def save(self, path: str) -> int:
        self.full.save_pretrained(path)
        return sum(p.numel() for p in self.full.parameters())

    def adapter(self):
        from peft.utils.save_and_load import get_peft_model_state_dict

        from param_update.lora import adapter_of

        layout = {n: (t.dtype, tuple(t.shape)) for n, t in get_peft_model_state_dict(self.peft).items()}
        return adapter_of(self.peft), layout

    def send(self, mode: str, version: int, bucket_bytes: int, sink) -> None:
        from peft.utils.save_and_load import get_peft_model_state_dict

        tensors = self.full.state_dict() if mode == "full" else get_peft_model_state_dict(self.peft)
        self.sender.gather_and_send(tensors.items(), version, bucket_bytes, sink, True, frozenset())

    def close(self) -> None:
        self.sender.close()


def start_sync(model_dir: str, adapter=None, layout=None):
    """A CPU rollout server of `model_dir` (LoRA: configured for `adapter`) and its param_update stage."""
    from verl.workers.config import HFModelConfig, RolloutConfig

    from async_rl.rollout.cpu.server import CPURolloutServer
    from param_update.receivers import ActorReceiver
    from state_machines.param_update import ParamUpdateStage

    config = RolloutConfig(name="cpu", tensor_model_parallel_size=1, prompt_length=8, response_length=8)
    server = ray.remote(CPURolloutServer).options(max_concurrency=64, num_cpus=0).remote(
        config=config, model_config=HFModelConfig(path=model_dir, load_tokenizer=False))
    ray.get(server.launch_server.remote(), timeout=TIMEOUT_S)
    ray.get(server.configure_weight_sync.remote(True, 64 << 20, layout, True, adapter), timeout=TIMEOUT_S)
    stage = ray.remote(ParamUpdateStage).options(max_concurrency=64, num_cpus=0).remote(
        receivers=[ActorReceiver("rollout_server_0", server, True)], clock=VersionLog.remote())
    ray.get(stage.connect.remote([], 1), timeout=TIMEOUT_S)
    stage.run.remote()
    return server, stage


def sync(stage, trainer, mode: str, version: int) -> dict:
    from async_rl.core.messages import NewWeights

    ray.get(stage.put.remote(NewWeights(version, time.time())), timeout=TIMEOUT_S)
    ray.get(trainer.send.remote(mode, version, 64 << 20, stage), timeout=TIMEOUT_S)
    return wait_for(lambda: ray.get(stage.pop_timings.remote(), timeout=TIMEOUT_S).get(version),
                    f"the sync of {mode} version {version}", poll_s=0.02)


def measure(size: str, rank: int, syncs: int) -> dict:
    trainer = Trainer.remote(size, rank)
    with tempfile.TemporaryDirectory() as model_dir:
        params = ray.get(trainer.save.remote(model_dir), timeout=TIMEOUT_S)
        adapter, layout = ray.get(trainer.adapter.remote(), timeout=TIMEOUT_S)
        ends = {"full": start_sync(model_dir), "lora": start_sync(model_dir, adapter, layout)}
        runs = {mode: [] for mode in ends}
        for version in range(1, syncs + 2):  # the first sync of each is cold: left out
            for mode, (_, stage) in ends.items():
                runs[mode].append(sync(stage, trainer, mode, version))
    ray.get(trainer.close.remote(), timeout=TIMEOUT_S)
    row = {"size": size, "params": params, "rank": rank, "syncs": syncs}
    for mode, timings in runs.items():
        warm = timings[1:]
        row[f"{mode}_bytes"] = int(warm[0][BYTES])
        row[f"{mode}_total_s"] = statistics.median(t[TOTAL] for t in warm)
        row[f"{mode}_load_s"] = statistics.median(t[LOAD] for t in warm)
        row[f"{mode}_blocked_s"] = statistics.median(t[BLOCKED] for t in warm)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10M,100M")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ray.init(include_dashboard=False, num_cpus=4, runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    rows = []
    try:
        for size in args.sizes.split(","):
            rows.append(measure(size, args.rank, args.syncs))
    finally:
        ray.shutdown()
    print(f"command: {command_line()}")
    print(f"LoRA rank {args.rank} on every Linear layer; medians of {args.syncs} syncs after a cold one")
    print(f"{'size':>6} {'params':>12} {'full bytes':>12} {'lora bytes':>12} {'bytes ratio':>11} "
          f"{'full total s':>12} {'lora total s':>12} {'full load s':>11} {'lora load s':>11} "
          f"{'full blocked s':>14} {'lora blocked s':>14}")
    for r in rows:
        print(f"{r['size']:>6} {r['params']:>12,} {r['full_bytes']:>12,} {r['lora_bytes']:>12,} "
              f"{r['lora_bytes'] / r['full_bytes']:>11.4f} {r['full_total_s']:>12.4f} {r['lora_total_s']:>12.4f} "
              f"{r['full_load_s']:>11.4f} {r['lora_load_s']:>11.4f} {r['full_blocked_s']:>14.5f} "
              f"{r['lora_blocked_s']:>14.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
