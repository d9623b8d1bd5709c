"""bench/rollout_backends.py runs both backends on the demo model and writes its table (vllm venv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "rollout_backends.py")


@pytest.mark.vllm
def test_rollout_backends_bench_prints_and_writes_json(tmp_path):
    out = tmp_path / "backends.json"
    args = ["--prompts", "4", "--samples", "2", "--max-tokens", "3", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "command: " in proc.stdout and "vllm/cpu:" in proc.stdout
    result = json.loads(out.read_text())
    assert result["requests"] == 8 and len(result["rows"]) == 1
    row = result["rows"][0]
    for backend in ("cpu", "vllm"):
        assert row[backend]["tokens"] == 8 * 3  # EOS ignored: every response is max-tokens long
        assert row[backend]["tokens_per_s"] > 0 and row[backend]["load_s"] > 0
    assert row["vllm_over_cpu_tokens_per_s"] == row["vllm"]["tokens_per_s"] / row["cpu"]["tokens_per_s"]
