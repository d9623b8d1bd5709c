"""bench/agent_loop_overhead.py runs (a tiny batch) and writes its measurements."""

from __future__ import annotations

import json

from bench_script import run_bench


def test_agent_loop_overhead_prints_and_writes_json(tmp_path):
    out = tmp_path / "overhead.json"
    proc = run_bench("agent_loop_overhead.py", ["--prompts", "4", "--n", "2", "--batches", "2", "--json", out], tmp_path)
    assert "command: python bench/agent_loop_overhead.py --prompts 4 --n 2" in proc.stdout
    result = json.loads(out.read_text())
    assert result["samples_per_batch"] == 8
    assert result["agent_loop_s_per_batch"] > 0 and result["bare_request_s_per_batch"] > 0
    assert abs(result["agent_loop_ms_per_sample"] - 1000 * result["agent_loop_s_per_batch"] / 8) < 1e-9
