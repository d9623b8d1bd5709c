"""Benchmark: what the timeline (`+trainer.async_trace_path`) costs a training step, and its picture.

The demo through verl's command with the flag, `--steps` steps each, the timeline off and on in
interleaved pairs (off/on, then on/off, ...: a slow minute of the machine hits both). The cost is
the mean s/step (steps after `--warmup`) on over off, minus 1; goal: under 2%. `--png` draws the
last traced run's timeline (each stage's work on each batch) from its trace.json.

    python bench/trace_cost.py [--steps 30] [--pairs 2] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench.command import command_line, shown_path  # noqa: E402

GOAL = 0.02


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_seconds(rows: list[dict], warmup: int) -> list[float]:
    """timing_s/step of the training steps after the first `warmup`."""
    steps = {r["step"]: r["data"]["timing_s/step"] for r in rows if "timing_s/step" in r["data"]}
    return [steps[s] for s in sorted(steps) if s > warmup]


def summarize(runs: list[dict]) -> dict:
    """Mean s/step per mode and the timeline's cost (on / off - 1), overall and per interleaved pair
    (`runs` in pairs: one off and one on each, either order)."""
    mean = {mode: statistics.mean(s for r in runs if r["trace"] == mode for s in r["step_s"]) for mode in (False, True)}
    pair_costs = []
    for first, second in zip(runs[::2], runs[1::2]):
        on, off = (first, second) if first["trace"] else (second, first)
        pair_costs.append(statistics.mean(on["step_s"]) / statistics.mean(off["step_s"]) - 1)
    return {"off_s_per_step": mean[False], "on_s_per_step": mean[True], "cost": mean[True] / mean[False] - 1,
            "pair_costs": pair_costs}


def span_cost_s(n: int = 200_000) -> float:
    """Seconds one recorded span adds over an unrecorded one (TraceRecorder.span, on against off)."""
    from async_rl.core.trace import TraceRecorder

    def loop(recorder) -> float:
        start = time.perf_counter()
        for i in range(n):
            with recorder.span("work", "process", index=i):
                pass
        return time.perf_counter() - start

    return max(0.0, (loop(TraceRecorder("x", enabled=True)) - loop(TraceRecorder("x"))) / n)


def spans_per_step(trace_dir: Path, steps: int) -> float:
    """Spans a training step records, from a traced run's trace.json."""
    document = json.loads((trace_dir / "trace.json").read_text())
    return sum(1 for e in document["traceEvents"] if e["ph"] == "X") / steps


def draw(trace_dir: Path, png: str, seconds: float = 10.0) -> None:
    """The timeline's first `seconds` after the first trained step, one lane per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from async_rl.report.page import ordered
    from async_rl.report.summary import read_timeline

    timeline = read_timeline(str(trace_dir / "trace.json"))
    lanes = {s: timeline.work_spans.get(s, []) for s in ordered(timeline.stages)}
    lanes.update({track: [(a, b, t) for a, b, t in spans if b > a] for track, spans in timeline.replica_spans.items()})
    start = min((end for _, end, _ in lanes.get("actor_train", [])), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(lanes) + 1.2))
    for row, (stage, spans) in enumerate(reversed(list(lanes.items()))):
        # short spans widened to stay visible, long ones narrowed a little to show where one ends
        shown = [(a - start, max(b - a - 0.01, 0.02)) for a, b, _ in spans if b > start and a < start + seconds]
        ax.broken_barh(shown, (row - 0.4, 0.8), color=f"C{row % 10}")
    ax.set_yticks(range(len(lanes)), list(reversed(list(lanes))))
    ax.set_xlim(0, seconds)
    ax.set_xlabel("seconds after the first trained step")
    ax.set_title("the demo's timeline: each stage's work on each batch, the replica's requests in flight")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of s/step")
    parser.add_argument("--pairs", type=int, default=2, help="runs with the timeline off and on, interleaved")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    parser.add_argument("--json", help="write the runs and the summary here")
    parser.add_argument("--png", help="draw the last traced run's timeline here")
    args = parser.parse_args(argv)
    e2e = _load("e2e")
    from async_rl.demo import prepare

    work = Path(tempfile.mkdtemp(prefix="trace_cost_"))
    demo = work / "demo"
    prepare(demo, seed=0)
    runs = []
    for pair in range(args.pairs):
        for trace in ((False, True) if pair % 2 == 0 else (True, False)):
            name = f"pair {pair + 1} timeline {'on' if trace else 'off'}"
            run_dir = work / f"run{len(runs)}"
            run_dir.mkdir()
            extra = {"trainer.total_training_steps": args.steps, "trainer.test_freq": -1,
                     "trainer.val_before_train": False}
            if trace:
                extra["+trainer.async_trace_path"] = str(run_dir / "trace")
            rows = e2e.run_system(name, demo, run_dir, run_dir / "metrics.jsonl", extra, args.timeout_s)
            runs.append({"run": name, "trace": trace, "step_s": step_seconds(rows, args.warmup), "dir": str(run_dir)})
            print(f"{name}: {statistics.mean(runs[-1]['step_s']):.3f} s/step over {len(runs[-1]['step_s'])} steps",
                  flush=True)
    summary = summarize(runs)
    traced = Path(next(r["dir"] for r in reversed(runs) if r["trace"])) / "trace"
    summary["spans_per_step"] = spans_per_step(traced, args.steps)
    summary["span_cost_s"] = span_cost_s()
    summary["estimate"] = summary["spans_per_step"] * summary["span_cost_s"] / summary["off_s_per_step"]
    print(f"command: {command_line()}")
    print(f"the demo, {args.steps} steps a run, steps after {args.warmup}; {args.pairs} pairs interleaved")
    print(f"timeline off {summary['off_s_per_step']:.3f} s/step, on {summary['on_s_per_step']:.3f} s/step: "
          f"cost {summary['cost']:+.1%} (goal under {GOAL:.0%}: {'met' if summary['cost'] < GOAL else 'not met'}); "
          "per pair " + ", ".join(f"{c:+.1%}" for c in summary["pair_costs"]) + " (the machine's run-to-run noise)")
    print(f"from its parts: {summary['spans_per_step']:.0f} spans a step x {summary['span_cost_s'] * 1e6:.2f} us a span "
          f"= {summary['spans_per_step'] * summary['span_cost_s'] * 1e3:.2f} ms, {summary['estimate']:.2%} of a step "
          "(an upper bound: the stages record in their own processes, beside each other)")
    if args.png:
        draw(traced, args.png)
        print(f"plot: {shown_path(args.png)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command_line(), "runs": [{k: v for k, v in r.items() if k != "dir"} for r in runs],
                       **summary}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
