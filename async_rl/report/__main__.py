"""python -m async_rl.report TRACE_DIR [--metrics FILE]: write TRACE_DIR/report.html (async_rl/report)."""

from __future__ import annotations

import argparse
import sys

from async_rl.report import ReportError, write_report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m async_rl.report", description=__doc__)
    parser.add_argument("trace_dir", help="the folder given as +trainer.async_trace_path (holds trace.json)")
    parser.add_argument("--metrics", help="the run's metrics JSONL (verl's file logger, VERL_FILE_LOGGER_PATH)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.trace_dir, args.metrics)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
