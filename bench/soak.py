"""Soak: the demo for many steps, the resident memory of the driver and of every Ray process.

Runs the demo's verl command with the flag (`DIR/overrides.txt`, `--steps` steps, validation
every 100) as a subprocess and samples, every `--every-s` seconds, the RSS (MiB) of the driver
and of each process under it (the stages' `ray::StageHost`, worker groups, rollout server,
raylet, GCS), with the newest logged step. Prints, per process, its RSS at the end of warm-up
(`--warmup-steps`), at the end and the growth; the goal is growth < 5% for every process.
Samples land in `--json` for plotting.

    python bench/soak.py [--steps 2000] [--warmup-steps 200] [--json bench/results/soak.json]
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
from bench.command import command_line  # noqa: E402

GOAL_GROWTH = 0.05  # after warm-up, no process grows by more than this fraction
PYTHON_OPTIONS_WITH_VALUE = ("-W", "-X")  # Python 3's options that take the next word as their value


def process_name(proc) -> str:
    """A stable label: Ray's process title without the method running now (`ray::StageHost.call` ->
    `ray::StageHost`); for Python, what it runs past its options (`python -m <module>`, `python -c`,
    `python <script>`: `python -u .../log_monitor.py` -> `python log_monitor.py`); else the program's name."""
    try:
        cmd = proc.cmdline()
    except Exception:  # noqa: BLE001 - the process may be gone
        return "?"
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split(".", 1)[0]
    exe = Path(cmd[0]).name if cmd else proc.name()
    if not exe.startswith("python"):
        return exe
    args, i = cmd[1:], 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c"):
        i += 2 if args[i] in PYTHON_OPTIONS_WITH_VALUE else 1
    if i >= len(args):
        return "python"
    if args[i] == "-m":
        return f"python -m {args[i + 1]}" if i + 1 < len(args) else "python -m"
    return "python -c" if args[i] == "-c" else f"python {Path(args[i]).name}"


def sample_tree(root_pid: int) -> dict[str, float]:
    """RSS in MiB by process label of `root_pid` and its descendants (equal labels are numbered)."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out: dict[str, float] = {}
    for proc in sorted(procs, key=lambda p: p.pid):
        try:
            rss = proc.memory_info().rss / 2**20
        except Exception:  # noqa: BLE001
            continue
        label = "driver" if proc.pid == root_pid else process_name(proc)
        if label == "ray::IDLE":
            continue  # pooled workers come and go
        name, i = label, 1
        while name in out:
            i += 1
            name = f"{label} #{i}"
        out[name] = rss
    return out


def newest_step(metrics_path: Path) -> int:
    if not metrics_path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in metrics_path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def growth_table(samples: list[dict], warmup_steps: int, total_steps: int | None = None) -> list[dict]:
    """Per process: RSS at the first sample at or after `warmup_steps`, at the last one taken while
    training (before `total_steps`: the final validation and teardown come after), and the growth."""
    after = [s for s in samples if s["step"] >= warmup_steps and (total_steps is None or s["step"] < total_steps)]
    if len(after) < 2:
        return []
    first, last = after[0]["rss_mib"], after[-1]["rss_mib"]
    rows = []
    for name in sorted(set(first) & set(last)):
        rows.append({"process": name, "warm_mib": first[name], "end_mib": last[name],
                     "growth": (last[name] - first[name]) / first[name] if first[name] else 0.0})
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--every-s", type=float, default=10.0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    command = command_line()
    from async_rl.demo import demo_overrides, prepare

    samples: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        demo = Path(tmp) / "demo"
        prepare(demo, seed=0)
        metrics = Path(tmp) / "metrics.jsonl"
        overrides = demo_overrides(demo, extra={"trainer.total_training_steps": args.steps, "trainer.test_freq": 100})
        env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics), "PYTHONUNBUFFERED": "1"}
        with open(Path(tmp) / "run.log", "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], cwd=tmp, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
            start = time.monotonic()
            while proc.poll() is None:
                samples.append({"t_s": time.monotonic() - start, "step": newest_step(metrics),
                                "rss_mib": sample_tree(proc.pid)})
                print(f"\rstep {samples[-1]['step']}/{args.steps}, {len(samples[-1]['rss_mib'])} processes, "
                      f"total {sum(samples[-1]['rss_mib'].values()):.0f} MiB", end="", flush=True)
                time.sleep(args.every_s)
        print()
        if proc.returncode != 0:
            raise SystemExit(f"the run failed (exit {proc.returncode}):\n{(Path(tmp) / 'run.log').read_text()[-3000:]}")
    rows = growth_table(samples, args.warmup_steps, args.steps)
    print(f"command: {command}\ncpus: {os.cpu_count()}; {args.steps} steps; warm-up {args.warmup_steps} steps; "
          f"{len(samples)} samples every {args.every_s:g} s")
    print(f"{'process':>40} | {'warm MiB':>9} {'end MiB':>9} {'growth':>7}")
    for r in rows:
        print(f"{r['process'][:40]:>40} | {r['warm_mib']:>9.1f} {r['end_mib']:>9.1f} {r['growth']:>7.1%}")
    worst = max(rows, key=lambda r: r["growth"], default=None)
    if worst is not None:
        verdict = "met" if worst["growth"] < GOAL_GROWTH else "missed"
        print(f"goal: every process grows < {GOAL_GROWTH:.0%} after warm-up: {verdict} "
              f"(largest: {worst['process']} {worst['growth']:.1%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "growth": rows, "samples": samples}, f)
    return rows


if __name__ == "__main__":
    main()
