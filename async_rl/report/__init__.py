"""A run's report: `python -m async_rl.report TRACE_DIR [--metrics FILE]` writes `TRACE_DIR/report.html`,
one self-contained page (the bottleneck in one sentence, the timeline, reward, step time by stage, busy
and waiting time, staleness, the weight sync's distribution over versions, the planner's advice).

- summary.py: the numbers, from trace.json (+trainer.async_trace_path) and verl's metrics JSONL;
- charts.py: inline SVG charts; page.py: the HTML.
The pipeline writes the report itself when a run with a timeline ends, fails or stops.
"""

from __future__ import annotations

import os
from typing import Optional

from async_rl.core.trace import TRACE_FILE
from async_rl.report.page import render
from async_rl.report.summary import ReportError, read_metrics, read_timeline

REPORT_FILE = "report.html"

__all__ = ["REPORT_FILE", "ReportError", "write_report"]


def write_report(trace_dir: str, metrics_path: Optional[str] = None) -> str:
    """Write `trace_dir/report.html` from `trace_dir/trace.json` and the metrics JSONL `metrics_path`
    (None: the page without reward, staleness and planner); returns its path. ReportError names a
    missing or unreadable input."""
    timeline = read_timeline(os.path.join(trace_dir, TRACE_FILE))
    metrics = read_metrics(metrics_path) if metrics_path is not None else None
    path = os.path.join(trace_dir, REPORT_FILE)
    with open(f"{path}.tmp", "w") as f:
        f.write(render(timeline, metrics, os.path.abspath(trace_dir), metrics_path))
    os.replace(f"{path}.tmp", path)
    return path
