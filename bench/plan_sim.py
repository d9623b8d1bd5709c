"""Benchmark (a model, no runs): the planner of `trainer.use_nodes_ratios` (async_rl/plan/) at 8-512 GPUs.

For each cluster size (8 GPUs a node) the planner's best use_nodes_ratios, its predicted async step, verl's
synchronous step on the same GPUs, the speed-up and the bubble, for one workload of the proposal's and
AReaL's shape (`WORKLOAD`, per training step, the same global batch at every size):
- a 7B-class GRPO step, 512 prompts x 16 samples, the proposal's four roles (train, logp, ref_logp, generate);
- decoding the batch is 4800 GPU-s of throughput (300 s on 16 GPUs: ~60 % of a 500 s verl step, the
  proposal's 16-GPU number), spread evenly over the generate GPUs;
- the longest response decodes 90 s on its own however many GPUs serve the batch (the long tail): the
  synchronous step waits for it; the async one only through its latency bound (k = 2 steps cover one
  batch's way: generation, the log-prob passes, the update, the weight sync);
- the update is 2400 GPU-s, each forward pass (logp, ref_logp) a third of it, at one node; training roles
  keep 90 % of their throughput per doubling of GPUs above one node (8);
- the weight gather 4 s (training waits), the weight send and load 2 s, reward 2 s, rollout 0.5 s.
verl's hybrid-engine costs the proposal also counts (offload, resharding) are left out: the sync step is
its parts' sum and nothing else.

Prints the table and the command; writes `--txt`, `--json` and `--png` (step times and speed-up).

    python bench/plan_sim.py [--gpus 8,16,32,64,128,256,512] [--out bench/results/plan_sim]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.command import command_line  # noqa: E402

from async_rl.plan import Workload, candidates, devices_text, sync_step  # noqa: E402

WORKLOAD = Workload(work={"train": 2400.0, "logp": 800.0, "ref_logp": 800.0, "generate": 4800.0},
                    fixed={"reward": 2.0, "rollout": 0.5, "param_update": 2.0}, gather_s=4.0, tail_s=90.0, ahead=2,
                    efficiency=0.9, ref_devices=8)
GPUS = (8, 16, 32, 64, 128, 256, 512)


def simulate(gpus=GPUS, per_node: int = 8, wl: Workload = WORKLOAD) -> list[dict]:
    """Per cluster size: the best ratios, devices, predicted async and sync step (s), speed-up, bubble."""
    rows = []
    for total in gpus:
        best, sync_s = candidates(max(1, total // per_node), min(per_node, total), wl, keep=1)[0], sync_step(wl, total)
        step = best.pop("step_s")
        rows.append({"gpus": total, **best, "async_step_s": step, "sync_step_s": sync_s, "speedup": sync_s / step})
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [f"{'gpus':>5} {'async_s':>8} {'sync_s':>8} {'speedup':>7} {'bubble':>6}  devices  override"]
    lines += [f"{r['gpus']:>5} {r['async_step_s']:8.1f} {r['sync_step_s']:8.1f} {r['speedup']:6.2f}x {r['bubble']:6.2f}"
              f"  {devices_text(r)}  {r['override']}" for r in rows]
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [r["gpus"] for r in rows]
    fig, (steps, speedup) = plt.subplots(1, 2, figsize=(10, 4))
    steps.plot(gpus, [r["sync_step_s"] for r in rows], "o-", label="verl sync (predicted)")
    steps.plot(gpus, [r["async_step_s"] for r in rows], "o-", label="async, best ratios (predicted)")
    steps.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="s per step", title="step time")
    steps.legend()
    speedup.plot(gpus, [r["speedup"] for r in rows], "o-")
    speedup.axhline(1.0, color="grey", lw=0.8)
    speedup.set(xscale="log", xlabel="GPUs", ylabel="sync / async", title="speed-up")
    for ax in (steps, speedup):
        ax.set_xticks(gpus, [str(g) for g in gpus])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default=",".join(map(str, GPUS)), help="cluster sizes, comma-separated")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--out", default="bench/results/plan_sim", help="writes OUT.txt, OUT.json, OUT.png")
    args = parser.parse_args(argv)
    argv_used = sys.argv if argv is None else ["bench/plan_sim.py", *argv]
    command = command_line(argv_used)
    rows = simulate([int(g) for g in args.gpus.split(",")], args.gpus_per_node)
    text = "\n".join(table(rows) + ["", f"workload (per step): {asdict(WORKLOAD)}", f"command: {command}"])
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(f"{args.out}.txt", "w") as f:
        f.write(text + "\n")
    with open(f"{args.out}.json", "w") as f:
        json.dump({"workload": asdict(WORKLOAD), "rows": rows, "command": command}, f, indent=1)
    plot(rows, f"{args.out}.png")
    print(f"wrote {args.out}.txt, {args.out}.json, {args.out}.png")
    return rows


if __name__ == "__main__":
    main()
