"""The run's timeline (`+trainer.async_trace_path=DIR`): every stage records its spans from the
start of training; the driver gathers them, aligns each process's clock to its own and writes
`DIR/trace.json` when the run ends, fails or stops (async_rl/core/trace.py), then `DIR/report.html`
from it and the run's metrics (async_rl/report)."""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import ray

from async_rl.build import BuiltPipeline
from async_rl.core.timeouts import CALL_TIMEOUT_S
from async_rl.core.trace import TRACE_FILE, clock_offset, same_clock, write_trace
from async_rl.report import REPORT_FILE, ReportError, write_report

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 2.0  # all stages together: a run that failed or is stopping waits no longer for its timeline


def start_trace(built: BuiltPipeline) -> None:
    """Have every stage record its timeline (no-op without `trainer.async_trace_path`)."""
    if built.run.async_cfg.trace_path:
        built.wait({name: stage.enable_trace.remote() for name, stage in built.stages.items()}, CALL_TIMEOUT_S,
                   "start the timeline")


def keep_earlier_attempt(folder: str, attempt: int) -> None:
    """Before restart `attempt` (1, 2, ...: `trainer.max_restarts`) writes its timeline, the one of the
    attempt that failed becomes `trace_attempt<attempt - 1>.json` (its report `report_attempt<..>.html`)."""
    if attempt < 1:
        return
    for name in (TRACE_FILE, REPORT_FILE):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            stem, ext = os.path.splitext(name)
            os.replace(path, os.path.join(folder, f"{stem}_attempt{attempt - 1}{ext}"))


def write_run_trace(built: BuiltPipeline, attempt: int = 0) -> Optional[str]:
    """Gather every stage's timeline and write `trace.json` in `trainer.async_trace_path`; returns its path
    (None: no timeline asked). Best effort: a stage that cannot answer is left out, with a warning.
    `attempt`: the pipeline's restart number (0: the first run; `keep_earlier_attempt`)."""
    folder = built.run.async_cfg.trace_path
    if not folder:
        return None
    keep_earlier_attempt(folder, attempt)
    pops = {name: stage.pop_trace.remote() for name, stage in built.stages.items()}
    deadline = time.monotonic() + READ_TIMEOUT_S
    batches, offsets = [], {}
    for name, stage in built.stages.items():
        try:
            batch = ray.get(pops[name], timeout=max(0.0, deadline - time.monotonic()))
            offset = 0.0 if same_clock(batch) else clock_offset(
                lambda: ray.get(stage.clock.remote(), timeout=max(0.0, deadline - time.monotonic())))
        except Exception as exc:  # noqa: BLE001 - a dead or hung stage's timeline is lost; the rest is written
            logger.warning("the timeline of stage %s is missing from the trace: %s", name, type(exc).__name__)
            continue
        batches.append(batch)
        offsets[batch["owner"]] = offset
    cfg = built.run.async_cfg
    path = write_trace(os.path.join(folder, TRACE_FILE), batches, offsets,
                       run={"generate_ahead_steps": cfg.generate_ahead_steps, "use_nodes_ratios": list(cfg.use_nodes_ratios),
                            "experiment_name": built.run.config.trainer.get("experiment_name")})
    logger.warning("timeline written to %s (open it in https://ui.perfetto.dev)", path)
    return path


def metrics_file_of(tracking) -> Optional[str]:
    """The JSONL verl's `file` logger of `tracking` writes (None: no such logger)."""
    backends = getattr(tracking, "logger", None)
    return getattr(backends.get("file"), "filepath", None) if isinstance(backends, dict) else None


def write_run_report(built: BuiltPipeline, tracking) -> Optional[str]:
    """Write `report.html` beside the run's trace.json (None: no timeline asked or none written). Best
    effort: a report that cannot be made is logged, the run's outcome stays its own."""
    folder = built.run.async_cfg.trace_path
    if not folder or not os.path.exists(os.path.join(folder, TRACE_FILE)):
        return None
    try:
        path = write_report(folder, metrics_file_of(tracking))
    except (ReportError, OSError, ValueError) as exc:
        logger.warning("no report for this run: %s", exc)
        return None
    logger.warning("report written to %s", path)
    return path
