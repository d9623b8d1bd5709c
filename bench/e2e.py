"""Side by side: verl's own trainers and this pipeline on one workload, one machine, one run.

Workload: the copy-digits demo with responses of up to `--response-length` tokens (the
reward reads the first 4 digits; an untrained policy stops only when it samples EOS, so
lengths are geometric with a long tail cut at the limit, as with reasoning models: most
responses short, some far longer). Every system gets the same model, data, batch (32
prompts x 8 samples), learning rate, steps, cores and validation schedule:

- `verl-sync`: verl's synchronous trainer (`main_ppo`, V1 `sync` mode, its default), flag
  off, with this package's CPU rollout backend as a hybrid replica (weights synced each step).
- `verl-fully-async`: verl's `fully_async_policy` is reported as not run, with the reason.
- `async-pipeline k=K`: `+actor_rollout_ref.async_pipeline=True +trainer.generate_ahead_steps=K`.
- `async-pipeline k=K logp stage` (`--logp-stage-ks`): the same with
  `+algorithm.proximal_logp_workers=logp`: pi_prox on the logp stage's own rank, which
  receives every version (the default computes it on the train rank before each update).
- `async-pipeline k=K naive PPO` (`--naive-ks`): the same with AReaL's naive PPO, which
  recomputes no pi_prox at all.
- `--ppo-ks K,...`: the PPO pair, verl's PPO with GAE and a critic (the demo's
  `overrides_ppo.txt`): `verl-sync PPO` and `async-pipeline k=K PPO` (the critic on its own
  rank, `use_nodes_ratios` 5th number = the train share).

Settings (the demo's overrides, `DIR/overrides.txt`, for every system): the same 2 cores
and `trainer.n_gpus_per_node=2` (CPU devices), fp32 FSDP2, GRPO, the demo's lr, dynamic
micro-batches (`use_dynamic_bsz`) and `trainer.balance_batch=True` (verl's default). verl's
trainer runs its documented single-machine setup: the hybrid engine, 2 FSDP2 ranks that
take turns generating (V1 `sync` rollout mode, its default) and training. The pipeline
splits the same 2 devices with `use_nodes_ratios=[0.5,0.5,0.5,0.5]`, its demo setting: 1
train rank and 1 rollout server (no ref_logp group: no KL term; no logp group unless
`proximal_logp_workers=logp`, then 1 logp rank).

Per run: wall time per trained sample (s; training steps only, start-up and validation
excluded, the same for every system), time to the validation target (training seconds until
a validation at or above `--target`), final validation reward, busy ratio per stage and the
bubble ratio (step time / the busiest stage's time per step; 1.0 is bubble-free). Prints a
table and the command, writes a PNG of reward against training time (`--png`) and with
`--json PATH` one row per run.

    python bench/e2e.py [--steps 120] [--target 0.6] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/param_update.py would shadow the `param_update` package: drop this folder from the path
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

# the validation reward: the pipeline logs it as val-core; verl's trainer logs the same score as val-aux
# (its val-core entry is `acc`, which verl's reward manager sets to the same float)
VAL_KEYS = ("val-core/async_rl/copy_digits/reward/mean@1", "val-aux/async_rl/copy_digits/reward/mean@1")
# AReaL's naive PPO: pi_old = the behaviour policy, logp recomputes nothing (README "Algorithms")
NAIVE_PPO = {"+algorithm.decoupled_ppo": False, "algorithm.rollout_correction.bypass_mode": True}
LOGP_STAGE = {"+algorithm.proximal_logp_workers": "logp"}  # pi_prox on the logp stage's own rank
STAGES = ("dataloader", "generate", "rollout", "reward", "logp", "ref_logp", "actor_train", "param_update",
          "values", "critic_train")
# verl's synchronous step runs these one after another on the same processes (timing_s/<name>)
VERL_SYNC_PARTS = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
                   "update_weights")
FULLY_ASYNC_NOT_RUN = (
    "verl's fully_async_policy (verl/experimental/fully_async_policy) needs a checkpoint-engine backend that "
    "moves weights without GPUs (its default, nccl, needs cupy and CUDA; no CPU backend ships with verl 0.9.1) "
    "and standalone rollout replicas with verl's CheckpointEngineWorker; this package does not provide either "
    "for verl's trainers yet (its own weight sync is param_update/)"
)


def metrics_file(metrics_dir: Path, name: str) -> Path:
    return metrics_dir / f"{name.replace(' ', '_').replace('=', '')}.jsonl"


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_system(name: str, demo_dir: Path, workdir: Path, metrics_dir: Path, extra: dict, timeout_s: float,
               critic: bool = False) -> list[dict]:
    """One training run by the plain verl command (`critic`: the demo's PPO with GAE); returns its JSONL rows."""
    from async_rl.demo import demo_overrides

    metrics_path = metrics_file(metrics_dir, name)
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_path), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *demo_overrides(demo_dir, extra=extra, critic=critic)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed after {time.monotonic() - start:.0f} s:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return read_metrics(metrics_path)


