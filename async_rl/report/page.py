"""The report page: one self-contained HTML file (inline SVG, no script) from a Timeline and, where
given, the run's Metrics (async_rl/report/summary.py)."""

from __future__ import annotations

import datetime
import os
from html import escape
from typing import Optional

from async_rl.core.bottleneck import bottleneck_sentence
from async_rl.plan import PlanError, candidates, devices_used, read_run
from async_rl.report import charts
from async_rl.report.summary import SYNC_PARTS, WAITS, Metrics, Timeline, percentile

REWARD_KEY = "critic/score/mean"
VAL_PREFIX, VAL_SUFFIX = "val-core/", "/reward/mean@1"
STAGE_ORDER = ("dataloader", "generate", "rollout", "reward", "values", "logp", "ref_logp", "actor_train",
               "critic_train", "param_update")


def ordered(stages) -> list[str]:
    known = [s for s in STAGE_ORDER if s in stages]
    return known + sorted(s for s in stages if s not in STAGE_ORDER)


def busy_ratios(timeline: Timeline, metrics: Optional[Metrics]) -> tuple[dict[str, float], str]:
    """The stages' busy ratios and where they come from: the metrics (what the run logged, warm-up
    step left out) where they hold them, else the timeline's work spans over its window."""
    logged = metrics.busy_ratios() if metrics is not None else {}
    if logged:
        return logged, "async/<stage>/busy_ratio in the metrics, step 1 left out"
    return timeline.busy_ratios(), "the timeline's work spans over its window"


def planner_advice(metrics_path: str, ahead: int) -> str:
    """async_rl.plan's best use_nodes_ratios for the run's own device count, or why there is none."""
    try:
        workload, run = read_run(metrics_path)
        workload.ahead = ahead
        total = devices_used(run, workload.roles)
        best = candidates(1, total, workload, keep=3)[:3]
    except (PlanError, KeyError, ValueError) as exc:
        return f"<p>No plan: {escape(str(exc))}</p>"
    rows = "".join(f"<tr><td>{c['step_s']:.3f}</td><td>{c['bubble']:.2f}</td><td><code>{escape(c['override'])}</code>"
                   "</td></tr>" for c in best)
    return (f"<p>Measured {run['step_s']:.3f} s/step over {run['steps']} steps on {total} devices. The planner's "
            "best layouts for the same devices (predicted; <code>python -m async_rl.plan</code> plans other "
            f"clusters):</p><table><tr><th>s/step</th><th>bubble</th><th>override</th></tr>{rows}</table>")


SLOWEST_SYNCS = 5  # the versions whose sync the page shows part by part


def run_name(timeline: Timeline, source: str) -> str:
    """The run as its title names it: verl's experiment name (else the timeline's folder) and the UTC time
    its timeline starts."""
    name = timeline.run.get("experiment_name") or os.path.basename(os.path.normpath(source))
    started = datetime.datetime.fromtimestamp(timeline.start_s, datetime.timezone.utc)
    return f"{name}, {started:%Y-%m-%d %H:%M} UTC"


def sync_section(timeline: Timeline) -> str:
    """The weight sync as a distribution over versions (median, p90, max of the whole sync and of each
    part), then the slowest versions part by part."""
    totals = timeline.sync_totals()
    columns = [("whole sync", list(totals.values()))] + [
        (part, [parts[part] for parts in timeline.sync.values() if part in parts]) for part in SYNC_PARTS]
    rows = "".join(f"<tr><td>{escape(name)}</td><td>{percentile(v, 50):.3g}</td><td>{percentile(v, 90):.3g}</td>"
                   f"<td>{max(v):.3g}</td></tr>" for name, v in columns if v)
    table = (f"<table><tr><th>s over {len(totals)} version{'s' if len(totals) != 1 else ''}</th><th>median</th>"
             f"<th>p90</th><th>max</th></tr>{rows}</table>")
    slowest = sorted(totals, key=lambda v: -totals[v])[:SLOWEST_SYNCS]
    bars = charts.stacked_bars([(f"version {v}", timeline.sync[v]) for v in sorted(slowest)], SYNC_PARTS, "s")
    return table + f"<p>The {len(slowest)} slowest, part by part:</p>" + bars


