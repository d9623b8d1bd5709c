"""python -m async_rl.plan: the planner's command line (async_rl/plan/__init__.py)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from async_rl.core.placement import plan_placement
from async_rl.plan import __doc__ as PLAN_DOC
from async_rl.plan.model import PlanError, candidates, devices_text, devices_used, predict, ratio_of, read_run, sync_step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=PLAN_DOC.split("\n\n")[0])
    parser.add_argument("--metrics", required=True, help="a short run's metrics JSONL (VERL_FILE_LOGGER_PATH)")
    parser.add_argument("--nodes", type=int, required=True, help="trainer.nnodes of the cluster to plan for")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="trainer.n_gpus_per_node")
    parser.add_argument("--replica-devices", type=int, default=1, help="devices one rollout replica spans (tp)")
    parser.add_argument("--ahead", type=int, default=2, help="trainer.generate_ahead_steps of the planned run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps to skip")
    parser.add_argument("--cooldown", type=int, default=1, help="last steps to skip (generate_ahead_steps - 1)")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--json", help="write the plan here")
    args = parser.parse_args(argv)
    try:
        wl, run = read_run(args.metrics, args.warmup, args.cooldown)
        wl.ahead = args.ahead
        ranked = candidates(args.nodes, args.gpus_per_node, wl, args.replica_devices, keep=args.top)[:args.top]
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    devices, roles = run["devices"], wl.roles  # the run's own layout, as one node (the model ignores nodes)
    own_total = devices_used(run, roles)
    own = plan_placement(1, own_total, {r: ratio_of(n, own_total) for r, n in devices.items()}, roles, 1)
    own_s, sync_s = predict(own, wl)[0], sync_step(wl, args.nodes * args.gpus_per_node)
    rows = [{**c, "sync_step_s": sync_s, "speedup": sync_s / c["step_s"]} for c in ranked]
    print(f"run: {run['steps']} steps measured on {devices_text(run)}: {run['step_s']:.3f} s/step measured, "
          f"{own_s:.3f} predicted; work (device-s/step) " + ", ".join(f"{r}={w:.3f}" for r, w in wl.work.items())
          + f"; gather {wl.gather_s:.3f} s; fixed (s) " + ", ".join(f"{s}={t:.3f}" for s, t in wl.fixed.items()))
    print(f"cluster: {args.nodes} node(s) x {args.gpus_per_node} devices; synchronous schedule {sync_s:.3f} s/step; "
          f"best first:\n{'#':>2} {'step_s':>8} {'bubble':>6} {'sync_s':>8} {'speedup':>7}  devices  override")
    for i, r in enumerate(rows, 1):
        print(f"{i:>2} {r['step_s']:8.3f} {r['bubble']:6.2f} {sync_s:8.3f} {r['speedup']:6.2f}x  {devices_text(r)}  "
              f"{r['override']}")
    print(f"best: {rows[0]['override']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run, "predicted_run_step_s": own_s, "workload": asdict(wl), "candidates": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