def summarize(name: str, k, rows: list[dict], samples_per_step: int, target: float) -> tuple[dict, list]:
    steps = {r["step"]: r["data"] for r in rows if "timing_s/step" in r["data"]}
    vals = {r["step"]: next(r["data"][k] for k in VAL_KEYS if k in r["data"])
            for r in rows if any(k in r["data"] for k in VAL_KEYS)}
    train_s = sum(m["timing_s/step"] for m in steps.values())
    curve = [(sum(m["timing_s/step"] for s, m in steps.items() if s <= step), vals[step]) for step in sorted(vals)]
    reached = next((t for t, reward in curve if reward >= target), None)
    later = [m for s, m in steps.items() if s > 1] or list(steps.values())  # step 1 includes warm-up
    step_s = sum(m["timing_s/step"] for m in later) / len(later)
    if k is None:  # verl's trainer: its parts run in sequence on the same processes
        parts = {p: sum(m.get(f"timing_s/{p}", 0.0) for m in later) / len(later) for p in VERL_SYNC_PARTS}
        busy = {p: s / step_s for p, s in parts.items() if s > 0}
    else:
        busy = {s: sum(m.get(f"async/{s}/busy_ratio", 0.0) for m in later) / len(later) for s in STAGES}
    busiest = max(busy, key=busy.get)
    lengths = [m.get("response_length/mean", float("nan")) for m in later]
    row = {
        "system": name,
        "generate_ahead_steps": k,
        "wall_s_per_sample": train_s / (len(steps) * samples_per_step),
        "time_to_target_s": reached,
        "final_val_reward": vals[max(vals)] if vals else None,
        "bubble_ratio": 1.0 / busy[busiest],
        "busiest_stage": busiest,
        # with pi_prox on the logp stage, actor_train trains batch j only after logp computed it with
        # version j, which exists only once step j - 1 is trained: the two run in turn, their sum is the chain
        "train_chain_busy": busy.get("actor_train", 0.0) + busy.get("logp", 0.0) if k is not None else None,
        "busy_ratio": busy,
        "mean_step_s": step_s,
        "mean_response_length": sum(lengths) / len(lengths),
        "max_response_length": max(m.get("response_length/max", 0.0) for m in later),
        "steps": len(steps),
    }
    return row, curve


def bottleneck(row: dict) -> str | None:
    """Why a pipeline run's bubble ratio is above the goal (1.15), from its busy ratios; None when it is not."""
    if "not_run" in row or not row.get("generate_ahead_steps") or row["bubble_ratio"] <= 1.15:
        return None
    busy = row["busy_ratio"]
    if busy.get("logp", 0.0) > 0.05 and row["train_chain_busy"] > 0.8:
        return ("bottleneck: actor_train and logp take turns (busy together "
                f"{row['train_chain_busy']:.2f}): pi_prox of batch j needs the weights of step j - 1; "
                "+algorithm.proximal_logp_workers=train computes it on the train ranks instead")
    if row["generate_ahead_steps"] == 1:
        return ("bottleneck: generate_ahead_steps=1 is synchronous: generation of batch j + 1 waits for "
                f"update j, so {row['busiest_stage']} idles while generation runs; k >= 2 overlaps them")
    return (f"bottleneck: {row['busiest_stage']} (busy {busy[row['busiest_stage']]:.2f}) waits on its "
            "upstream stages: " + ", ".join(f"{s} {b:.2f}" for s, b in sorted(busy.items(), key=lambda x: -x[1])[1:4]))


