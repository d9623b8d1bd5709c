"""Benchmark: does the planner (async_rl/plan/) rank `trainer.use_nodes_ratios` as measured runs do?

On a local 3-node Ray cluster (`ray.cluster_utils.Cluster`: a head of 1 CPU for the driver, two job
nodes of `--node-cpus` logical CPUs, 2 devices each) the demo (GRPO with a KL loss, so the roles are
train, ref_logp and generate) runs `--steps` steps once per ratio of `RATIOS`, through verl's command
(`trainer.nnodes=2 trainer.n_gpus_per_node=2`, no validation). The first run's metrics feed the
planner, which predicts every run's step time (s); the bench prints predicted against measured mean
`timing_s/step` (the first `--warmup` and last `--cooldown` steps left out), both rankings and whether
they match, and the planner's own best ratios for this cluster. Writes OUT.txt and OUT.json.

On a CPU machine every "device" is a set of processes sharing the same cores, so work does not shrink
with more devices as the model assumes: run it alone on the machine, and read it as a check of the
planner's plumbing and ranking, not of GPU numbers.

    python bench/plan_check.py [--steps 8] [--warmup 2] [--cooldown 1] [--out bench/results/plan_check]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != str(ROOT / "bench")]  # bench/param_update.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from bench.command import command_line  # noqa: E402
sys.path.insert(0, str(ROOT))

from async_rl.core.placement import plan_placement  # noqa: E402
from async_rl.plan import RATIO_ROLES, candidates, devices_text, predict, read_run  # noqa: E402

NODES, PER_NODE = 2, 2
# generate on 2, 3 and 1 of the 4 devices: train and ref_logp sharing a node / one device, or side by side
RATIOS = ([0.5, 0.5, 0.5, 0.5], [0.25, 0.25, 0.25, 0.75], [0.5, 0.5, 0.25, 0.25])
ROLES = ["train", "ref_logp"]  # the demo with a KL loss; pi_prox on the train ranks: no logp workers


def overrides(ratios: list[float], steps: int) -> list[str]:
    return [f"trainer.nnodes={NODES}", f"trainer.n_gpus_per_node={PER_NODE}", "trainer.test_freq=-1",
            "trainer.val_before_train=False", f"trainer.total_training_steps={steps}",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "+trainer.use_nodes_ratios=[" + ",".join(map(str, ratios)) + "]"]


def run_demo(demo: Path, ratios: list[float], steps: int, workdir: Path, address: str, timeout_s: float) -> Path:
    """verl's command on the cluster at `address`; returns its metrics JSONL (raises with the log's tail)."""
    from async_rl.demo import demo_overrides

    workdir.mkdir(parents=True, exist_ok=True)
    metrics, log = workdir / "metrics.jsonl", workdir / "run.log"
    env = {**os.environ, "RAY_ADDRESS": address, "VERL_FILE_LOGGER_PATH": str(metrics), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *demo_overrides(demo, extra=overrides(ratios, steps))]
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout_s).returncode
    if code != 0:
        raise RuntimeError(f"run {ratios} exited {code}:\n" + log.read_text()[-4000:])
    return metrics


def ranks(values: list[float]) -> list[int]:
    """1 for the smallest."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return [order.index(i) + 1 for i in range(len(values))]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of every mean")
    parser.add_argument("--cooldown", type=int, default=1, help="last steps left out (generation ended before)")
    parser.add_argument("--node-cpus", type=int, default=4, help="logical CPUs per job node (2 devices x 2 roles)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="per run")
    parser.add_argument("--workdir", help="keep the demo, every run's metrics and log here (default: a temp dir)")
    parser.add_argument("--out", default="bench/results/plan_check", help="writes OUT.txt and OUT.json")
    args = parser.parse_args(argv)
    argv_used = sys.argv if argv is None else ["bench/plan_check.py", *argv]
    command = command_line(argv_used)
    from ray.cluster_utils import Cluster

    from async_rl.demo import prepare

    work = Path(args.workdir or tempfile.mkdtemp(prefix="plan_check_"))
    prepare(work / "demo", seed=0, train_size=1024, val_size=32)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(NODES):
            cluster.add_node(num_cpus=args.node_cpus)
        cluster.wait_for_nodes()
        runs = []
        for i, ratios in enumerate(RATIOS):
            start = time.monotonic()
            path = run_demo(work / "demo", ratios, args.steps, work / f"run{i}", cluster.address, args.timeout_s)
            _, measured = read_run(str(path), args.warmup, args.cooldown)
            runs.append({"ratios": ratios, "metrics": str(path), "measured_step_s": measured["step_s"],
                         "devices": measured["devices"], "shared": measured["shared"],
                         "steps_measured": measured["steps"], "wall_s": time.monotonic() - start})
            print(f"ran {ratios}: {measured['step_s']:.3f} s/step over {measured['steps']} steps", flush=True)
    finally:
        cluster.shutdown()
    wl, _ = read_run(runs[0]["metrics"], args.warmup, args.cooldown)  # the planner sees the first run only
    for run in runs:
        by_role = {**dict(zip(RATIO_ROLES, run["ratios"])), "critic": run["ratios"][0]}
        run["predicted_step_s"] = predict(plan_placement(NODES, PER_NODE, by_role, ROLES, 1), wl)[0]
    predicted, measured = ranks([r["predicted_step_s"] for r in runs]), ranks([r["measured_step_s"] for r in runs])
    best = candidates(NODES, PER_NODE, wl, keep=3)[:3]
    lines = [f"{'ratios':<26} {'devices':<38} {'predicted_s':>11} {'measured_s':>10} {'pred/meas':>9} ranks (p/m)"]
    for run, p, m in zip(runs, predicted, measured):
        lines.append(f"{str(run['ratios']):<26} {devices_text(run):<38} {run['predicted_step_s']:11.3f} "
                     f"{run['measured_step_s']:10.3f} {run['predicted_step_s'] / run['measured_step_s']:9.2f} {p}/{m}")
    match = "yes" if predicted == measured else "no"
    lines += [f"rankings match: {match} (predicted {predicted}, measured {measured})",
              "planner's best for this cluster, from the first run: "
              + "; ".join(f"{c['override']} ({c['step_s']:.3f} s)" for c in best),
              f"{NODES} nodes x {PER_NODE} devices, {args.steps} steps, first {args.warmup} and last "
              f"{args.cooldown} left out; "
              f"cpus: {os.cpu_count()}", f"command: {command}"]
    print("\n".join(lines))
    result = {"runs": runs, "rank_predicted": predicted, "rank_measured": measured,
              "rankings_match": predicted == measured, "planner_best": best, "workload": wl.__dict__,
              "steps": args.steps, "warmup": args.warmup, "cooldown": args.cooldown, "command": command}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Path(f"{args.out}.txt").write_text("\n".join(lines) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
