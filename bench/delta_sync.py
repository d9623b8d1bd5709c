"""Benchmark: delta sync against a full sync, a float32 trainer and a bf16 rollout, across nodes.

On a local two-node Ray cluster (`ray.cluster_utils.Cluster`), a synthetic float32 Qwen2 model
trains with Adam (real forward and backward on random tokens) at each learning rate in turn. After
every step the new version goes to two bf16 weight holders on the second node, each behind its own
param_update stage and its own sender in the trainer process, over the same link (the table's
cross-node link, the collective transport):

- full: every tensor cast to bf16 and sent whole;
- delta: the table's delta option: the values whose bf16 bits changed since the version before
  (their positions as 16-bit gaps + bf16 values), or the tensor whole where that is no larger
  (param_update/delta.py).

Per version: the bytes the sync carried (`async/param_update/bytes`) and its total (gather start to
loaded everywhere, `timing_s/param_update/total`), and whether both holders hold exactly the
trainer's weights cast to bf16 (per-tensor digests). The first version is full on both (nothing to
diff against) and left out of the medians.

    python bench/delta_sync.py [--size 100M] [--lrs 1e-6,1e-5] [--steps 6] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# this folder holds a module named like the `param_update` package: the repository root comes first
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.command import command_line  # noqa: E402
from bench.link import LinkProbe, gloo_send_s, node_ids, two_node_cluster  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

SIZES = {"2M": (64, 2), "10M": (256, 6), "100M": (768, 12), "500M": (1280, 24)}  # hidden, layers
VOCAB = 8192
TIMEOUT_S = 900
BUCKET_MB = 512
PARTS = ("gather", "send", "recv", "register_buffer", "load")  # the sync's five timers, `timing_s/param_update/*`


def build_model(size: str, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers = SIZES[size]
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=128, tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(torch.float32)


@ray.remote
class Trainer:
    """A float32 model, Adam, and one sender per sync kind (each keeps what it needs of the last version)."""

    def __init__(self, size: str):
        from param_update.sender import BucketSender

        self.model = build_model(size, seed=1)
        held = {name: torch.bfloat16 for name in self.model.state_dict()}
        self.senders = {kind: BucketSender(held_dtypes=held) for kind in ("full", "delta")}
        self.optimizer = None
        self.batch = torch.randint(0, VOCAB, (4, 64))

    def held_layout(self) -> dict:
        return {name: (torch.bfloat16, tuple(t.shape)) for name, t in self.model.state_dict().items()}

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def use_lr(self, lr: float) -> None:
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def train_step(self) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)

    def send(self, kind: str, version: int, sink) -> None:
        state = self.model.state_dict()
        self.senders[kind].gather_and_send(state.items(), version, BUCKET_MB << 20, sink, True)

    def held_digests(self) -> dict:
        from param_update.buckets import tensor_digest

        return {name: tensor_digest(t.detach().to(torch.bfloat16)) for name, t in self.model.state_dict().items()}

    def delta_loops(self) -> str:
        """Which loops diff here: delta_kernel.c's (and its compare level) or numpy's."""
        from param_update.delta_kernel import kernel

        native = kernel()
        return f"C ({native.level})" if native is not None else "numpy"

    def raw_link_s(self, nbytes: int, probe) -> float:
        return gloo_send_s(nbytes, probe)

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()


def holder_class():
    from param_update.holder import StagedWeights

    class HeldWeights(StagedWeights):
        """A rollout's weights in bf16 (layout name -> (dtype, shape)); its load swaps the staged version in."""

        def __init__(self, layout: dict):
            self.start_staging(layout)
            self.params = {name: torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
                           for name, (dtype, shape) in layout.items()}

        def load_staged(self, version: int, staged) -> dict:
            start = time.perf_counter()
            staged.swap_into(self.params)
            seconds = time.perf_counter() - start
            return {"load_s": seconds, "blocked_s": seconds, "keeps_buffer": True}

        def digests(self) -> dict:
            from param_update.buckets import tensor_digest

            return {name: tensor_digest(p.data) for name, p in self.params.items()}

    return HeldWeights


@ray.remote
class VersionLog:
    def set_served_version(self, version: int) -> None:
        pass


