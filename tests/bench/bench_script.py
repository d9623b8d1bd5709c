"""Run one of bench/'s scripts as a newcomer types it (`python bench/<script> ...`), for tests/bench."""

from __future__ import annotations

import os
import subprocess
import sys

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def run_bench(script: str, args: list, cwd, timeout_s: float = 600, env: dict | None = None
              ) -> subprocess.CompletedProcess:
    """`python bench/<script> <args>` in a fresh process in `cwd`, within `timeout_s` seconds; returns it
    finished (stdout and stderr as text). Fails the test with the tail of its output unless it exits 0."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH_DIR, script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout_s, cwd=cwd, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc
