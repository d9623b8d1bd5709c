"""bench/rollout_backends.py runs both backends on the demo model and writes its table (vllm venv)."""

from __future__ import annotations

import json

import pytest

from bench_script import run_bench


@pytest.mark.vllm
def test_rollout_backends_bench_prints_and_writes_json(tmp_path):
    out = tmp_path / "backends.json"
    args = ["--prompts", "4", "--samples", "2", "--max-tokens", "3", "--repeats", "1", "--json", str(out)]
    proc = run_bench("rollout_backends.py", args, tmp_path)
    assert "command: " in proc.stdout and "vllm/cpu:" in proc.stdout
    result = json.loads(out.read_text())
    assert result["requests"] == 8 and len(result["rows"]) == 1
    row = result["rows"][0]
    for backend in ("cpu", "vllm"):
        assert row[backend]["tokens"] == 8 * 3  # EOS ignored: every response is max-tokens long
        assert row[backend]["tokens_per_s"] > 0 and row[backend]["load_s"] > 0
    assert row["vllm_over_cpu_tokens_per_s"] == row["vllm"]["tokens_per_s"] / row["cpu"]["tokens_per_s"]