def on_node(node_id: str) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def start_stage(holder, node: str, delta: bool):
    from async_rl.api.weights import TransportTable
    from param_update.receivers import ActorReceiver
    from state_machines.param_update import ParamUpdateStage

    stage = ray.remote(ParamUpdateStage).options(max_concurrency=64, **on_node(node)).remote(
        receivers=[ActorReceiver("holder", holder, True)], clock=VersionLog.remote(),
        transports=TransportTable(delta=delta))
    ray.get(stage.connect.remote([], 1), timeout=TIMEOUT_S)
    stage.run.remote()
    return stage


def sync(trainer, stage, kind: str, version: int) -> dict:
    from async_rl.core.messages import NewWeights

    ray.get(stage.put.remote(NewWeights(version=version, started_at=time.time())), timeout=TIMEOUT_S)
    ray.get(trainer.send.remote(kind, version, stage), timeout=TIMEOUT_S)
    deadline = time.time() + TIMEOUT_S
    while (timings := ray.get(stage.pop_timings.remote(), timeout=TIMEOUT_S).get(version)) is None:
        if time.time() > deadline:
            raise TimeoutError(f"the {kind} sync of version {version} did not end in {TIMEOUT_S} s")
        time.sleep(0.02)
    return timings


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="100M", help=f"one of {list(SIZES)}")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated Adam learning rates, run in turn")
    parser.add_argument("--steps", type=int, default=6, help="training steps (versions) per learning rate")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    command = command_line()
    cluster = two_node_cluster()
    head, far = node_ids(cluster)
    rows, versions = [], iter(range(1, 1 << 30))
    try:
        trainer = Trainer.options(**on_node(head)).remote(args.size)
        layout = ray.get(trainer.held_layout.remote(), timeout=TIMEOUT_S)
        params = ray.get(trainer.num_params.remote(), timeout=TIMEOUT_S)
        Holder = ray.remote(holder_class())
        holders = {kind: Holder.options(**on_node(far)).remote(layout) for kind in ("full", "delta")}
        stages = {kind: start_stage(holders[kind], head, delta=kind == "delta") for kind in ("full", "delta")}
        for lr in (float(x) for x in args.lrs.split(",")):
            ray.get(trainer.use_lr.remote(lr), timeout=TIMEOUT_S)
            for step in range(args.steps + 1):
                if step:
                    ray.get(trainer.train_step.remote(), timeout=TIMEOUT_S)
                version = next(versions)
                order = ("full", "delta") if version % 2 else ("delta", "full")  # neither always goes first
                timings = {kind: sync(trainer, stages[kind], kind, version) for kind in order}
                want = ray.get(trainer.held_digests.remote(), timeout=TIMEOUT_S)
                held = {kind: ray.get(h.digests.remote(), timeout=TIMEOUT_S) == want for kind, h in holders.items()}
                row = {"lr": lr, "version": version, "first_of_lr": step == 0,
                       **{f"{kind}_{key}": timings[kind][metric] for kind in ("full", "delta")
                          for key, metric in (("bytes", "async/param_update/bytes"),
                                              ("total_s", "timing_s/param_update/total"),
                                              ("is_delta", "async/param_update/delta"),
                                              ("collective", "async/param_update/collective_receivers"),
                                              *((f"{part}_s", f"timing_s/param_update/{part}") for part in PARTS))},
                       "full_bit_identical": held["full"], "delta_bit_identical": held["delta"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
        full_bytes = int(statistics.median(r["full_bytes"] for r in rows))
        probe = LinkProbe.options(**on_node(far)).remote()
        raw_link_s = ray.get(trainer.raw_link_s.remote(full_bytes, probe), timeout=TIMEOUT_S)
        loops = ray.get(trainer.delta_loops.remote(), timeout=TIMEOUT_S)
        ray.get(trainer.close.remote(), timeout=TIMEOUT_S)
    finally:
        ray.shutdown()
        cluster.shutdown()
    link_rate = full_bytes / raw_link_s  # bytes/s, this machine's link between the two nodes
    summary = {}
    for lr in sorted({r["lr"] for r in rows}, reverse=True):
        steady = [r for r in rows if r["lr"] == lr and r["delta_is_delta"]]
        summary[lr] = {
            "versions": len(steady),
            "bytes_ratio": statistics.median(r["delta_bytes"] / r["full_bytes"] for r in steady),
            "time_ratio": statistics.median(r["delta_total_s"] / r["full_total_s"] for r in steady),
            "full_total_s": statistics.median(r["full_total_s"] for r in steady),
            "delta_total_s": statistics.median(r["delta_total_s"] for r in steady),
            "full_mb": statistics.median(r["full_bytes"] for r in steady) / (1 << 20),
            "delta_mb": statistics.median(r["delta_bytes"] for r in steady) / (1 << 20),
            "bit_identical": all(r["full_bit_identical"] and r["delta_bit_identical"] for r in rows if r["lr"] == lr),
            **{f"{kind}_{part}_s": statistics.median(r[f"{kind}_{part}_s"] for r in steady)
               for kind in ("full", "delta") for part in PARTS},
        }
        for kind in ("full", "delta"):  # each sync's time less its bytes at this link's rate
            s = summary[lr]
            s[f"{kind}_off_link_s"] = s[f"{kind}_total_s"] - s[f"{kind}_mb"] * (1 << 20) / link_rate
        summary[lr]["crossover_mb_s"] = crossover_rate(summary[lr]) / (1 << 20)
    print(f"\ncommand: {command}\ncpus: {os.cpu_count()}, torch {torch.__version__}, {args.size} ({params:,} "
          f"float32 parameters), rollout held in bf16, Adam, {args.steps} steps per lr, buckets {BUCKET_MB} MB, "
          f"both syncs through the collective transport to the second node; the delta's loops: {loops}")
    header = (f"{'lr':>7} | {'full MB':>8} {'delta MB':>9} {'bytes':>6} | {'full s':>7} {'delta s':>8} {'time':>6} | "
              f"{'bit-identical':>13}")
    print(f"{header}\n{'-' * len(header)}")
    for lr, s in summary.items():
        print(f"{lr:>7.0e} | {s['full_mb']:>8.1f} {s['delta_mb']:>9.1f} {s['bytes_ratio']:>6.3f} | "
              f"{s['full_total_s']:>6.3f}s {s['delta_total_s']:>7.3f}s {s['time_ratio']:>6.3f} | "
              f"{'yes' if s['bit_identical'] else 'NO':>13}")
    print("medians over the versions after each lr's first; 'bytes', 'time': delta / full; bit-identical: both "
          "holders held the trainer's weights cast to bf16 after every version. goal at lr 1e-6: bytes <= 0.10, "
          "time < 1")
    print("\nwhere each sync's time goes: the medians of its parts' timers (timing_s/param_update/<part>, s), which "
          "overlap (buckets are received and registered while later ones are sent)")
    print(f"{'lr':>7} {'sync':>6} | " + " ".join(f"{part:>15}" for part in PARTS) + f" | {'total':>7}")
    for lr, s in summary.items():
        for kind in ("full", "delta"):
            print(f"{lr:>7.0e} {kind:>6} | " + " ".join(f"{s[f'{kind}_{part}_s']:>15.3f}" for part in PARTS)
                  + f" | {s[f'{kind}_total_s']:>7.3f}")
    print(f"\nthe link between the nodes: {full_bytes / (1 << 20):.1f} MB in {raw_link_s:.3f}s "
          f"({link_rate / (1 << 20):,.0f} MB/s, one gloo send)")
    for lr, s in summary.items():
        rate = s["crossover_mb_s"]
        print(f"lr {lr:.0e}: " + ("the delta is faster on any link" if rate == float("inf") else
              f"the delta is faster on a link slower than {rate:,.0f} MB/s ({rate * 8 / 1000:.1f} Gb/s): its work off "
              f"the link costs {s['delta_off_link_s']:.3f}s against the full sync's {s['full_off_link_s']:.3f}s, and "
              "it sends "
              f"{s['full_mb'] - s['delta_mb']:.1f} MB less"))
    print("(each sync modelled as its time off the link, measured here, plus its bytes at the link's rate)")
    result = {"command": command, "size": args.size, "params": params, "delta_loops": loops, "rows": rows,
              "raw_link_s": raw_link_s,
              "link_mb_s": link_rate / (1 << 20), "summary": {str(lr): s for lr, s in summary.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def crossover_rate(s: dict) -> float:
    """The link rate (bytes/s) below which the delta sync beats the full one, each sync taking its time off the
    link (`<kind>_off_link_s`) plus its bytes (`<kind>_mb`) at that rate; inf when the delta's time off the link
    is no longer than the full sync's."""
    extra = s["delta_off_link_s"] - s["full_off_link_s"]
    return float("inf") if extra <= 0 else (s["full_mb"] - s["delta_mb"]) * (1 << 20) / extra


if __name__ == "__main__":
    main()
