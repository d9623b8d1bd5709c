"""bench/agent_loop_overhead.py runs (a tiny batch) and writes its measurements: both variants send the
servers the same requests."""

from __future__ import annotations

import json
import time

from bench_script import run_bench


def test_agent_loop_overhead_prints_and_writes_json(tmp_path):
    out = tmp_path / "overhead.json"
    start = time.monotonic()
    proc = run_bench("agent_loop_overhead.py", ["--prompts", "4", "--n", "2", "--batches", "2", "--json", out], tmp_path)
    wall = time.monotonic() - start
    assert "command: python bench/agent_loop_overhead.py --prompts 4 --n 2" in proc.stdout
    result = json.loads(out.read_text())
    assert result["samples_per_batch"] == 8
    # like for like: each variant sent 4 prompts x 2 samples a batch over 3 batches (one warm-up), the
    # same prompts (a chat-templated prompt is more than a token)
    assert result["requests_received"] == {"agent_loop": 3 * 8, "bare_request": 3 * 8}
    tokens = result["prompt_tokens_received"]
    assert tokens["agent_loop"] == tokens["bare_request"] > 3 * 8
    # a batch of each fits in the process's life, as this test clocks it
    assert 0 < result["agent_loop_s_per_batch"] and 0 < result["bare_request_s_per_batch"]
    assert result["agent_loop_s_per_batch"] + result["bare_request_s_per_batch"] < wall
