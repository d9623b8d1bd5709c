"""The demo's verl command with the stages of a node in one process against one process per stage.

Runs `python -m verl.trainer.main_ppo <the demo's overrides>` (the flag on, `--steps` steps, no
validation, a Ray of its own) once with `+trainer.stage_processes=per_node` and once with `per_stage`,
alternating `--repeats` times, and reports per mode the run's wall seconds (Python starts and imports,
Ray, the verl workers, the steps) and the median `timing_s/step` after the first `--warmup-steps` steps.
(Not the CPU seconds of the run's processes from the kernel's accounting of reaped children: Ray's
raylet lets the kernel reap its workers, whose CPU that accounting then never sees; measured per
process from /proc instead, docs/architecture.md#stage-processes.)

Usage: python bench/stage_processes.py [--steps 20] [--warmup-steps 5] [--repeats 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.command import command_line  # noqa: E402

MODES = ("per_node", "per_stage")
def run_once(demo: Path, mode: str, steps: int, workdir: Path) -> dict:
    """One run of the demo's command; its wall seconds and step times."""
    from async_rl.demo import demo_overrides

    workdir.mkdir(parents=True)
    metrics = workdir / "metrics.jsonl"
    extra = {"trainer.total_training_steps": steps, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "+trainer.stage_processes": mode}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *demo_overrides(demo, extra=extra)]
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)  # a Ray of its own: its processes are the run's descendants
    start = time.monotonic()
    with open(workdir / "out.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        code = proc.wait()
    wall = time.monotonic() - start
    if code != 0:
        raise RuntimeError(f"the {mode} run failed: {(workdir / 'out.log').read_text()[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    step_s = [r["data"]["timing_s/step"] for r in rows if "timing_s/step" in r["data"]]
    return {"wall_s": wall, "step_s": step_s}


def summarize(runs: dict[str, list[dict]], warmup_steps: int) -> dict:
    """Per mode the median wall seconds over its runs and the median step time after warm-up;
    per_stage / per_node of each."""
    modes = {mode: {"wall_s": statistics.median(r["wall_s"] for r in rs),
                    "step_s": statistics.median(s for r in rs for s in r["step_s"][warmup_steps:])}
             for mode, rs in runs.items()}
    return {"modes": modes, **{f"{what}_ratio": modes["per_stage"][f"{what}_s"] / modes["per_node"][f"{what}_s"]
                               for what in ("wall", "step")}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from async_rl.demo import prepare

    root = Path(tempfile.mkdtemp(prefix="stage_processes_"))
    demo = root / "demo"
    prepare(demo, seed=0)
    runs = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            runs[mode].append(run_once(demo, mode, args.steps, root / f"{mode}_{repeat}"))
            print(f"{mode} #{repeat}: {runs[mode][-1]['wall_s']:.1f} s wall", flush=True)
    result = {"steps": args.steps, "warmup_steps": args.warmup_steps, "repeats": args.repeats,
              **summarize(runs, args.warmup_steps),
              "command": command_line(None if argv is None else ["bench/stage_processes.py", *argv])}
    summary = result["modes"]
    print(f"{'mode':<10} {'wall s':>8} {'s / step':>9}")
    for mode, row in summary.items():
        print(f"{mode:<10} {row['wall_s']:8.1f} {row['step_s']:9.3f}")
    print(f"per_stage / per_node: wall {result['wall_ratio']:.2f}x, s/step {result['step_ratio']:.2f}x")
    print(f"command: {result['command']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
