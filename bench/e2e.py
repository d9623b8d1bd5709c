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

VAL_KEY = "val-core/async_rl/copy_digits/reward/mean@1"
STAGES = ("dataloader", "generate", "rollout", "reward", "logp", "ref_logp", "actor_train", "param_update")
# verl's synchronous step runs these one after another on the same processes (timing_s/<name>)
VERL_SYNC_PARTS = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights")
FULLY_ASYNC_NOT_RUN = (
    "verl's fully_async_policy (verl/experimental/fully_async_policy) needs a checkpoint-engine backend that "
    "moves weights without GPUs (its default, nccl, needs cupy and CUDA; no CPU backend ships with verl 0.9.1) "
    "and standalone rollout replicas with verl's CheckpointEngineWorker; this package does not provide either "
    "for verl's trainers yet (its own weight sync is param_update/)"
)


def run_system(name: str, demo_dir: Path, workdir: Path, extra: dict, timeout_s: float) -> list[dict]:
    """One training run by the plain verl command; returns its JSONL metric rows."""
    from async_rl.demo import demo_overrides

    metrics_path = workdir / f"{name.replace(' ', '_').replace('=', '')}.jsonl"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_path), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *demo_overrides(demo_dir, extra=extra)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed after {time.monotonic() - start:.0f} s:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return [json.loads(line) for line in metrics_path.read_text().splitlines()]


def summarize(name: str, k, rows: list[dict], samples_per_step: int, target: float) -> tuple[dict, list]:
    steps = {r["step"]: r["data"] for r in rows if "timing_s/step" in r["data"]}
    vals = {r["step"]: r["data"][VAL_KEY] for r in rows if VAL_KEY in r["data"]}
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
        "busy_ratio": busy,
        "mean_step_s": step_s,
        "mean_response_length": sum(lengths) / len(lengths),
        "max_response_length": max(m.get("response_length/max", 0.0) for m in later),
        "steps": len(steps),
    }
    return row, curve


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
    parser.add_argument("--skip-verl", action="store_true", help="pipeline runs only")
    parser.add_argument("--demo-dir")
    parser.add_argument("--json")
    parser.add_argument("--png", default="bench/results/e2e.png")
    parser.add_argument("--timeout-s", type=float, default=3600)
    args = parser.parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    from async_rl.demo.task import GROUP_SIZE, TRAIN_BATCH_SIZE

    common = {
        "data.max_response_length": args.response_length,
        "trainer.total_training_steps": args.steps,
        "trainer.test_freq": args.test_freq,
        "trainer.val_before_train": True,
    }
    systems = [] if args.skip_verl else [("verl-sync", None, {"+actor_rollout_ref.async_pipeline": False})]
    systems += [(f"async-pipeline k={k}", k, {"+trainer.generate_ahead_steps": k}) for k in map(int, args.ks.split(","))]
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        demo_dir = Path(args.demo_dir) if args.demo_dir else Path(tmp) / "demo"
        if not args.demo_dir:
            from async_rl.demo import prepare

            prepare(demo_dir, seed=0)
        for name, k, extra in systems:
            metrics = run_system(name, demo_dir, Path(tmp), {**common, **extra}, args.timeout_s)
            row, curve = summarize(name, k, metrics, TRAIN_BATCH_SIZE * GROUP_SIZE, args.target)
            rows.append(row)
            curves[name] = curve
            print(f"done: {json.dumps(row)}", flush=True)
    if not args.skip_verl:
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
    base = next((r for r in rows if r["system"] == "verl-sync"), None)
    for r in rows:
        if base and r.get("generate_ahead_steps"):
            speed = base["wall_s_per_sample"] / r["wall_s_per_sample"]
            to_target = (base["time_to_target_s"] / r["time_to_target_s"]
                         if base["time_to_target_s"] and r["time_to_target_s"] else None)
            print(f"{r['system']}: {speed:.2f}x verl-sync per sample, "
                  f"{'-' if to_target is None else f'{to_target:.2f}x'} to target; bubble {r['bubble_ratio']:.2f}, "
                  f"busiest stage {r['busiest_stage']} (busy ratios: "
                  + ", ".join(f"{s} {b:.2f}" for s, b in sorted(r["busy_ratio"].items(), key=lambda x: -x[1])) + ")")
    print("goal: the pipeline >= 2x faster than verl-sync to the same reward, bubble ratio <= 1.15")
    if args.png:
        plot(curves, args.png, args.target)
        print(f"plot: {args.png}")
    if args.json:
        keys = ("system", "generate_ahead_steps", "wall_s_per_sample", "time_to_target_s", "final_val_reward",
                "bubble_ratio")
        with open(args.json, "w") as f:
            json.dump([{k: r.get(k) for k in keys} | ({"not_run": r["not_run"]} if "not_run" in r else {})
                       for r in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main()
