"""Ablation, after AReaL's Table 2: staleness bound eta with and without decoupled PPO.

Each run is the demo (copy-digits, tiny Qwen2, the README quickstart's settings) trained
to the same number of steps by the plain verl command with
`+actor_rollout_ref.async_pipeline=True`, one after another on this machine:

- eta in {0, 2, 4} (`+trainer.generate_ahead_steps` = eta + 1);
- decoupled: AReaL's decoupled PPO (the default: pi_prox recomputed with the pre-update
  weights, token weights pi_prox / pi_behav, 0 above `behav_imp_weight_cap`, `--cap`);
  not decoupled:
  AReaL's "naive PPO", PPO's pi_old is the behaviour policy
  (`+algorithm.decoupled_ppo=False algorithm.rollout_correction.bypass_mode=True`).

Prints a table and the command, writes a PNG of validation reward against wall time
(`--png`), and with `--json PATH` the rows: eta, decoupled, steps, final_val_reward, wall_s,
and for decoupled runs the cap and `capped_token_fraction` (verl's
`rollout_corr/rollout_is_ratio_fraction_high`: the share of tokens whose weight the cap
zeroed), averaged over all steps and over the last third.

With `--seeds 0,1,...` every configuration runs once per seed (`data.seed`, the shuffle, and
`actor_rollout_ref.rollout.seed`, the sampling), interleaved so that machine noise falls on
all configurations alike; the summary then gives the mean over seeds and the worst seed.

    python bench/ablation.py [--steps 200] [--etas 0,2,4] [--seeds 0] [--cap 5] [--no-naive] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/param_update.py would shadow the `param_update` package: drop this folder from the path
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from bench.command import command_line, shown_path  # noqa: E402

VAL_KEY = "val-core/async_rl/copy_digits/reward/mean@1"
NAIVE = {"+algorithm.decoupled_ppo": False, "algorithm.rollout_correction.bypass_mode": True}


CAPPED = "rollout_corr/rollout_is_ratio_fraction_high"  # verl: share of tokens above the upper threshold


def run_once(demo_dir: Path, workdir: Path, eta: int, decoupled: bool, steps: int, test_freq: int, timeout_s: float,
             cap: float | None = None, seed: int = 0, setting: dict | None = None):
    """One training run; returns the row and its validation curve [(wall_s, reward)].

    ``setting``: verl overrides that make the task harder for every run alike (`--set`)."""
    from async_rl.core.config import AsyncPipelineConfig
    from async_rl.demo import demo_overrides

    extra = {
        **(setting or {}),
        "data.seed": seed,
        "actor_rollout_ref.rollout.seed": seed,
        "+trainer.generate_ahead_steps": eta + 1,
        "trainer.total_training_steps": steps,
        "trainer.test_freq": test_freq,
        **({} if decoupled else NAIVE),
        **({"+algorithm.behav_imp_weight_cap": cap} if decoupled and cap is not None else {}),
    }
    metrics_path = workdir / f"eta{eta}_{'decoupled' if decoupled else 'naive'}_seed{seed}.jsonl"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_path), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *demo_overrides(demo_dir, extra=extra)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall_s = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"run eta={eta} decoupled={decoupled} seed={seed} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    step_s = {r["step"]: r["data"]["timing_s/step"] for r in rows if "timing_s/step" in r["data"]}
    vals = {r["step"]: r["data"][VAL_KEY] for r in rows if VAL_KEY in r["data"]}
    # wall time at a validation: the run's time outside training steps (start-up, validations), counted
    # up front, plus the training steps so far
    setup_s = wall_s - sum(step_s.values())
    curve = [(setup_s + sum(s for k, s in step_s.items() if k <= step), vals[step]) for step in sorted(vals)]
    staleness = max((r["data"].get("async/staleness/max", 0.0) for r in rows), default=0.0)
    capped = [r["data"][CAPPED] for r in sorted(rows, key=lambda r: r["step"]) if CAPPED in r["data"]]
    late = capped[len(capped) * 2 // 3:]
    row = {
        "eta": eta,
        "decoupled": decoupled,
        "seed": seed,
        "steps": steps,
        "final_val_reward": vals[max(vals)],
        "wall_s": wall_s,
        "max_staleness_seen": staleness,
        "mean_step_s": sum(step_s.values()) / max(len(step_s), 1),
        "cap": (cap if cap is not None else AsyncPipelineConfig().behav_imp_weight_cap) if decoupled else None,
        "capped_token_fraction": sum(capped) / len(capped) if capped else None,
        "capped_token_fraction_last_third": sum(late) / len(late) if late else None,
    }
    return row, curve


def capped_text(row: dict) -> str:
    if row["capped_token_fraction"] is None:
        return "-"
    return f"{row['capped_token_fraction']:.4f} ({row['capped_token_fraction_last_third']:.4f})"


def plot(curves: dict[str, list], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, curve in curves.items():
        ax.plot([t for t, _ in curve], [r for _, r in curve], marker=".", label=label)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("validation reward (mean@1)")
    ax.set_title("copy-digits demo: staleness eta x objective")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def objective(decoupled: bool) -> str:
    return "decoupled" if decoupled else "naive PPO"


def summarize(rows: list[dict]) -> list[dict]:
    """Per (eta, objective), in first-seen order: the runs, mean and worst (lowest) final reward
    over seeds, mean wall time."""
    groups: dict[tuple[int, bool], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["eta"], r["decoupled"]), []).append(r)
    return [
        {
            "eta": eta, "decoupled": decoupled, "runs": len(runs),
            "mean_reward": sum(r["final_val_reward"] for r in runs) / len(runs),
            "worst_reward": min(r["final_val_reward"] for r in runs),
            "mean_wall_s": sum(r["wall_s"] for r in runs) / len(runs),
        }
        for (eta, decoupled), runs in groups.items()
    ]


def comparisons(summary: list[dict]) -> list[str]:
    """Decoupled eta > 0 against decoupled eta = 0 (means over seeds), as AReaL's Table 2 reads."""
    base = next((g for g in summary if g["eta"] == 0 and g["decoupled"]), None)
    lines = []
    for g in summary:
        if base and g["decoupled"] and g["eta"] > 0:
            lines.append(
                f"decoupled eta={g['eta']} vs eta=0: mean reward {g['mean_reward'] - base['mean_reward']:+.3f} "
                f"(worst seed {g['worst_reward'] - base['worst_reward']:+.3f}), wall time "
                f"x{g['mean_wall_s'] / base['mean_wall_s']:.2f} (expected: within 0.05, less time)"
            )
    return lines


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--etas", default="0,2,4")
    parser.add_argument("--seeds", default="0", help="comma-separated; each configuration runs once per seed")
    parser.add_argument("--test-freq", type=int, default=20, help="validate every N steps")
    parser.add_argument("--demo-dir", help="a prepared demo (default: prepare one in a temporary folder)")
    parser.add_argument("--json", help="write the rows as a JSON list here")
    parser.add_argument("--png", default="bench/results/ablation.png", help="reward against wall time")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--cap", type=float, help="behav_imp_weight_cap of the decoupled runs (default: the pipeline's, 5)")
    parser.add_argument("--no-naive", action="store_true", help="decoupled runs only")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a verl override for every run (repeatable), e.g. actor_rollout_ref.actor.optim.lr=3e-3 "
                             "or data.max_response_length=40: the search for a setting where staleness hurts")
    args = parser.parse_args(argv)
    setting = dict(item.split("=", 1) for item in args.set)
    command = command_line()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        demo_dir = Path(args.demo_dir) if args.demo_dir else Path(tmp) / "demo"
        if not args.demo_dir:
            from async_rl.demo import prepare

            prepare(demo_dir, seed=0)
        for seed in seeds:
            for eta in (int(e) for e in args.etas.split(",")):
                for decoupled in (True,) if args.no_naive else (True, False):
                    row, curve = run_once(demo_dir, Path(tmp), eta, decoupled, args.steps, args.test_freq,
                                          args.timeout_s, args.cap, seed, setting)
                    rows.append(row)
                    label = objective(decoupled) + (f" cap={args.cap:g}" if decoupled and args.cap is not None else "")
                    curves[f"eta={eta} {label}" + (f" seed={seed}" if len(seeds) > 1 else "")] = curve
                    print(f"done: {json.dumps(row)}", flush=True)
    print(f"\ncommand: {command}\ncpus: {os.cpu_count()}, demo quickstart settings"
          + (f" with {setting}" if setting else "") + f", {args.steps} steps per run")
    header = (f"{'eta':>3} {'objective':>12} {'seed':>4} {'steps':>5} | {'final val reward':>16} {'wall s':>8} "
              f"{'s/step':>7} | {'max staleness':>13} {'capped tokens (last third)':>26}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['eta']:>3} {objective(r['decoupled']):>12} {r['seed']:>4} {r['steps']:>5} | "
              f"{r['final_val_reward']:>16.3f} {r['wall_s']:>8.1f} {r['mean_step_s']:>7.2f} | "
              f"{r['max_staleness_seen']:>13.0f} {capped_text(r):>26}")
    summary = summarize(rows)
    if len(seeds) > 1:
        print(f"\nover seeds {args.seeds}:")
        print(f"{'eta':>3} {'objective':>12} | {'mean reward':>11} {'worst':>6} {'mean wall s':>11}")
        for g in summary:
            print(f"{g['eta']:>3} {objective(g['decoupled']):>12} | {g['mean_reward']:>11.3f} {g['worst_reward']:>6.3f} "
                  f"{g['mean_wall_s']:>11.1f}")
    for line in comparisons(summary):
        print(line)
    if args.png:
        plot(curves, args.png)
        print(f"plot: {shown_path(args.png)}")
    if args.json:
        keys = ("eta", "decoupled", "seed", "steps", "final_val_reward", "wall_s", "cap", "capped_token_fraction",
                "capped_token_fraction_last_third")
        with open(args.json, "w") as f:
            json.dump([{k: r[k] for k in keys} for r in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main()