def plot(curves: dict, path: str, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, curve in curves.items():
        ax.plot([t for t, _ in curve], [r for _, r in curve], marker=".", label=label)
    ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation reward (mean@1)")
    ax.set_title("copy-digits, long-tailed responses: verl vs async pipeline")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--target", type=float, default=0.6, help="validation reward target")
    parser.add_argument("--response-length", type=int, default=40, help="max response tokens")
    parser.add_argument("--ks", default="1,2,5", help="generate_ahead_steps of the pipeline runs")
    parser.add_argument("--test-freq", type=int, default=10)
    parser.add_argument("--naive-ks", default="",
                        help="also run the pipeline with naive PPO (no logp recompute) at these generate_ahead_steps")
    parser.add_argument("--logp-stage-ks", default="",
                        help="also run the pipeline with pi_prox on the logp stage's rank at these generate_ahead_steps")
    parser.add_argument("--ppo-ks", default="",
                        help="generate_ahead_steps of pipeline runs of PPO with a critic (adds verl-sync PPO too)")
    parser.add_argument("--skip-verl", action="store_true", help="pipeline runs only")
    parser.add_argument("--demo-dir")
    parser.add_argument("--json")
    parser.add_argument("--png", default="bench/results/e2e.png")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--metrics-dir", help="keep each run's metric JSONL here (default: a temporary folder)")
    parser.add_argument("--summarize-only", action="store_true",
                        help="no runs: summarize the JSONL files already in --metrics-dir")
    parser.add_argument("--reuse", action="store_true",
                        help="run only the systems without a JSONL file in --metrics-dir; summarize all")
    args = parser.parse_args(argv)
    if (args.summarize_only or args.reuse) and not args.metrics_dir:
        parser.error("--summarize-only and --reuse read the JSONL files in --metrics-dir: give it")
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    from async_rl.demo.task import GROUP_SIZE, TRAIN_BATCH_SIZE

    common = {
        "data.max_response_length": args.response_length,
        "trainer.total_training_steps": args.steps,
        "trainer.test_freq": args.test_freq,
        "trainer.val_before_train": True,
    }
    flag_off = {"+actor_rollout_ref.async_pipeline": False}
    systems = [(f"async-pipeline k={k}", k, {"+trainer.generate_ahead_steps": k}, False)
               for k in map(int, filter(None, args.ks.split(",")))]
    systems += [(f"async-pipeline k={k} logp stage", k, {"+trainer.generate_ahead_steps": k, **LOGP_STAGE}, False)
                for k in map(int, filter(None, args.logp_stage_ks.split(",")))]
    systems += [(f"async-pipeline k={k} naive PPO", k, {"+trainer.generate_ahead_steps": k, **NAIVE_PPO}, False)
                for k in map(int, filter(None, args.naive_ks.split(",")))]
    ppo_ks = list(map(int, filter(None, args.ppo_ks.split(","))))
    grpo_verl = not args.skip_verl and (systems or not ppo_ks)  # verl's GRPO run: the baseline of the GRPO rows
    if grpo_verl:
        systems.insert(0, ("verl-sync", None, flag_off, False))
    if ppo_ks and not args.skip_verl:
        systems.append(("verl-sync PPO", None, flag_off, True))
    systems += [(f"async-pipeline k={k} PPO", k, {"+trainer.generate_ahead_steps": k}, True) for k in ppo_ks]
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        demo_dir = Path(args.demo_dir) if args.demo_dir else Path(tmp) / "demo"
        if not args.demo_dir and not args.summarize_only:
            from async_rl.demo import prepare

            prepare(demo_dir, seed=0)
        metrics_dir = Path(args.metrics_dir or tmp)
        metrics_dir.mkdir(parents=True, exist_ok=True)
        for name, k, extra, critic in systems:
            if args.summarize_only or (args.reuse and metrics_file(metrics_dir, name).exists()):
                metrics = read_metrics(metrics_file(metrics_dir, name))
            else:
                metrics = run_system(name, demo_dir, Path(tmp), metrics_dir, {**common, **extra}, args.timeout_s,
                                     critic)
            row, curve = summarize(name, k, metrics, TRAIN_BATCH_SIZE * GROUP_SIZE, args.target)
            rows.append(row)
            curves[name] = curve
            print(f"done: {json.dumps(row)}", flush=True)
    if grpo_verl:
        rows.insert(1, {"system": "verl-fully-async", "generate_ahead_steps": None, "wall_s_per_sample": None,
                        "time_to_target_s": None, "final_val_reward": None, "bubble_ratio": None,
                        "not_run": FULLY_ASYNC_NOT_RUN})
    print(f"\ncommand: {command}\ncpus: {os.cpu_count()}; {args.steps} steps of {TRAIN_BATCH_SIZE} prompts x "
          f"{GROUP_SIZE} samples; responses up to {args.response_length} tokens; target {args.target}")
    header = (f"{'system':>20} | {'s/sample':>9} {'to target s':>11} {'final val':>9} {'bubble':>7} "
              f"{'busiest':>13} {'s/step':>7} {'resp len':>8}")
    print(header)
    print("-" * len(header))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        if "not_run" in r:
            print(f"{r['system']:>20} | not run: {r['not_run']}")
            continue
        print(f"{r['system']:>20} | {r['wall_s_per_sample']:>9.4f} {fmt(r['time_to_target_s'], '>11.1f')} "
              f"{fmt(r['final_val_reward'], '>9.3f')} {r['bubble_ratio']:>7.2f} {r['busiest_stage']:>13} "
              f"{r['mean_step_s']:>7.2f} {r['mean_response_length']:>8.1f}")
    for r in rows:
        base = next((b for b in rows if b["system"] == ("verl-sync PPO" if r["system"].endswith(" PPO")
                                                         and "naive" not in r["system"] else "verl-sync")), None)
        if base and r.get("generate_ahead_steps"):
            speed = base["wall_s_per_sample"] / r["wall_s_per_sample"]
            to_target = (base["time_to_target_s"] / r["time_to_target_s"]
                         if base["time_to_target_s"] and r["time_to_target_s"] else None)
            print(f"{r['system']}: {speed:.2f}x {base['system']} per sample, "
                  f"{'-' if to_target is None else f'{to_target:.2f}x'} to target; bubble {r['bubble_ratio']:.2f}, "
                  f"busiest stage {r['busiest_stage']} (busy ratios: "
                  + ", ".join(f"{s} {b:.2f}" for s, b in sorted(r["busy_ratio"].items(), key=lambda x: -x[1]))
                  + f"); actor_train + logp: busy {r['train_chain_busy']:.2f}")
    print("goal: the pipeline >= 2x faster than verl-sync to the same reward, bubble ratio <= 1.15")
    for r in rows:
        line = bottleneck(r)
        if line:
            print(f"{r['system']}: {line}")
    if args.png:
        plot(curves, args.png, args.target)
        print(f"plot: {args.png}")
    if args.json:
        keys = ("system", "generate_ahead_steps", "wall_s_per_sample", "time_to_target_s", "final_val_reward",
                "bubble_ratio", "busiest_stage", "busy_ratio", "train_chain_busy", "mean_step_s")
        with open(args.json, "w") as f:
            json.dump([{k: r.get(k) for k in keys} | ({"not_run": r["not_run"]} if "not_run" in r else {})
                       for r in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main()