def section(title: str, body: str, note: str = "") -> str:
    return f"<h2>{escape(title)}</h2>" + (f'<p class="note">{escape(note)}</p>' if note else "") + body


def render(timeline: Timeline, metrics: Optional[Metrics], source: str, metrics_path: Optional[str] = None) -> str:
    """The page's HTML. `source`: the timeline's folder (the title's name where the run logged no experiment)."""
    ahead = int(timeline.run.get("generate_ahead_steps", 2))
    busy, busy_from = busy_ratios(timeline, metrics)
    title = f"Run report: {run_name(timeline, source)}"
    parts = [f"<h1>{escape(title)}</h1>",
             f'<p class="verdict">{escape(bottleneck_sentence(busy, ahead))}</p>',
             f'<p class="note">Busy ratios from {escape(busy_from)}: '
             + ", ".join(f"{s} {b:.0%}" for s, b in sorted(busy.items(), key=lambda x: -x[1])) + ".</p>"]
    stages = ordered(timeline.stages)
    lanes = {s: timeline.work_spans.get(s, []) for s in stages}
    lanes.update(timeline.replica_spans)
    parts.append(section("Timeline", charts.gantt(lanes, timeline.window_s),
                         "Each stage's work on each batch, and each rollout replica's time with requests in flight "
                         "(hover for details); the full timeline: trace.json in https://ui.perfetto.dev."))
    if metrics is not None:
        reward = {"train " + REWARD_KEY: metrics.series(REWARD_KEY)}
        val_keys = sorted({k for d in metrics.steps.values() for k in d
                           if k.startswith(VAL_PREFIX) and k.endswith(VAL_SUFFIX)})
        reward.update({k: metrics.series(k) for k in val_keys})
        parts.append(section("Reward", charts.lines({k: v for k, v in reward.items() if v}, "step", "reward")))
        step_s = metrics.mean("timing_s/step")
        if step_s:
            rows = [("step", step_s)] + [(s, busy.get(s, 0.0) * step_s) for s in ordered(busy)]
            parts.append(section("Step time by stage", charts.bars(rows, "s"),
                                 f"Mean s per step (step 1 left out) and each stage's busy s in it, k={ahead}: "
                                 "stages overlap, so their sum can exceed the step."))
    rows = [(s, {"busy": 100 * timeline.stages[s].shares_s["busy"] / timeline.window_s,
                 **{WAITS[w]: 100 * timeline.stages[s].shares_s[w] / timeline.window_s for w in WAITS}})
            for s in stages] if timeline.window_s > 0 else []
    parts.append(section("Busy and waiting", charts.stacked_bars(rows, ["busy", *WAITS.values()], "%", scale_max=100),
                         "% of the timeline's window, each second counted once: busy (working on at least one "
                         "batch), else the first wait that holds it in the order shown; the rest of a bar's 100% "
                         "is idle."))
    if metrics is not None and metrics.staleness_hist():
        hist = [(f"{s} version{'s' if s != 1 else ''} old", 100 * v) for s, v in metrics.staleness_hist().items()]
        parts.append(section("Staleness", charts.bars(hist, "%"),
                             "Trained samples by how many versions behind the trained policy they were generated."))
    if timeline.sync:
        parts.append(section("Weight sync per version", sync_section(timeline),
                             "The train rank's gather and send; recv, register-buffer and load: the slowest receiver's."))
    if metrics_path is not None:
        parts.append(section("Planner", planner_advice(metrics_path, ahead)))
    if timeline.dropped:
        parts.append(f'<p class="note">Events dropped (over 200,000 a stage): {escape(str(timeline.dropped))}</p>')
    style = ("body{font-family:sans-serif;max-width:960px;margin:2em auto}.verdict{font-size:1.2em;font-weight:bold}"
             ".note{color:#555}td,th{padding:2px 8px;text-align:left}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title><style>{style}</style>"
            f"</head><body>{''.join(parts)}</body></html>")
